"""Checkpoints written by the oldest and the newest torch of the declared range, read on this one.

fixtures/crossver/torch-X.Y/ was written by torch X.Y (fixtures/make_crossver.py): plain dcp.save,
plain torch.save, and ckpttool's own DCP and torch.save writers running on that torch. Every leg of
``make test-matrix`` runs this file, so each release reads what each other one wrote, both ways:
with ckpttool, and with plain torch (dcp.load, dcp_to_torch_save, torch.load).
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch


from ..helpers import FIXTURES, cli as run, golden_of as read_all

sys.path.insert(0, FIXTURES)
from make_crossver import ITEMS  # noqa: E402
from make_realworld import plain_torch_reads  # noqa: E402

CROSS = os.path.join(FIXTURES, "crossver")
WRITERS = sorted(os.listdir(CROSS))


def expected(writer: str) -> dict:
    with open(os.path.join(CROSS, writer, "expected.json")) as f:
        return json.load(f)["items"]


def test_the_oldest_declared_and_the_newest_release_wrote_fixtures():
    """The fixtures follow the declaration and the matrix: the oldest torch pyproject.toml admits
    and every release ``make test-matrix`` runs wrote one."""
    with open(os.path.join(FIXTURES, "..", "pyproject.toml")) as f:
        oldest = re.search(r'"torch>=(\d+\.\d+)"', f.read()).group(1)
    assert f"torch-{oldest}" in WRITERS, (oldest, WRITERS)
    with open(os.path.join(FIXTURES, "..", "Makefile")) as f:
        matrix = re.search(r"^MATRIX \?= (.+)$", f.read(), re.M).group(1).split()
    for release in matrix:
        assert "torch-" + ".".join(release.split(".")[:2]) in WRITERS, (release, WRITERS)
    for writer in WRITERS:  # each folder really was written by the torch it is named after
        with open(os.path.join(CROSS, writer, "expected.json")) as f:
            assert json.load(f)["torch"].startswith(writer.removeprefix("torch-") + "."), writer


@pytest.mark.parametrize("item", ITEMS)
@pytest.mark.parametrize("writer", WRITERS)
def test_ckpttool_reads_what_each_release_wrote(writer, item):
    got = read_all(os.path.join(CROSS, writer, item))
    assert got == expected(writer)[item]


def dcp_too_new_for_plain_torch(writer: str, item: str) -> bool:
    """torch 2.15's dcp.save pickles TensorProperties with six fields, which torch <= 2.14 cannot
    unpickle: DCP's own format does not let an older torch read it (docs/compat.md). ckpttool's
    writers, on any release, write the five every release reads."""
    version = lambda label: tuple(int(x) for x in label.removeprefix("torch-").split("."))  # noqa: E731
    return item == "dcp" and version(writer) >= (2, 15) and torch.__version__ < (2, 15)


@pytest.mark.parametrize("item", ITEMS)
@pytest.mark.parametrize("writer", WRITERS)
def test_plain_torch_of_this_release_reads_what_each_release_wrote(writer, item):
    """Including what ckpttool wrote on another release: its .metadata and archives are torch's."""
    path = os.path.join(CROSS, writer, item)
    if dcp_too_new_for_plain_torch(writer, item):
        with pytest.raises(BaseException) as failed:  # torch's CheckpointException is not an Exception
            plain_torch_reads(path)
        assert "too many values to unpack" in str(failed.value) + repr(getattr(failed.value, "failures", "")), failed.value
        return
    assert plain_torch_reads(path) == expected(writer)[item]


@pytest.mark.parametrize("item", ["dcp", "ckpttool-dcp"])
@pytest.mark.parametrize("writer", WRITERS)
def test_plain_dcp_load_into_preallocated_tensors(writer, item):
    import torch.distributed.checkpoint as dcp

    from make_realworld import titan_model

    if dcp_too_new_for_plain_torch(writer, item):
        pytest.skip("torch <= 2.14 cannot read torch 2.15's TensorProperties (the test above checks that it fails)")
    model = titan_model()
    state = {"model": {k: torch.full_like(v, float("nan")) for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=os.path.join(CROSS, writer, item))  # no process group: one process reads all
    full = torch.load(os.path.join(CROSS, writer, "full.pt"), weights_only=False)  # ours, and it holds a TorchVersion
    for key, value in state["model"].items():
        assert torch.equal(value.view(torch.uint8), full["model"][key].view(torch.uint8)), key


@pytest.mark.parametrize("writer", WRITERS)
def test_this_release_rewrites_another_releases_checkpoint_bitwise(writer, tmp_path):
    """ckpttool on this torch reshards and converts what another torch wrote; plain torch of this
    release reads the outputs back as the writer's release read its own checkpoint."""
    src = os.path.join(CROSS, writer, "dcp")
    want = expected(writer)["dcp"]
    run("reshard", src, tmp_path / "w2", "--world-size", "2")
    run("convert", src, tmp_path / "out.pt")
    for out in ("w2", "out.pt"):
        assert plain_torch_reads(str(tmp_path / out)) == want, out
        run("verify", tmp_path / out, "--against", src)
    run("convert", src, tmp_path / "model.safetensors", "--only", "model")
    run("verify", os.path.join(CROSS, writer, "full.pt"), "--against", tmp_path / "model.safetensors", "--only", "model")
