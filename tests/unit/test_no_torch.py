"""``inspect`` and ``verify`` of safetensors and DCP checkpoints never import torch (issue 29: a CLI
that starts at once): each command runs in a fresh interpreter, which then reports whether any
``torch`` module was loaded; the command's own output and exit code are checked too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ckpttool import Checkpointer
from ckpttool.formats import open_source
from ckpttool.index import TensorEntry

from ..helpers import FIXTURES, flip_bit

#: runs the CLI as ``python -m ckpttool`` does, then reports its exit code and the torch modules loaded
_RUN = """
import json, runpy, sys
sys.argv = ["ckpttool", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("ckpttool", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
sys.stdout.flush()
torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps({"code": code, "torch": torch[:5]}), file=sys.stderr)
"""

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ckpttool(*args: object) -> tuple[int, str]:
    """Run ``ckpttool ARGS`` in a fresh interpreter; asserts it imported no torch; (exit code, stdout)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _RUN, *map(str, args)], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 0 and lines, (args, out.stdout, out.stderr)
    result = json.loads(lines[-1])
    assert result["torch"] == [], f"ckpttool {' '.join(map(str, args))} imported {result['torch']}"
    return result["code"], out.stdout


def _flip_tensor_byte(path: str) -> str:
    """Flip a bit in the middle of the data of the checkpoint's largest tensor; returns its key."""
    with open_source(path) as src:
        key = max(src.index().tensors(), key=lambda e: e.nbytes).key
        loc, start, end = src.data_spans(key)[0]
    flip_bit(loc.path, (start + end) // 2, 3)
    return key


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """A training root written by the Checkpointer (steps 1 and 2, commit records with a manifest);
    its extra state holds a dtype and torch's version (values read back as torch's objects)."""
    path = str(tmp_path_factory.mktemp("no-torch") / "run")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with Checkpointer(path) as ck:
        for step in (1, 2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, model, opt, extra={"step": step, "dtype": torch.bfloat16, "torch": torch.__version__})
        ck.wait()
    return path


SAFETENSORS = os.path.join(FIXTURES, "plain-model.safetensors")
HF_SHARDED = os.path.join(FIXTURES, "realworld", "hf-safetensors-sharded")
PLAIN_DCP = os.path.join(FIXTURES, "plain-dcp-w2")
TORCH24_DCP = os.path.join(FIXTURES, "realworld", "torch24-dcp")  # its extra state holds a TorchVersion


@pytest.mark.parametrize("path,fmt,tensors", [(SAFETENSORS, "safetensors", 6), (HF_SHARDED, "safetensors", None),
                                              (PLAIN_DCP, "dcp", 21), (TORCH24_DCP, "dcp", None)],
                         ids=["safetensors", "hf-sharded", "plain-dcp", "torch24-dcp"])
def test_inspect_and_verify_of_a_checkpoint_import_no_torch(path, fmt, tensors):
    code, out = ckpttool("inspect", path)
    assert code == 0 and out.startswith(f"{fmt} checkpoint "), out
    if tensors is not None:
        assert f"{tensors} tensors" in out
    code, out = ckpttool("inspect", path, "--json")
    doc = json.loads(out)
    with open_source(path) as src:  # (this process has torch: the reference)
        index = src.index()
        assert [e["key"] for e in doc["entries"]] == list(index)
        for e in doc["entries"]:
            if e["kind"] == "tensor":
                entry = index[e["key"]]
                assert isinstance(entry, TensorEntry) and e["dtype"] == str(entry.dtype).removeprefix("torch.")
                assert e["shape"] == list(entry.shape) and e["bytes"] == entry.nbytes
    code, out = ckpttool("verify", path)
    assert code == 0 and out.splitlines()[-1].startswith("OK: "), out


def test_a_training_root_and_its_steps_import_no_torch(root):
    code, out = ckpttool("inspect", root)
    assert code == 0 and out.startswith("training root ") and "committed steps (2)" in out, out
    step = os.path.join(root, "step-2")
    code, out = ckpttool("inspect", step)
    assert code == 0 and out.startswith("dcp checkpoint "), out
    assert "extra.dtype" in out and "= torch.bfloat16" in out and f"TorchVersion = '{torch.__version__}'" in out, out
    code, out = ckpttool("verify", root)
    assert code == 0 and "note: checked against the manifest" in out and out.splitlines()[-1].startswith("OK: "), out
    code, out = ckpttool("verify", step, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["tensors_checked"] > 0 and report["objects_checked"] >= 3


def test_values_are_still_torchs_objects_for_the_library(root):
    """What stays a stand-in inside inspect and verify is torch's own object for everyone else."""
    from torch.torch_version import TorchVersion

    with open_source(os.path.join(root, "step-2")) as src:
        assert src.read_object("extra.dtype") is torch.bfloat16
        version = src.read_object("extra.torch")
        assert type(version) is TorchVersion and version == torch.__version__
        entry = src.index()["model.0.weight"]
        assert entry.dtype is torch.float32 and src.read_tensor("model.0.weight").dtype is torch.float32


def test_damage_is_still_found_without_torch(root, tmp_path):
    plain = str(tmp_path / "plain-dcp")
    shutil.copytree(PLAIN_DCP, plain)
    key = _flip_tensor_byte(plain)
    code, out = ckpttool("verify", plain)
    assert code == 1 and "does not match its CRC-32" in out and repr(key) in out, out

    step = str(tmp_path / "step")
    shutil.copytree(os.path.join(root, "step-2"), step)
    key = _flip_tensor_byte(step)
    code, out = ckpttool("verify", step)
    assert code == 1 and "does not match the manifest's checksum" in out and repr(key) in out, out

    flat = str(tmp_path / "model.safetensors")
    shutil.copy(SAFETENSORS, flat)
    with open(flat, "ab") as f:  # safetensors stores no checksums: a trailing byte is what verify can see
        f.write(b"\0")
    code, out = ckpttool("verify", flat)
    assert code == 1 and "the file holds 581" in out, out


def test_help_imports_no_torch():
    code, out = ckpttool("--help")
    assert code == 0 and out.startswith("Usage: ckpttool")
