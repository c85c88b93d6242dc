"""verify: each corruption of DESIGN.md 5.4 caught and named, on DCP from both writers, torch files and
safetensors; random bit flips; --against finds one changed element."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil

import pytest
import torch
from click.testing import CliRunner

from ckpttool import convert
from ckpttool.cli import main
from ckpttool.errors import CkptError
from ckpttool.formats import open_source
from ckpttool.formats.dcp import read_metadata
from ckpttool.storage import resolve
from ckpttool.offline.verify import verify_against, verify_path

from .. import helpers
from ..helpers import flip_bit

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures")


@pytest.fixture(params=["plain-torch", "ckpttool"])
def dcp_dir(request, tmp_path, ref_pt):
    """A DCP checkpoint written by plain torch at 2 ranks, or by ckpttool's convert."""
    out = tmp_path / "ck"
    if request.param == "plain-torch":
        shutil.copytree(os.path.join(FIXTURES, "plain-dcp-w2"), out)
    else:
        convert(str(ref_pt), str(out))
    return out


def tensor_data_spans(path) -> list[tuple[str, int, int, str]]:
    """(file name, start, end, key) of every chunk's raw tensor bytes."""
    return [(os.path.basename(file), start, end, key) for file, start, end, key in helpers.tensor_data_spans(path)]


def test_untouched_checkpoints_pass(dcp_dir, ref_pt, tmp_path):
    assert verify_path(str(dcp_dir)).ok
    assert verify_path(str(ref_pt)).ok
    convert(str(ref_pt), str(tmp_path / "x.safetensors"))
    convert(str(ref_pt), str(tmp_path / "hf"), to="safetensors", max_shard_size="64B")
    assert verify_path(str(tmp_path / "x.safetensors")).ok and verify_path(str(tmp_path / "hf")).ok
    assert verify_path(os.path.join(FIXTURES, "trainer-w2")).ok


def test_missing_file_is_named(dcp_dir):
    victim = sorted(p for p in os.listdir(dcp_dir) if p.endswith(".distcp"))[-1]
    os.remove(dcp_dir / victim)
    report = verify_path(str(dcp_dir))
    assert not report.ok and any(p.file and victim in p.file and "missing" in p.what for p in report.problems)


def test_truncated_file_is_named_with_key(dcp_dir):
    victim = sorted(p for p in os.listdir(dcp_dir) if p.endswith(".distcp"))[0]
    data = (dcp_dir / victim).read_bytes()
    (dcp_dir / victim).write_bytes(data[: len(data) - 100])
    report = verify_path(str(dcp_dir))
    assert not report.ok
    assert any(victim in (p.file or "") and p.key and ("past the end" in p.what or "truncated" in p.what) for p in report.problems)


def test_flipped_bit_in_tensor_data_is_caught_with_file_and_key(dcp_dir):
    fname, start, end, key = tensor_data_spans(dcp_dir)[3]
    flip_bit(dcp_dir / fname, (start + end) // 2, 5)
    report = verify_path(str(dcp_dir))
    assert [(p.key, "CRC-32" in p.what, fname in p.file) for p in report.problems] == [(key, True, True)]


def test_inconsistent_metadata_gap_and_overlap(dcp_dir):
    md = read_metadata(resolve(str(dcp_dir)))
    sharded = [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.chunks) > 1]
    if not sharded:  # ckpttool's single-rank output: make a gap by growing the tensor instead
        key = next(k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.size) == 2)
        v = md.state_dict_metadata[key]
        v.size = torch.Size([v.size[0] + 1, v.size[1]])
        expect = "gap"
    else:
        key = sharded[0]
        v = md.state_dict_metadata[key]
        c = v.chunks[1]
        c.sizes = torch.Size([c.sizes[0] + 1, *c.sizes[1:]])  # overlaps the next or runs outside
        expect = ("overlap", "outside")
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(md))
    report = verify_path(str(dcp_dir))
    assert not report.ok
    assert any(p.key == key and any(e in p.what for e in ([expect] if isinstance(expect, str) else expect)) for p in report.problems)


def test_twenty_random_bit_flips_in_plain_torch_tensor_data_are_all_caught(tmp_path):
    src = os.path.join(FIXTURES, "plain-dcp-w2")
    spans = tensor_data_spans(src)
    rnd = random.Random(1234)
    for i in range(20):
        fname, start, end, key = rnd.choice(spans)
        work = tmp_path / f"flip{i}"
        shutil.copytree(src, work)
        flip_bit(work / fname, rnd.randrange(start, end), rnd.randrange(8))
        report = verify_path(str(work))
        assert not report.ok, (i, fname, key)
        assert any(p.key == key for p in report.problems), (i, key, [p.line() for p in report.problems])


