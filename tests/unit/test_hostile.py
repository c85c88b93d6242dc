"""Every command and both load functions against the committed hostile corpus (fixtures/hostile,
built by fixtures/make_hostile.py), and the attacks that cannot be committed as files: each is
refused or caught with exit 1/2 and one line that names it, nothing is written outside the output,
and nothing is left behind."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpttool
from ckpttool import Checkpointer, formats
from ckpttool.cli import main
from ckpttool.errors import CkptError
from ckpttool.formats import open_source

from ..helpers import FIXTURES, output_name, time_limit

HOSTILE = os.path.join(FIXTURES, "hostile")
sys.path.insert(0, FIXTURES)
from make_hostile import CASES, NOTED  # noqa: E402


def tree_digest(path: str) -> str:
    """What a directory tree holds (names, link targets, bytes): to prove nothing wrote into it."""
    h = hashlib.sha256()
    for base, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(base, name)
            h.update(p.encode())
            h.update(os.readlink(p).encode() if os.path.islink(p) else Path(p).read_bytes())
    return h.hexdigest()


def run_cli(*args) -> tuple[int, str, str]:
    with time_limit(120):  # a hang fails the test instead of stalling the suite
        result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def assert_refused(code: int, out: str, err: str, fragment: str, what: str) -> None:
    assert code in (1, 2), (what, code, out, err)
    assert "Traceback" not in out + err, (what, out, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (what, err)
        assert fragment in lines[0], (what, fragment, err)
    else:
        assert fragment in out, (what, fragment, out)


def case_path(name: str) -> str:
    kind = CASES[name][0]
    path = os.path.join(HOSTILE, name)
    return os.path.join(path, "step-2" if name == "root-damaged-commit" else "step-1") if kind == "root" else path


@pytest.fixture(scope="module", autouse=True)
def corpus_untouched():
    before = tree_digest(HOSTILE)
    yield
    assert tree_digest(HOSTILE) == before, "a command wrote into the hostile corpus"


def test_the_corpus_is_what_the_script_builds(tmp_path):
    """The committed corpus is the script's output (regenerate with fixtures/make_hostile.py)."""
    import make_hostile

    make_hostile.build(str(tmp_path / "hostile"))
    assert sorted(os.listdir(tmp_path / "hostile")) == sorted(os.listdir(HOSTILE))
    for name in [*CASES, *NOTED]:
        assert os.path.lexists(os.path.join(HOSTILE, name)), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_command_refuses_the_case(name, tmp_path):
    kind, fragment = CASES[name]
    path = case_path(name)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    commands = [("verify", path)]
    commands += [("convert", path, out_dir / output_name(fmt)) for fmt in formats.output_names()]
    if kind in ("dcp", "root", "ranks"):
        commands.append(("reshard", path, out_dir / "resharded", "--world-size", "2"))
    for args in commands:
        code, out, err = run_cli(*args)
        assert_refused(code, out, err, fragment, args)
    assert os.listdir(out_dir) == [], "a failed command left output behind"
    code, out, err = run_cli("inspect", path)  # inspect reads metadata only: it may succeed
    if code != 0:
        assert_refused(code, out, err, fragment, ("inspect", path))


@pytest.mark.parametrize("name", sorted(NOTED))
def test_verify_never_calls_a_case_read_past_with_a_note_ok(name, tmp_path):
    kind, fragment, exit_code, note = NOTED[name]
    path = os.path.join(HOSTILE, name)
    code, out, err = run_cli("verify", path)
    assert code == exit_code and fragment in out, (code, out, err)
    assert "Traceback" not in out + err and not any(line.startswith("OK") for line in out.splitlines()), out
    code, out, err = run_cli("convert", path, tmp_path / "full.pt")  # converts what it reads, saying what it did not
    assert code == 0 and note in err, (code, out, err)


def _model_for(path: str) -> torch.nn.Module:
    """A module whose parameters have the keys and shapes the checkpoint declares (where it can be read)."""
    shapes = {"w": (10, 3), "b": (3,)}
    try:
        with open_source(path, verify=False) as src:
            shapes = {e.key.removeprefix("model."): e.shape for e in src.index().tensors()}
    except CkptError:
        pass
    module = torch.nn.Module()
    for key, shape in shapes.items():
        *parents, name = key.split(".")
        owner = module
        for part in parents:  # a dotted key (a state dict's own nesting): submodules
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
    return module


# every kind: ckpttool.load reads every format (issue 37)
@pytest.mark.parametrize("name", sorted(CASES))
def test_both_load_functions_refuse_the_case(name):
    kind, fragment = CASES[name]
    path = case_path(name)
    if kind == "root":
        model, opt = torch.nn.Linear(3, 4), None
        opt = torch.optim.AdamW(model.parameters())
        with pytest.raises(CkptError, match=re.escape(fragment)):
            ckpttool.load(path, model, opt)
        step = int(os.path.basename(path).split("-")[1])
        with pytest.raises(CkptError, match=re.escape(fragment)):
            Checkpointer(os.path.dirname(path)).load(model, opt, step=step)
        return
    model = _model_for(path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CkptError, match=re.escape(fragment)):
        ckpttool.load(path, model)
    if name != "dcp-flipped-bit":  # only a checksum of tensor data fails after bytes reached the model
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a refused load changed the model"


