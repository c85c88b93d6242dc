"""Trainer checkpoint folders (fixtures/trainers, made by fixtures/make_trainer_folders.py with
transformers' Trainer and accelerate's save_state) read as one checkpoint, part by part, compared bit
for bit with what plain torch, the safetensors library and json read from the same files; nothing
in a folder is passed over without a word."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from ckpttool.cli import main

from ..helpers import cli as run, FIXTURES, golden_of

FOLDERS = os.path.join(FIXTURES, "trainers")
with open(os.path.join(FOLDERS, "expected.json")) as f:
    EXPECTED = json.load(f)


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def folder(request, tmp_path_factory):
    dst = tmp_path_factory.mktemp("trainer") / request.param
    shutil.copytree(os.path.join(FOLDERS, request.param), dst)
    return str(dst), EXPECTED[request.param], request.param


def test_every_part_reads_as_plain_torch_reads_it(folder):
    path, expected, _ = folder
    assert golden_of(path) == expected


def test_inspect_lists_every_part_and_what_it_is(folder):
    path, expected, name = folder
    report = json.loads(run("inspect", path, "--json"))
    assert report["format"] == "trainer"
    tops = {e["path"][0] for e in report["entries"]}
    assert tops == {k.split(".", 1)[0] for k in expected}
    parts = {p["key"]: p for p in report["parts"] if p["key"]}  # each part: its file(s), format and key
    assert set(parts) == tops and parts["optimizer"]["format"] == "torch" and parts["model"]["format"] == "safetensors"
    assert all(os.path.exists(os.path.join(path, f)) for p in report["parts"] for f in p["file"].split(", "))
    notes = " ".join(report["notes"])
    if name.startswith("hf-trainer"):
        assert {"model", "optimizer", "scheduler", "rng_state", "trainer_state"} <= tops
        assert "training_args.bin" in notes and "TrainingArguments" in notes  # named, with why it is not read
        assert [p["file"] for p in report["parts"] if p.get("not_read")] == ["training_args.bin"]
        assert "config.json" in notes and "generation_config.json" in notes  # not state: said so
    else:
        assert {"model", "optimizer", "random_states_0", "random_states_1"} <= tops


def test_verify_fails_over_a_part_it_cannot_read_unless_narrowed(folder):
    path, expected, name = folder
    tensors = sum(1 for v in expected.values() if "sha256" in v)
    if name.startswith("hf-trainer"):
        out = run("verify", path, code=2)
        assert "training_args.bin: cannot be read" in out and "OK" not in out
        out = run("verify", path, "--only", "model")
        assert any(line.startswith("OK: ") for line in out.splitlines())
        assert "safetensors stores no checksums" in out  # what was not checked is said too
    else:
        out = run("verify", path)
        assert f"OK: {tensors} tensors" in out


@pytest.mark.parametrize("to", ["dcp", "torch", "safetensors"])
def test_convert_gives_one_state_with_a_key_per_part(folder, to, tmp_path):
    path, expected, name = folder
    out = tmp_path / {"dcp": "out", "torch": "out.pt", "safetensors": "out.safetensors"}[to]
    result = CliRunner().invoke(main, ["convert", path, str(out)])
    assert result.exit_code == 0, result.output
    if name.startswith("hf-trainer"):
        assert "note: not read: training_args.bin" in result.stderr  # the skipped part is named
    got = golden_of(str(out))
    if to == "safetensors":  # every tensor; the values JSON can hold; the others listed as dropped
        assert got == {k: expected[k] for k in got} and {k for k, v in expected.items() if "sha256" in v} <= set(got)
        dropped = set(expected) - set(got)
        assert all(k in result.stderr for k in dropped) and "dropped" in result.stderr
    else:
        assert got == expected
        assert run("verify", out, "--against", path).count("OK") == 1


def module_like(state: dict) -> torch.nn.Module:
    """A module whose parameters have the names and shapes of ``state``'s tensors (zeros): what a
    model of that architecture gives a load to fill."""
    root = torch.nn.Module()
    for name, value in state.items():
        *parents, leaf = name.split(".")
        module = root
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(value["shape"], dtype=getattr(torch, value["dtype"][6:]))))
    return root


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_dcp_of_a_folder_reshards_and_loads(name, tmp_path):
    """A trainer folder as DCP, resharded for 2 ranks: plain dcp.load reads it bitwise, and its model
    loads with ckpttool.load into a module of the model's parameters, bitwise."""
    import sys

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import ckpttool

    sys.path.insert(0, FIXTURES)
    from make_rank_folders import golden

    run("convert", os.path.join(FOLDERS, name), tmp_path / "dcp")
    run("reshard", tmp_path / "dcp", tmp_path / "w2", "--world-size", "2")
    dcp_to_torch_save(str(tmp_path / "w2"), str(tmp_path / "plain.pt"))
    assert golden(torch.load(tmp_path / "plain.pt", weights_only=False)) == EXPECTED[name]
    want = {k: v for k, v in EXPECTED[name].items() if k.startswith("model.")}
    model = module_like({k.removeprefix("model."): v for k, v in want.items()})
    ckpttool.load(str(tmp_path / "w2"), model)
    assert golden({"model": model.state_dict()}) == want