def test_flips_anywhere_never_crash_the_verifier_and_name_the_file(tmp_path):
    """A bit flipped anywhere in a plain DCP: a typed error or problems that name the flipped file,
    or a pass, which only a byte outside every tensor's data can give (torch's CRC-32 covers the
    data; .metadata and the records' zip headers have no checksum outside a ckpttool step)."""
    src = os.path.join(FIXTURES, "plain-dcp-w2")
    data = {(os.path.basename(f), s, e) for f, s, e, _ in tensor_data_spans(src)}
    rnd = random.Random(99)
    files = sorted(f for f in os.listdir(src) if f.endswith(".distcp")) + [".metadata"]
    outcomes = {"error": 0, "problem": 0, "passed": 0}
    for i in range(40):
        work = tmp_path / f"any{i}"
        shutil.copytree(src, work)
        name = rnd.choice(files)
        at = rnd.randrange((work / name).stat().st_size)
        flip_bit(work / name, at, rnd.randrange(8))
        try:
            report = verify_path(str(work))
        except CkptError as exc:  # unreadable input is a typed error (exit 2), never a crash
            assert name in str(exc) or "metadata" in str(exc), (name, at, str(exc))
            outcomes["error"] += 1
            continue
        if report.ok:
            assert not any(f == name and s <= at < e for f, s, e in data), (name, at, "a flip in tensor data passed")
            outcomes["passed"] += 1
        else:
            assert any(name in (p.file or "") or name in p.what for p in report.problems), (name, at, [p.line() for p in report.problems])
            outcomes["problem"] += 1
    # (with this seed 15 of the 40 land where a check reaches: the tensor data is a small part of the files)
    assert outcomes["error"] + outcomes["problem"] >= 10, outcomes


def test_torch_file_bit_flip_and_truncation(tmp_path, ref_pt):
    _, start, end, key = tensor_data_spans(ref_pt)[0]
    bad = tmp_path / "bad.pt"
    shutil.copy(ref_pt, bad)
    flip_bit(bad, start + 1)
    report = verify_path(str(bad))
    assert not report.ok and report.problems[0].key == key and "CRC-32" in report.problems[0].what
    cut = tmp_path / "cut.pt"
    cut.write_bytes(ref_pt.read_bytes()[:-200])
    report = verify_path(str(cut))  # the zip directory is gone: reported against the file
    assert not report.ok and "cut.pt" in report.problems[0].file


def test_safetensors_header_size_and_index_problems(tmp_path, ref_pt):
    one = tmp_path / "one.safetensors"
    convert(str(ref_pt), str(one))
    data = one.read_bytes()
    short = tmp_path / "short.safetensors"
    short.write_bytes(data[:-4])
    report = verify_path(str(short))
    assert not report.ok
    hf = tmp_path / "hf"
    convert(str(ref_pt), str(hf), to="safetensors", max_shard_size="64B")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][key])
    index["weight_map"][key] = other
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    report = verify_path(str(hf))
    assert any(p.key == key and "index maps it" in p.what for p in report.problems)


def test_safetensors_trailing_bytes_are_reported(tmp_path, ref_pt):
    one = tmp_path / "one.safetensors"
    convert(str(ref_pt), str(one))
    with open(one, "ab") as f:
        f.write(b"\0" * 8)
    report = verify_path(str(one))
    assert [("one.safetensors" in p.file, "file holds" in p.what) for p in report.problems] == [(True, True)]


def test_against_finds_one_changed_element(tmp_path, ref_pt):
    ck = tmp_path / "ck"
    convert(str(ref_pt), str(ck))
    state = torch.load(ref_pt, weights_only=True)
    state["model"]["w"][4, 2] += 1e-3
    changed = tmp_path / "changed.pt"
    torch.save(state, changed)
    report = verify_against(str(ck), str(changed))
    assert [(p.key, "index [4, 2]" in p.what) for p in report.problems] == [("model.w", True)]
    assert verify_against(str(ck), str(changed), atol=1e-2).ok
    report = verify_against(str(ck), str(changed), rtol=1e-6)
    assert "max abs diff" in report.problems[0].what


def test_against_model_export_with_only_and_cast(tmp_path, ref_pt):
    ck = tmp_path / "ck"
    convert(str(ref_pt), str(ck))
    convert(str(ck), str(tmp_path / "m.safetensors"), only="model", dtype="bfloat16")
    assert not verify_against(str(ck), str(tmp_path / "m.safetensors"), only="model").ok
    assert verify_against(str(ck), str(tmp_path / "m.safetensors"), only="model", cast=True).ok
    report = verify_against(str(ck), str(tmp_path / "m.safetensors"))
    assert any("only in" in p.what for p in report.problems)