def test_a_damaged_newest_step_is_never_loaded(caplog):
    root = os.path.join(HOSTILE, "root-damaged-commit")
    ckpt = Checkpointer(root)
    assert ckpt.steps() == [1]
    model = torch.nn.Linear(3, 4)
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        assert ckpt.load(model, torch.optim.AdamW(model.parameters())).step == 1
    assert "commit record damaged" in caplog.text and "[2]" in caplog.text
    code, out, _ = run_cli("inspect", root)
    assert code == 0 and "damaged (never loaded): step 2" in out
    doc = json.loads(run_cli("inspect", root, "--json")[1])
    assert [d["step"] for d in doc["damaged"]] == [2] and [s["step"] for s in doc["steps"]] == [1]
    code, out, _ = run_cli("verify", root)
    assert code == 1 and "commit record is damaged" in out


# --- attacks that are not files in the corpus ---------------------------------------------------


def test_fifo_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "dir" / ".metadata")
    for args in (("inspect", fifo), ("verify", fifo), ("convert", fifo, tmp_path / "o.safetensors"), ("inspect", tmp_path / "dir")):
        start = time.monotonic()
        code, out, err = run_cli(*args)
        assert time.monotonic() - start < 10
        assert_refused(code, out, err, "not a regular file", args)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISFIFO(os.stat(tmp_path / "dir" / ".metadata").st_mode)


def test_twenty_thousand_chunks_verify_in_seconds(tmp_path):
    """verify, inspect and convert are linear in the number of chunks (was quadratic: 150 s+)."""
    from ckpttool.formats.dcp import DcpSink
    from ckpttool.engine import plan_entries, run

    class Rows:
        world_size = 1

        def boxes_of(self, rank, key, shape):
            return [((i, 0), (1, shape[1])) for i in range(shape[0])] if rank == 0 else []

    src = tmp_path / "rows.pt"
    torch.save({"w": torch.arange(20_000 * 2, dtype=torch.float32).reshape(20_000, 2)}, src)
    ck = tmp_path / "ck"
    with open_source(str(src)) as source:
        run(source, DcpSink(ckpttool.storage.resolve(str(ck)), layout=Rows()), plan_entries(source))
    for args in (("verify", ck), ("inspect", ck), ("convert", ck, tmp_path / "o.safetensors")):
        start = time.monotonic()
        code, out, err = run_cli(*args)
        assert code == 0, (args, out, err)
        assert time.monotonic() - start < 60, args


def test_huge_world_size_is_a_usage_error(tmp_path, ref_pt):
    run_cli("convert", ref_pt, tmp_path / "ck")
    code, out, err = run_cli("reshard", tmp_path / "ck", tmp_path / "o", "--world-size", "100000000")
    assert_refused(code, out, err, "--world-size 100000000", "reshard")
    assert not (tmp_path / "o").exists()


def test_force_never_destroys_more_than_dst(tmp_path):
    root = tmp_path / "run"
    model = torch.nn.Linear(3, 4)
    Checkpointer(root).save(1, model)
    before = tree_digest(str(root))
    other = tmp_path / "other.pt"
    torch.save({"w": torch.ones(2)}, other)
    cases = [
        (("convert", root / "step-1", root, "--force"), "contains the source"),
        (("convert", root / "step-1", tmp_path, "--force"), "contains the source"),
        (("convert", root / "step-1", root / "step-1" / "x.pt", "--force"), "inside the source"),
        (("convert", other, root, "--force"), "training root holding committed steps"),
        (("reshard", root / "step-1", root, "--world-size", "2", "--force"), "contains the source"),
    ]
    for args, fragment in cases:
        code, out, err = run_cli(*args)
        assert_refused(code, out, err, fragment, args)
    assert tree_digest(str(root)) == before and other.exists()


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path, ref_pt):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        big = tmp_path / "big.pt"
        torch.save({"w": torch.randn(1000, 100)}, big)
        for name in ("o.safetensors", "o.pt", "o_dcp"):
            code, out, err = run_cli("convert", big, mnt / name)
            assert_refused(code, out, err, "no space left on device while writing", name)
        assert os.listdir(mnt) == []
        model = torch.nn.Linear(100, 100)
        with pytest.raises(CkptError, match="no space left on device while writing"):
            Checkpointer(mnt / "run").save(1, model, torch.optim.AdamW(model.parameters()))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_retention_and_clean_never_follow_a_symlink_out_of_the_root(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".ckpttool-commit.json").write_text('{"step": 0}')
    (outside / "precious").write_text("keep me")
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(outside, root / "step-0")
    os.symlink(outside, root / ".step-9.tmp-00000000")
    ckpt = Checkpointer(root, keep_last=1)
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        ckpt.save(step, model)
    ckpt.clean()
    assert ckpt.steps() == [3]
    assert (outside / "precious").read_text() == "keep me" and (outside / ".ckpttool-commit.json").exists()
    assert os.path.islink(root / "step-0") and os.path.islink(root / ".step-9.tmp-00000000")


def test_a_hostile_file_never_runs_code_anywhere(tmp_path):
    """The corpus' pickles reach no code: no marker appears whatever reads them."""
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model": {"w": torch.ones(2)}, "x": Evil()}, evil)
    for args in (("inspect", evil), ("verify", evil), ("convert", evil, tmp_path / "o.safetensors")):
        code, out, err = run_cli(*args)
        assert_refused(code, out, err, "refused to unpickle", args)
    assert not marker.exists()
    shutil.rmtree(tmp_path / "o.safetensors", ignore_errors=True)
