"""The load index (``formats/dcp/load_index.py``): a step whose ranks all follow FSDP2's layout
is read without ``.metadata``, entry for entry what ``.metadata`` gives; a rank's read touches the
manifest files of the ranks it overlaps only; a damaged or hostile index is refused, named."""

from __future__ import annotations

import json

import pytest
import torch

from ckpttool import steps
from ckpttool.checksums import hash_bytes
from ckpttool.errors import CkptError, CorruptCheckpointError
from ckpttool.formats.dcp.load_index import INDEX_FILE
from ckpttool.formats.dcp.source import DcpSource
from ckpttool.index import TensorEntry
from ckpttool.storage import resolve
from ckpttool.training import step_writer

from .test_fragments import _write_step


def _committed(tmp_path, ranks: int, name: str = "s", **kw):
    step = resolve(str(tmp_path / name))
    _write_step(step, ranks, **kw)
    manifest = step_writer.commit_metadata(step, step_writer.read_rank_indexes(step, ranks, timeout=10))
    step.child(steps.COMMIT_FILE).write_bytes(steps.commit_record(7, ranks, {"manifest": manifest}))
    return step


def _entries(source: DcpSource):
    out = {}
    index = source.index()
    for key in index:
        entry = index[key]
        if isinstance(entry, TensorEntry):
            chunks = [(c.offsets, c.sizes, c.location.relative_path, c.location.offset, c.location.length,
                       c.location.transform_descriptors) for c in entry.chunks]
            out[key] = (entry.shape, entry.element_type, chunks, index.path(key))
        else:
            info = entry.location
            out[key] = (info.relative_path, info.offset, info.length, index.path(key))
    return out


def _same_but_empty_chunks(a: dict, b: dict) -> bool:
    """Entries alike, but for empty chunks (.metadata from fragments under FSDP2's rule lists none;
    the index makes one for every rank past the rows)."""
    def strip(entries):
        return {k: (*v[:2], [c for c in v[2] if 0 not in c[1]], v[3]) if len(v) == 4 and isinstance(v[2], list)
                else v for k, v in entries.items()}
    return strip(a) == strip(b)


@pytest.mark.parametrize("ranks", [1, 3, 4, 8])
def test_a_step_read_by_its_load_index_is_the_step_read_by_metadata(tmp_path, ranks):
    step = _committed(tmp_path, ranks)
    assert step.child(INDEX_FILE).exists()
    by_index, by_metadata = DcpSource(step), DcpSource(step, by_index=False)
    assert by_index.by_index is not None and by_metadata.by_index is None
    assert _same_but_empty_chunks(_entries(by_index), _entries(by_metadata))
    assert (_entries(by_index) == _entries(by_metadata)) == (ranks < 4)  # (4 ranks: model.v's last shard is empty)
    empty = [c for c in by_index.index()["model.v"].chunks if not c.numel]
    assert len(empty) == {1: 0, 3: 0, 4: 1, 8: 3}[ranks] and all(c.offsets == (5, 0) for c in empty)
    assert _verify(step)[0] == 0
    assert list(by_index.index()) == list(by_metadata.index())
    # (every rank's data file; .metadata names none of a rank whose only records are empty shards)
    assert by_index.files() == [f"__{r}_0.distcp" for r in range(ranks)]
    assert set(by_metadata.files()) <= set(by_index.files()) and (by_index.files() == by_metadata.files()) == (ranks < 8)
    if ranks == 8:  # torch's own reader of .metadata (no empty shard listed) gives the same tensors
        import torch.distributed.checkpoint as dcp

        got = {"model": {"w": torch.zeros(10, 3), "v": torch.zeros(5, 2)}}
        dcp.load(got, checkpoint_id=step.url, no_dist=True)
        assert torch.equal(got["model"]["w"], by_metadata.read_tensor("model.w"))
        assert torch.equal(got["model"]["v"], torch.arange(10.0).reshape(5, 2))
    for key in by_index.index():
        if isinstance(by_index.index()[key], TensorEntry):
            assert torch.equal(by_index.read_tensor(key), by_metadata.read_tensor(key)), key
        else:
            assert by_index.read_object(key) == by_metadata.read_object(key)
    assert not by_index.metadata_read  # (nothing above needed .metadata)


def test_a_rank_reads_the_manifest_files_of_the_ranks_it_overlaps_only(tmp_path):
    ranks = 4
    step = _committed(tmp_path, ranks)
    source = DcpSource(step, rank=2)
    entry = source.entry("model.w", TensorEntry, checked=True)  # rows 10 over 4 ranks: 3, 3, 3, 1
    got = torch.empty(3, 3)
    source.read_tensor("model.w", ((6, 0), (3, 3)), out=got)
    assert torch.equal(got, torch.arange(18.0, 27.0).reshape(3, 3))
    assert source.located_ranks == {2}
    assert [c.location.relative_path for c, _ in entry.chunks_in(((5, 0), (2, 3)))] == ["__1_0.distcp", "__2_0.distcp"]
    assert source.located_ranks == {1, 2}
    assert not source.metadata_read