def test_cli_exit_codes_and_json(tmp_path, dcp_dir):
    runner = CliRunner()
    assert runner.invoke(main, ["verify", str(dcp_dir)]).exit_code == 0
    fname, start, end, key = tensor_data_spans(dcp_dir)[0]
    flip_bit(dcp_dir / fname, start)
    result = runner.invoke(main, ["verify", str(dcp_dir), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert doc["ok"] is False and doc["problems"][0]["key"] == key
    result = runner.invoke(main, ["verify", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_manifest_of_a_ckpttool_step_catches_changed_objects(tmp_path):
    from ckpttool import Checkpointer

    model = torch.nn.Linear(3, 4)
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(tmp_path / "run").save(1, model, opt, extra={"note": "x" * 40})
    step = tmp_path / "run" / "step-1"
    report = verify_path(str(tmp_path / "run"))
    assert report.ok and any("manifest" in n for n in report.notes)
    with open_source(str(step)) as src:
        info = src.index()["extra.note"].location
    data = bytearray((step / info.relative_path).read_bytes())
    pos = data.index(b"x" * 40, info.offset)
    data[pos] = ord("y")
    (step / info.relative_path).write_bytes(bytes(data))
    report = verify_path(str(tmp_path / "run"))
    assert any(p.key == "extra.note" and "manifest" in p.what for p in report.problems)


def test_the_manifest_catches_a_flip_in_tensor_data_of_records_written_without_a_crc(tmp_path):
    """ckpttool's save hashes each data byte once (its manifest's block digests) and writes no CRC-32: a flip
    in tensor data fails the manifest, for that key only, and no CRC-32 is compared (there is none); a flip in
    the record's zip header fails the manifest too. Without the commit record (no manifest) the record's
    empty CRC-32 is a difference whose hint says why."""
    from ckpttool import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    Checkpointer(tmp_path / "run").save(1, model, opt)
    step = tmp_path / "run" / "step-1"
    assert verify_path(str(step)).ok
    fname, start, end, key = next(s for s in tensor_data_spans(step) if s[3] == "model.0.weight")
    flip_bit(step / fname, start + (end - start) // 3, 2)
    report = verify_path(str(step))
    assert {p.key for p in report.problems} == {key}
    whats = [p.what for p in report.problems]
    assert not any("CRC-32" in w for w in whats) and any("manifest" in w for w in whats)

    flip_bit(step / fname, start + (end - start) // 3, 2)  # undo
    assert verify_path(str(step)).ok
    with open_source(str(step)) as src:
        record = src.index()[key].chunks[0].location
    flip_bit(step / fname, record.offset + 20, 0)  # inside the record's first zip local header: its name
    report = verify_path(str(step))
    assert any(p.key == key and "manifest" in p.what for p in report.problems)
    flip_bit(step / fname, record.offset + 20, 0)  # undo

    (step / ".ckpttool-commit.json").rename(tmp_path / "record")
    report = verify_path(str(step))
    crcs = [p for p in report.problems if "CRC-32" in p.what]
    assert crcs and all("stored 00000000" in p.what and "carry no CRC-32" in p.hint for p in crcs)


def _step_with_manifest(tmp_path) -> str:
    from ckpttool import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    Checkpointer(str(tmp_path / "run")).save(1, model)
    return str(tmp_path / "run" / "step-1")


def _without_load_index(step: str) -> None:
    """The step as one written before plain steps got a load index: its load reads ``.metadata``."""
    from ckpttool import steps
    from ckpttool.formats.dcp.load_index import INDEX_FILE

    os.remove(os.path.join(step, INDEX_FILE))
    with open(os.path.join(step, steps.COMMIT_FILE), "rb") as f:
        record = json.loads(f.read())
    record.pop("checksum")
    record["manifest"]["files"].pop(INDEX_FILE)
    extra = {k: v for k, v in record.items() if k not in ("step", "world_size")}
    with open(os.path.join(step, steps.COMMIT_FILE), "wb") as f:
        f.write(steps.commit_record(record["step"], record["world_size"], extra))


def _read_error(step: str) -> CkptError:
    from ckpttool import load

    with pytest.raises(CkptError) as caught:
        load(step, torch.nn.Linear(64, 32))
    return caught.value


@pytest.mark.parametrize("damage", ["record", "metadata", "crc"])
def test_the_one_checker_tells_a_read_and_verify_the_same(tmp_path, damage):
    """formats/dcp/manifest.py finds; a read raises what it found, verify reports it: the same text
    (the key named in the read's message, in its own column in verify's) and the same hint."""
    if damage == "crc":  # no manifest: torch's CRC-32 is what checks (ckpttool's save writes none: it has its manifest)
        import torch.distributed.checkpoint as dcp

        torch.manual_seed(0)
        step = str(tmp_path / "plain")
        dcp.save({"model": torch.nn.Linear(64, 32).state_dict()}, checkpoint_id=step, no_dist=True)
    else:
        step = _step_with_manifest(tmp_path)
    file, start, end, key = next(s for s in tensor_data_spans(step) if s[3] == "model.weight")
    if damage == "metadata":  # the same length: only the manifest can tell
        _without_load_index(step)  # (a load reads the load index instead of .metadata where the step has one)
        path = os.path.join(step, ".metadata")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data.replace(b"model.bias", b"model.bia_"))
        said = ".metadata does not match the manifest written at commit"
    else:
        flip_bit(os.path.join(step, file), (start + end) // 2)
        said = "does not match its CRC-32" if damage == "crc" else "does not match the manifest's checksum"
    error = _read_error(step)
    problems = [p for p in verify_path(step).problems if said in p.what]
    assert said in error.what and len(problems) == 1, (error.what, verify_path(step).problems)
    found = problems[0]
    assert found.hint == error.hint and found.file == error.where
    assert found.key == (None if damage == "metadata" else key)
    # the read's text names the key (and the rank), verify's leaves the key to its own column
    plain = error.what.removesuffix(" on rank 0").replace(f"record of {key!r}", "record")
    plain = plain.replace(f"of {key!r} (chunk at [0, 0])", "of the chunk at [0, 0]")
    assert plain == found.what, (error.what, found.what)


@pytest.mark.parametrize("damage", ["flip", "missing", "rows", "symlink out", "longer"])
def test_a_damaged_manifest_file_is_named_by_a_load_and_by_verify(tmp_path, damage):
    """The rows of a step's records live in each rank's manifest file, its size and digest in the
    commit record: a manifest file changed or lost is named by the read that needs it and by
    verify (never a record passed unchecked); an intact one is part of the step, not a stray file."""
    step = _step_with_manifest(tmp_path)
    report = verify_path(step)
    assert report.ok and not any("not part of the checkpoint" in n for n in report.notes), report.notes
    path = os.path.join(step, "__0.manifest")
    if damage == "flip":
        flip_bit(path, os.path.getsize(path) // 2)
    elif damage == "missing":
        os.remove(path)
    elif damage == "symlink out":  # the very bytes, outside the step: never followed
        shutil.copy(path, tmp_path / "elsewhere")
        os.remove(path)
        os.symlink(tmp_path / "elsewhere", path)
    elif damage == "longer":
        with open(path, "ab") as f:
            f.write(b" ")
    else:  # well-formed JSON, same length, other rows: only the commit record's digest of it tells
        data = open(path, "rb").read()
        i = data.index(b'[0,')
        open(path, "wb").write(data[:i] + b'[1,' + data[i + 3:])
    error = _read_error(step)
    assert "__0.manifest" in error.what and "cannot be checked" in error.what, error.what
    problems = verify_path(step).problems
    assert problems and all("__0.manifest" in p.what for p in problems), problems
    result = CliRunner().invoke(main, ["verify", step])
    assert result.exit_code == 1 and "__0.manifest" in result.output


def test_a_manifest_finding_names_a_file_with_braces_as_it_is(tmp_path):
    """A data file's name comes from .metadata and may hold braces: the finding about its lost
    manifest names it as it is, for the read (key named) and for verify alike."""
    from types import SimpleNamespace

    from ckpttool.formats.dcp.manifest import Manifest

    name = "__0_{0}.distcp"
    manifest = {"algorithm": "xxh3_64", "block": 65536, "manifests": {"__0.manifest": [10, "0" * 16, [name, "__0_1.distcp"]]}}
    found, _ = Manifest.of(manifest, resolve(str(tmp_path / "step-{exp}")))
    row, finding = found.row(SimpleNamespace(relative_path=name, offset=0, length=5), "u")
    assert row is None and "__0.manifest is missing" in finding.message()
    assert f"record of 'k' in {name} cannot be checked" in finding.error("k").what
    _, other = found.rows_of("__0_1.distcp")
    assert "in __0_1.distcp" in other.message("k")