def test_a_flipped_bit_in_a_part_is_caught_and_named(tmp_path):
    path = tmp_path / "hf"
    shutil.copytree(os.path.join(FOLDERS, "hf-trainer"), path)
    from ckpttool.formats import open_source

    with open_source(str(path)) as src:
        file, start, _ = src.data_spans("optimizer.state.0.exp_avg")[0]
    with open(file.path, "r+b") as f:
        f.seek(start + 3)
        b = f.read(1)
        f.seek(start + 3)
        f.write(bytes([b[0] ^ 1]))
    out = run("verify", path, "--only", "optimizer", code=1)
    assert "optimizer.pt" in out and "CRC-32" in out
    out = run("convert", path, tmp_path / "out.pt", code=2)
    assert "optimizer.pt" in out and not (tmp_path / "out.pt").exists()


def test_a_damaged_part_stops_every_command_instead_of_being_skipped(tmp_path):
    """Only a value the allow-list refuses (training_args.bin) is named and gone past; a damaged
    optimizer must never drop out of a convert with a note (found by the fuzz test)."""
    path = tmp_path / "hf"
    shutil.copytree(os.path.join(FOLDERS, "hf-trainer"), path)
    (path / "optimizer.pt").write_bytes((path / "optimizer.pt").read_bytes()[:100])
    for args, code in ((("convert", path, tmp_path / "out.pt"), 2), (("inspect", path), 2), (("verify", path), 1)):
        out = run(*args, code=code)
        assert "optimizer.pt" in out, (args, out)
    assert not (tmp_path / "out.pt").exists()


# --- parts that must never pass as "not checkpoint state" (issue 39) ------------------------------


def _hf_trainer_with(tmp_path, name: str = "hf"):
    path = tmp_path / name
    shutil.copytree(os.path.join(FOLDERS, "hf-trainer"), path)
    return path


def _lora(path, binary: bool = False) -> dict:
    """A PEFT adapter as save_pretrained writes it: LoRA tensors keyed by their full names, and its config."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    tensors = {f"base_model.model.layers.{i}.attn.q_proj.lora_{ab}.weight": torch.randn(4 if ab == "A" else 16, 16 if ab == "A" else 4,
                                                                                          generator=gen)
               for i in range(2) for ab in "AB"}
    if binary:
        torch.save(tensors, path / "adapter_model.bin")
    else:
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["q_proj"]}))
    return tensors


@pytest.mark.parametrize("binary", [False, True], ids=["safetensors", "bin"])
def test_a_peft_trainer_folder_keeps_its_adapter_weights(tmp_path, binary):
    """A PEFT checkpoint has adapter_model.* and no model.safetensors: the adapter is read under
    its own key (its config too), verified and converted bitwise."""
    path = _hf_trainer_with(tmp_path)
    (path / "model.safetensors").unlink()
    tensors = _lora(path, binary)
    report = json.loads(run("inspect", path, "--json"))
    keys = {e["key"] for e in report["entries"]}
    assert {f"adapter.{k}" for k in tensors} <= keys and "adapter_config.r" in keys
    assert "adapter_model" not in " ".join(report["notes"])  # not passed over as "not state"
    out = run("verify", path, "--only", "adapter")
    assert "OK: 4 tensors" in out, out
    run("convert", path, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    for k, v in tensors.items():
        assert torch.equal(full["adapter"][k], v), k
    assert full["adapter_config"]["target_modules"] == ["q_proj"]


@pytest.mark.parametrize("name,make", [
    ("ema.pt", lambda p: torch.save({"shadow": torch.ones(3)}, p / "ema.pt")),
    ("pytorch_model.bin", lambda p: torch.save({"w": torch.ones(3)}, p / "pytorch_model.bin")),  # a second weights file
    ("global_step7", lambda p: (p / "global_step7").mkdir()),  # a directory of someone's shards
])
def test_checkpoint_data_the_reader_does_not_know_is_named_and_fails_verify_unless_narrowed(tmp_path, name, make):
    path = _hf_trainer_with(tmp_path)
    make(path)
    report = json.loads(run("inspect", path, "--json"))
    unread = [p for p in report["parts"] if p.get("not_read")]
    assert any(p["file"] == name and "checkpoint data" in p["not_read"] for p in unread), unread
    assert name not in " ".join(n for n in report["notes"] if "not checkpoint state" in n)
    out = run("verify", path, code=2)
    assert f"{name}: cannot be read: checkpoint data" in out and "OK" not in out, out
    assert run("verify", path, "--only", "model").splitlines()[-1].startswith("OK: ")


def test_accelerate_custom_checkpoints_are_read_under_their_own_key(tmp_path):
    path = tmp_path / "acc"
    shutil.copytree(os.path.join(FOLDERS, "accelerate-cpu"), path)
    torch.save({"step": 7, "ema": torch.arange(5.0)}, path / "custom_checkpoint_0.pkl")  # accelerate's save_custom_state
    report = json.loads(run("inspect", path, "--json"))
    assert {"custom_checkpoint_0.ema", "custom_checkpoint_0.step"} <= {e["key"] for e in report["entries"]}
    run("convert", path, tmp_path / "full.pt")
    assert torch.equal(torch.load(tmp_path / "full.pt", weights_only=False)["custom_checkpoint_0"]["ema"], torch.arange(5.0))


def test_two_files_for_one_part_are_ambiguous_input_not_damage(tmp_path):
    path = _hf_trainer_with(tmp_path)
    shutil.copy(path / "optimizer.pt", path / "optimizer.bin")
    for args in (("verify", path), ("inspect", path), ("convert", path, tmp_path / "out.pt")):
        out = run(*args, code=2)
        assert "two files for one part: optimizer.bin and optimizer.pt" in out and "restore" not in out, (args, out)