def test_ranks_off_fsdp2s_layout_get_no_load_index(tmp_path):
    step = _committed(tmp_path, 3, reverse=True)  # (the mesh lists the ranks backwards)
    assert not step.child(INDEX_FILE).exists()
    assert DcpSource(step).by_index is None


def _rewrite(step, name: str, edit) -> None:
    """Edit a file of a committed step and put its new size and digest into the commit record (a
    hostile step, consistent with itself)."""
    raw = edit(step.child(name).read_bytes())
    step.child(name).write_bytes(raw)
    record = json.loads(step.child(steps.COMMIT_FILE).read_bytes())
    record.pop("checksum")
    manifest = record.pop("manifest")
    table = manifest["files"] if name in manifest["files"] else manifest["manifests"]
    table[name][:2] = [len(raw), hash_bytes(raw)]
    step.child(steps.COMMIT_FILE).write_bytes(steps.commit_record(record["step"], record["world_size"], {"manifest": manifest}))


def test_a_damaged_load_index_is_refused_named(tmp_path):
    step = _committed(tmp_path, 3)
    raw = bytearray(step.child(INDEX_FILE).read_bytes())
    raw[40] ^= 1
    step.child(INDEX_FILE).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="load index does not match the commit record's checksum") as got:
        DcpSource(step)
    assert got.value.where.endswith(INDEX_FILE)


@pytest.mark.parametrize("edit, match", [
    (lambda b: b.replace(b'"world_size":3', b'"world_size":2'), "is for 2 ranks, the commit record says 3"),
    (lambda b: b.replace(b'"../x"', b'"x"').replace(b'"__0_0.distcp"', b'"../x"', 1), "outside the checkpoint"),
    (lambda b: b.replace(b'["model.w",[10,3],"float32"]', b'["model.w",[10,-3],"float32"]'), "malformed sharded key"),
    (lambda b: b.replace(b'["model.w",[10,3],"float32"]', b'["model.w",[10,3],"float32"],["model.w",[10,3],"float32"]'),
     "does not list each of its keys once"),
    (lambda b: b.replace(b'["model.w",[10,3],"float32"]', b'["model.w",[1099511627776,1099511627776],"float32"]'),
     "malformed sharded key"),
    (lambda b: b.replace(b'["model.w",[10,3],"float32"]', b'["model.w",[10,3],["float32"]]'), "malformed sharded key"),
    (lambda b: b.replace(b'"extra.plain":[[4],"float32"', b'"extra.plain":[[4],{"a":1}'), "malformed entry of tensor"),
])
def test_a_hostile_load_index_is_refused(tmp_path, edit, match):
    step = _committed(tmp_path, 3)
    _rewrite(step, INDEX_FILE, edit)
    with pytest.raises(CkptError, match=match):
        DcpSource(step).index()


def test_a_rank_manifest_that_places_a_record_past_its_file_or_too_short_is_refused(tmp_path):
    step = _committed(tmp_path, 3)

    def at(edit):
        def change(raw):
            body = json.loads(raw)
            edit(body["sharded"][2])
            return json.dumps(body).encode()
        return change

    _rewrite(step, "__1.manifest", at(lambda flat: flat.__setitem__(0, flat[0] + 10 ** 9)))
    entry = DcpSource(step).entry("model.w", TensorEntry, checked=True)
    with pytest.raises(CorruptCheckpointError, match="file is truncated"):
        list(entry.chunks_in(((4, 0), (4, 3))))  # (found where the record is located, before any read)
    step = _committed(tmp_path, 3, name="t")
    _rewrite(step, "__1.manifest", at(lambda flat: flat.__setitem__(1, 8)))
    with pytest.raises(CorruptCheckpointError, match="rank 1's record of chunk at \\[4, 0\\] holds 8 bytes"):
        DcpSource(step).read_tensor("model.w")
    for name, edit in (("u", lambda flat: flat.pop()), ("v", lambda flat: flat.__setitem__(2, 1 << 64))):
        step = _committed(tmp_path, 3, name=name)
        _rewrite(step, "__2.manifest", at(edit))
        with pytest.raises(CorruptCheckpointError, match="rank 2's manifest file does not say where"):
            DcpSource(step).read_tensor("model.w")


def _verify(step) -> tuple[int, dict]:
    from click.testing import CliRunner

    from ckpttool.cli import main

    got = CliRunner().invoke(main, ["verify", step.url, "--json"])
    return got.exit_code, json.loads(got.output)


def test_verify_reads_metadata_and_compares_the_load_index_with_it(tmp_path):
    step = _committed(tmp_path, 3)
    code, out = _verify(step)
    assert code == 0, out
    # a hostile step, consistent with itself: the index moves rank 0's plain tensor's record
    _rewrite(step, INDEX_FILE, lambda b: b.replace(b'"extra.plain":[[4],"float32",[[[0],[4],["__0_0.distcp",',
                                                   b'"extra.plain":[[4],"float32",[[[0],[4],["__1_0.distcp",'))
    assert DcpSource(step).index()["extra.plain"].chunks[0].location.relative_path == "__1_0.distcp"
    code, out = _verify(step)
    assert code == 1
    assert [(p["what"], p["key"]) for p in out["problems"]] == [("load index does not say what .metadata says", "extra.plain")]


