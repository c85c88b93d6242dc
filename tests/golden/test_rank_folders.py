"""Per-rank torch.save folders (FSDP2's manual sharded checkpointing; fixtures/rankfolders, made by
fixtures/make_rank_folders.py with plain torch on 2, 3 and 4 gloo ranks) through every command,
compared bit for bit with what plain torch reads from the same files.

The fixtures' optimizer is the guide's ``AdamW(model.parameters())``, which records no parameter
names: the commands name its indices only with ``--optimizer-order model`` (``STATED``), and the
expected values (fixtures/rankfolders/expected.json, named from the live objects) are compared
with what they read that way; each param group then says its names were stated."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ckpttool.formats import open_source
from ckpttool.formats.torch_ranks import STATED_NOTE
from ckpttool.index import TensorEntry

from ..dist.harness import run_ranks
from ..helpers import cli as run, FIXTURES, golden_of

FOLDERS = os.path.join(FIXTURES, "rankfolders")
with open(os.path.join(FOLDERS, "expected.json")) as f:
    EXPECTED = json.load(f)
STATED = ["--optimizer-order", "model"]


def named(got: dict) -> dict:
    """``got`` with the record of a stated order taken out, once checked to be in every param group."""
    notes = {k: v for k, v in got.items() if k.endswith(".param_names_from")}
    groups = {k.rsplit(".", 1)[0] for k in got if ".param_groups." in k and k.endswith(".lr")}
    assert {k.rsplit(".", 1)[0] for k in notes} == groups and groups, sorted(notes)
    assert all(v["value"] == STATED_NOTE for v in notes.values()), notes
    return {k: v for k, v in got.items() if k not in notes}


def passed(out: str) -> bool:
    """Whether a verify's output says it passed (notes may come before the verdict)."""
    return any(line.startswith("OK: ") for line in out.splitlines()) and "FAIL" not in out


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def folder(request, tmp_path_factory):
    dst = tmp_path_factory.mktemp("ranks") / request.param
    shutil.copytree(os.path.join(FOLDERS, request.param), dst)
    return str(dst), EXPECTED[request.param]


def test_reads_as_plain_torch_does(folder):
    path, expected = folder
    assert named(golden_of(path, optimizer_order="model")) == expected
    # unstated, the optimizer's state stays as torch wrote it: keyed by index, each value the same
    kept = golden_of(path)
    assert not any(k.startswith("optim.state.blocks") for k in kept) and "optim.state.0.exp_avg" in kept
    assert {k: v for k, v in kept.items() if not k.startswith("optim.")} == {k: v for k, v in expected.items()
                                                                           if not k.startswith("optim.")}
    assert sorted(v["sha256"] for k, v in kept.items() if k.startswith("optim.state.")) == \
        sorted(v["sha256"] for k, v in expected.items() if k.startswith("optim.state."))


def test_inspect_shows_global_shapes_placements_and_files(folder):
    path, expected = folder
    report = json.loads(run("inspect", path, "--json", *STATED))
    assert report["format"] == "torch-ranks"
    entries = {e["key"]: e for e in report["entries"]}
    assert {k for k, e in entries.items() if e["kind"] == "tensor"} == {k for k, v in expected.items() if "sha256" in v}
    weight = entries["model.blocks.0.w1.weight"]
    assert weight["shape"] == expected["model.blocks.0.w1.weight"]["shape"]  # global, not the local shard
    assert "Shard(0)" in weight["placement"] and len(weight["files"]) > 1
    assert "placement" not in entries["model.scale"]  # a buffer: the same whole tensor on every rank
    assert any("parameter indices mapped" in n and "as stated (--optimizer-order model)" in n for n in report["notes"])
    assert "optim.state.blocks.0.w1.weight.exp_avg" in entries  # keyed by name, not by index


def test_verify_passes_and_names_what_it_checked(folder):
    path, expected = folder
    for args in ([], STATED):
        out = run("verify", path, *args)
        assert passed(out) and f"OK: {sum(1 for v in expected.values() if 'sha256' in v)} tensors" in out


@pytest.mark.parametrize("to", ["dcp", "torch", "safetensors", "hf-sharded"])
def test_convert_to_every_format_is_bitwise(folder, to, tmp_path):
    path, expected = folder
    out = tmp_path / {"dcp": "out", "torch": "out.pt", "safetensors": "out.safetensors", "hf-sharded": "hf"}[to]
    extra = ["--only", "model", "--max-shard-size", "512"] if to == "hf-sharded" else STATED
    run("convert", path, out, *extra)
    got = golden_of(str(out))
    if to != "hf-sharded":
        got = named(got)
    if to == "hf-sharded":
        assert os.path.exists(out / "model.safetensors.index.json") and len(os.listdir(out)) > 2
        want = {k.removeprefix("model."): v for k, v in expected.items() if k.startswith("model.")}
    elif to == "safetensors":  # tensors only; the objects are listed as dropped
        want = {k: v for k, v in expected.items() if "sha256" in v}
        got = {k: v for k, v in got.items() if "sha256" in v}
    else:
        want = expected
    assert got == want
    if to != "safetensors":  # (whose output lacks the objects: verify --against would rightly say so)
        assert passed(run("verify", out, "--against", path, *(["--against-only", "model"] if to == "hf-sharded" else STATED)))


