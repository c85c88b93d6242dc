"""The CLI through click's CliRunner: exit codes, one-line errors, --json, --help examples."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ckpttool.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("command", ["inspect", "convert", "reshard", "verify", "clean", "train"])
def test_help_has_examples(command):
    result = run(command, "--help")
    assert result.exit_code == 0 and "Examples" in result.output


def test_python_m_ckpttool_is_the_cli(tmp_path):
    """``python -m ckpttool`` (what ``torchrun -m ckpttool`` runs) is the same CLI, exit codes included."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ckpttool", "inspect", str(tmp_path / "missing")], capture_output=True, text=True)
    assert out.returncode == 2 and "does not exist" in out.stderr and "Usage: ckpttool" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "ckpttool", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("Usage: ckpttool")


def test_bad_inputs_exit_2_with_one_line(tmp_path, ref_pt):
    (tmp_path / "random.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "exists.pt").write_bytes(b"x")
    (tmp_path / "nometa").mkdir()
    (tmp_path / "nometa" / "__0_0.distcp").write_bytes(b"x")
    cases = [
        (["inspect", tmp_path / "missing"], "does not exist"),
        (["inspect", tmp_path / "random.bin"], "not a checkpoint"),
        (["inspect", tmp_path / "nometa"], "without .metadata"),
        (["convert", ref_pt, tmp_path / "o.pt", "--dtype", "int3"], "--dtype"),
        (["convert", ref_pt, tmp_path / "exists.pt"], "already exists"),
        (["convert", ref_pt, ref_pt], "same path"),
        (["convert", ref_pt, tmp_path / "x", "--to", "dcp", "--max-shard-size", "1GB"], "torch or safetensors output only"),
        (["convert", ref_pt, tmp_path / "y.pt", "--memory-budget", "lots"], "Invalid value for '--memory-budget': cannot read size 'lots'"),
        (["verify", ref_pt, "--against", ref_pt, "--rtol", "-1"], "--rtol"),
        (["convert", ref_pt, tmp_path / "z.safetensors", "--only", "nope"], "top-level keys are"),
    ]
    for args, expect in cases:
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert expect in result.output, (args, result.output)
        assert "Traceback" not in result.output


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_traceback_before_or_after_the_command(tmp_path, where):
    args = ["inspect", tmp_path / "missing"]
    result = run(*(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert result.exit_code == 2 and "Traceback" in result.output and "does not exist" in result.output
    plain = run(*args)
    assert plain.exit_code == 2 and "Traceback" not in plain.output


def test_quiet_is_accepted_after_the_command(tmp_path, ref_pt):
    result = run("verify", ref_pt, "-q")
    assert result.exit_code == 0, result.output


def test_inspect_json_lists_keys_chunks_and_objects(tmp_path, ref_pt):
    result = run("inspect", ref_pt, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["format"] == "torch"
    by_key = {e["key"]: e for e in doc["entries"]}
    assert by_key["model.w"]["shape"] == [7, 3] and by_key["model.w"]["dtype"] == "float32"
    assert by_key["model.w"]["bytes"] == 84 and by_key["model.w"]["chunks"] == 1
    assert by_key["extra.name"]["value"] == "'run-1'"


def test_convert_text_and_json(tmp_path, ref_pt):
    result = run("convert", ref_pt, tmp_path / "o.safetensors", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["dst_format"] == "safetensors" and doc["dropped"] == []
    result = run("convert", tmp_path / "o.safetensors", tmp_path / "back")
    assert result.exit_code == 0 and "wrote" in result.output and "(dcp)" in result.output


def test_inspect_training_root_lists_steps_and_incomplete(tmp_path, ref_pt):
    root = tmp_path / "run"
    (root / "step-5").mkdir(parents=True)  # no commit record: incomplete
    run("convert", ref_pt, root / "step-3")
    (root / "step-3" / ".ckpttool-commit.json").write_text('{"step": 3, "world_size": 1}')
    doc = json.loads(run("inspect", root, "--json").output)
    assert [s["step"] for s in doc["steps"]] == [3] and doc["incomplete"] == ["step-5"]
    text = run("inspect", root).output
    assert "step-5" in text and "incomplete" in text


def test_reshard_bad_input_exit_2(tmp_path, ref_pt):
    run("convert", ref_pt, tmp_path / "ck")
    cases = [
        (["reshard", tmp_path / "ck", tmp_path / "a", "--world-size", "0"], "--world-size must be at least 1"),
        (["reshard", tmp_path / "ck", tmp_path / "b", "--world-size", "4", "--mesh", "3x2"], "--mesh 3x2"),
        (["reshard", ref_pt, tmp_path / "c", "--world-size", "2"], "reads DCP checkpoints"),
        (["reshard", tmp_path / "ck", tmp_path / "ck", "--world-size", "2"], "same path"),
    ]
    for args, expect in cases:
        result = run(*args)
        assert result.exit_code == 2 and expect in result.output, (args, result.output)
    result = run("reshard", tmp_path / "ck", tmp_path / "ok", "--world-size", "3", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["world_size"] == 3 and sorted(doc["bytes_per_rank"]) == ["0", "1", "2"]
    assert run("reshard", tmp_path / "ck", tmp_path / "ok", "--world-size", "2").exit_code == 2  # exists, no --force


def test_clean_removes_only_incomplete_steps(tmp_path, ref_pt):
    import torch

    from ckpttool import Checkpointer

    model = torch.nn.Linear(2, 2)
    Checkpointer(tmp_path / "run").save(1, model)
    (tmp_path / "run" / ".step-2.tmp-00ff00ff").mkdir()
    (tmp_path / "run" / "step-3").mkdir()
    result = run("clean", tmp_path / "run", "--dry-run")
    assert result.exit_code == 0 and "would remove 2" in result.output
    result = run("clean", tmp_path / "run", "--json")
    assert json.loads(result.output)["removed"] == [".step-2.tmp-00ff00ff", "step-3"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-1"]


def test_train_flags_are_checked_before_launching():
    result = run("train", "--nproc", "2", "--steps", "2", "--batch-size", "5")
    assert result.exit_code == 2 and "--batch-size 5" in result.output and "Traceback" not in result.output
    result = run("train", "--nproc", "2", "--steps", "2", "--save-every", "1")
    assert result.exit_code == 2 and "--save-every needs --ckpt-dir" in result.output


def test_flag_errors_come_before_torch_is_imported():
    """A mistyped flag is answered at once, not after torch's import (10-20 s on a loaded machine)."""
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from ckpttool.cli import main; "
            "r = CliRunner().invoke(main, sys.argv[1:]); print(r.exit_code, 'torch' in sys.modules)")
    for args in (["convert", "a", "b", "--memory-budget", "garbage"], ["convert", "a", "b", "--max-shard-size", "-3"],
                 ["verify", "a", "--against", "b", "--rtol", "-1"], ["convert", "a", "b", "--dtype", "int3"]):
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True).stdout.split()
        assert out == ["2", "False"], (args, out)


def test_train_help_lists_the_trainers_flags_and_presets_agree():
    from ckpttool.training.trainer.args import PRESET_NAMES, make_parser
    from ckpttool.training.trainer.model import PRESETS

    assert tuple(sorted(PRESETS)) == PRESET_NAMES
    out = run("train", "--help").output
    for action in make_parser()._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert flag in out, flag


def test_train_flag_errors_come_before_torch_is_imported():
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from ckpttool.cli import main; "
            "r = CliRunner().invoke(main, sys.argv[1:]); print(r.exit_code, 'torch' in sys.modules)")
    for args in (["train", "--steps", "x"], ["train", "--steps", "4", "--batch-size", "5"], ["train", "--steps", "2", "--save-every", "1"]):
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True).stdout.split()
        assert out[-2:] == ["2", "False"], (args, out)