@pytest.mark.parametrize("entry", [
    ["x", "d", ["__1_0.distcp"]], [True, "d", ["__1_0.distcp"]], [-1, "d", ["__1_0.distcp"]], [10, 5, ["__1_0.distcp"]],
    [10, "d", "__1_0.distcp"], [10, "d", [1]], [10, "d", ["__0_0.distcp"]], [(256 << 20) + 1, "d", ["__1_0.distcp"]], [10, "d"],
])
def test_a_commit_record_whose_ranks_manifest_files_are_malformed_is_damaged(tmp_path, entry):
    """Every loading rank checks the whole table of manifest files (one a rank) before it uses one."""
    step = resolve(str(tmp_path / "step-7"))
    step.makedirs()
    good = {"__0.manifest": [10, "d", ["__0_0.distcp"]], "__1.manifest": [10, "d", ["__1_0.distcp"]]}
    for table in (good, {**good, "__1.manifest": entry}):
        step.child(steps.COMMIT_FILE).write_bytes(steps.commit_record(7, 2, {"manifest": {"algorithm": "xxh3_64", "manifests": table}}))
        if table is good:
            assert steps.read_commit_record(step)["world_size"] == 2
    with pytest.raises(CorruptCheckpointError, match="its manifest is malformed"):
        steps.read_commit_record(step)


def test_a_rank_data_file_that_links_out_of_the_step_is_refused(tmp_path):
    step = _committed(tmp_path, 3)
    outside = tmp_path / "elsewhere"
    outside.write_bytes((tmp_path / "s" / "__2_0.distcp").read_bytes())
    (tmp_path / "s" / "__2_0.distcp").unlink()
    (tmp_path / "s" / "__2_0.distcp").symlink_to(outside)
    source = DcpSource(step)
    assert torch.equal(source.read_tensor("model.w", ((0, 0), (4, 3))), torch.arange(12.0).reshape(4, 3))  # (ranks 0, 1)
    with pytest.raises(CkptError, match="symlink that leads out of the checkpoint"):
        source.read_tensor("model.w")


def test_verify_walks_metadata_when_the_load_index_cannot_be_read(tmp_path):
    step = _committed(tmp_path, 3)
    _rewrite(step, INDEX_FILE, lambda b: b.replace(b'["__0_0.distcp",', b'["../x",', 1))
    code, out = _verify(step)
    assert code == 1
    assert [p["what"] for p in out["problems"]] == ["load index cannot be read: names a path outside the checkpoint: '../x'"]
    assert out["tensors_checked"] == 3  # (.metadata's walk went on: model.w, model.v, extra.plain)


def test_a_sharded_key_larger_than_its_records_is_refused_before_anything_is_allocated(tmp_path):
    step = _committed(tmp_path, 3)
    _rewrite(step, INDEX_FILE, lambda b: b.replace(b'["model.w",[10,3],"float32"]', b'["model.w",[68719476736,3],"float32"]'))
    with pytest.raises(CorruptCheckpointError, match="rank 0's record of chunk at \\[0, 0\\] holds"):
        DcpSource(step).read_tensor("model.w")  # (768 GB: an allocation first would fail otherwise, or take the memory)


def test_a_step_without_dtensors_has_a_load_index_and_a_load_or_convert_unpickles_no_metadata(tmp_path):
    """A step of plain tensors (no DTensor: one process, DDP) gets a load index too: every key's
    chunks in it, entry for entry what ``.metadata`` gives, read as JSON by a load and a convert
    instead of ``.metadata``'s pickle (the pure-Python allow-listed unpickler: 0.19 s of CPU per
    5,000 tensors), and compared with ``.metadata`` by verify."""
    from ckpttool import Checkpointer, load
    from ckpttool.offline.convert import convert
    from ckpttool.offline.verify import verify_path

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    Checkpointer(str(tmp_path / "run")).save(1, model, optimizer, extra={"epoch": 3, "rng": torch.arange(4)})
    step = resolve(str(tmp_path / "run" / "step-1"))
    assert step.child(INDEX_FILE).exists()
    by_index, by_metadata = DcpSource(step), DcpSource(step, by_index=False)
    assert by_index.by_index is not None
    assert _entries(by_index) == _entries(by_metadata) and list(by_index.index()) == list(by_metadata.index())
    for key in by_index.index():
        if isinstance(by_index.index()[key], TensorEntry):
            assert torch.equal(by_index.read_tensor(key), by_metadata.read_tensor(key)), key
    assert not by_index.metadata_read
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    load(step.url, fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    convert(step.url, str(tmp_path / "out.safetensors"))
    assert verify_path(step.url).ok
    # verify compares it with .metadata: an index that names another record for a key is found
    _rewrite(step, INDEX_FILE, lambda b: b.replace(b'"model.0.bias":[[4],"float32",[[[0],[4],["__0_0.distcp",',
                                                   b'"model.0.bias":[[4],"float32",[[[0],[4],["__0_0.distcp",1', 1))
    assert not verify_path(step.url).ok