@pytest.mark.parametrize("world", [1, 3])
def test_reshard_is_what_plain_dcp_load_reads(folder, world, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, expected = folder
    out = tmp_path / f"w{world}"
    run("reshard", path, out, "--world-size", world, *STATED)
    assert sorted(n for n in os.listdir(out) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(world)]
    dcp_to_torch_save(str(out), str(tmp_path / "plain.pt"))  # plain torch, no ckpttool code
    state = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert named(_golden_nested(state)) == expected
    assert passed(run("verify", out, "--against", path, *STATED))


def _golden_nested(state: dict) -> dict:
    import sys

    sys.path.insert(0, FIXTURES)
    from make_rank_folders import golden

    return golden(state)


def load_folder(path: str, variant: str) -> dict:
    """On each rank of a new job: the fixture's model and AdamW, sharded by FSDP2 over this job's
    ranks, loaded from ``path`` with ckpttool.load; the full state, gathered by plain torch."""
    import sys

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckpttool

    sys.path.insert(0, FIXTURES)
    from make_rank_folders import build_model, golden

    dim, hidden = (8, 12) if variant in ("hsdp", "fsdp-tp") else (7, 10)
    with torch.device("meta"):
        model = build_model(dim, hidden)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    model.scale.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    ckpttool.load(path, model, optimizer)
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return golden({"model": msd, "optim": osd}) if dist.get_rank() == 0 else {}


@pytest.mark.parametrize("variant,world", [("guide", 3), ("hsdp", 2), ("fsdp-tp", 3)])
def test_load_into_fsdp2_on_another_world_size(variant, world, tmp_path):
    path = str(tmp_path / variant)
    shutil.copytree(os.path.join(FOLDERS, variant), path)
    got = run_ranks(load_folder, world, path, variant)[0]
    want = {k: v for k, v in EXPECTED[variant].items() if not k.startswith("metadata.")}
    assert got == want


def test_a_missing_rank_file_is_named(tmp_path):
    path = tmp_path / "guide"
    shutil.copytree(os.path.join(FOLDERS, "guide"), path)
    os.remove(path / "optim_rank_1.pt")
    out = run("inspect", path, code=2)
    assert "optim_rank_1.pt is missing" in out
    out = run("verify", path, code=1)
    assert "optim_rank_1.pt is missing" in out


def test_a_flipped_bit_in_a_shard_is_caught(tmp_path):
    path = tmp_path / "guide"
    shutil.copytree(os.path.join(FOLDERS, "guide"), path)
    with open_source(str(path)) as src:
        entry = src.index()["model.blocks.1.w2.weight"]
        assert isinstance(entry, TensorEntry)
        file, start, _ = src.data_spans(entry.key)[1]  # rank 1's shard
    with open(file.path, "r+b") as f:
        f.seek(start + 4)
        byte = f.read(1)
        f.seek(start + 4)
        f.write(bytes([byte[0] ^ 0x10]))
    out = run("verify", path, code=1)
    assert "model_rank_1.pt" in out and "CRC-32" in out
    out = run("convert", path, tmp_path / "out.pt", code=2)
    assert "model_rank_1.pt" in out and not os.path.exists(tmp_path / "out.pt")


def load_like_the_guide(path: str, variant: str, mesh_shape: tuple[int, ...]) -> dict:
    """On each rank of a new job: the fixture's model and AdamW under FSDP2 on ``mesh_shape``, loaded
    with the guide's manual code (each rank torch.loads its own files, plain torch only); the full
    state, gathered by plain torch."""
    import sys

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, FIXTURES)
    from make_rank_folders import build_model, golden

    rank = dist.get_rank()
    dim, hidden = (8, 12) if variant in ("hsdp", "fsdp-tp") else (7, 10)
    with torch.device("meta"):
        model = build_model(dim, hidden)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard") if len(mesh_shape) == 2 else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model.load_state_dict(torch.load(f"{path}/model_rank_{rank}.pt", weights_only=False))
    optimizer.load_state_dict(torch.load(f"{path}/optim_rank_{rank}.pt", weights_only=False))
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = golden({"model": msd, "optim": osd}) if rank == 0 else {}
    if rank == 0:
        out.update(golden({"metadata": torch.load(f"{path}/metadata.pt", weights_only=False)}))
    return out


@pytest.mark.parametrize("variant,world,mesh", [("guide", 3, None), ("uneven", 2, None), ("hsdp", 4, "2x2")])
def test_reshard_to_a_per_rank_folder_that_a_new_job_loads_with_plain_torch(variant, world, mesh, tmp_path):
    out = tmp_path / "ranks"
    run("reshard", os.path.join(FOLDERS, variant), out, "--world-size", world, "--to", "torch-ranks",
        *(["--mesh", mesh] if mesh else []))
    assert sorted(os.listdir(out)) == sorted(["metadata.pt"] + [f"{p}_rank_{r}.pt" for p in ("model", "optim") for r in range(world)])
    assert named(golden_of(str(out), optimizer_order="model")) == EXPECTED[variant]  # ckpttool reads it back
    saved = torch.load(out / "optim_rank_0.pt", weights_only=False)  # keyed as optimizer.state_dict() keys it
    assert sorted(saved["state"]) == list(range(15)) and [i for g in saved["param_groups"] for i in g["params"]] == list(range(15))
    shape = tuple(int(n) for n in mesh.split("x")) if mesh else (world,)
    got = run_ranks(load_like_the_guide, world, str(out), variant, shape)[0]
    assert got == EXPECTED[variant]


def test_a_stray_file_of_dtensors_is_refused_by_name(tmp_path):
    path = tmp_path / "guide"
    shutil.copytree(os.path.join(FOLDERS, "guide"), path)
    shutil.copy(path / "model_rank_0.pt", path / "ema.pt")  # one rank's DTensors, under no rank's name
    out = run("inspect", path, code=2)
    assert "ema.pt" in out and "holds DTensors" in out
