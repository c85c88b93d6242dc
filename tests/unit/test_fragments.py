"""Each rank's fragment of ``.metadata``: rank 0 copies the ranks' spelling of their sharded chunks
into the stream instead of spelling millions of chunks itself. What torch and the allow-listed
reader get from it is what rank 0 spelling every chunk gives; a fragment that is not the one its
rank wrote is a damaged index, and ranks that disagree on the sharded keys, or whose chunks are
not in offset order rank after rank, get rank 0's own spelling."""

from __future__ import annotations

import json
import pickle
import random

import pytest
import torch

from ckpttool import compat, rendezvous
from ckpttool.errors import CorruptCheckpointError
from ckpttool.formats.dcp import metadata_pickle as mp
from ckpttool.formats.dcp.metadata_emit import fragment, metadata_stream
from ckpttool.formats.dcp.metadata_types import CLASSES
from ckpttool.safe_pickle import load_dcp_metadata
from ckpttool.storage import resolve
from ckpttool.training import shared_chunks, step_writer

from .test_metadata_pickle import _described


def _split(d: mp.Described, ranks: int, rng: random.Random) -> tuple[list[str], list[bytes], mp.Described]:
    """Give every chunk of ``d``'s row-sharded tensors to a rank (chunk r of each to rank r), as
    those ranks' fragments; returns the shared keys, the fragments and ``d`` with the shared keys'
    chunks left out. Each rank stores through one transform or none; some chunks lie in the rank's
    second (frozen) file. ``d``'s chunk records are rewritten to match."""
    shared = [k for k, (shape, _, chunks) in d.tensors.items() if len(chunks) == ranks and len(shape) == 2]
    transforms = [("a/1",) if r % 3 == 1 else () for r in range(ranks)]
    rows: list[list[tuple[int, list]]] = [[] for _ in range(ranks)]
    for i, key in enumerate(shared):
        shape, dtype, chunks = d.tensors[key]
        kept = []
        for r, (offsets, sizes, (_, start, length, _)) in enumerate(chunks):
            second = rng.random() < 0.2
            file = f"__{r}_1.distcp" if second else f"__{r}_0.distcp"
            kept.append((offsets, sizes, (file, start, length, list(transforms[r]) or None)))
            rows[r].append((i, [[list(offsets), list(sizes), start, length, *([file] if second else [])]]))
        d.tensors[key] = (shape, dtype, kept)
    frags = [fragment(len(shared), rows[r], f"__{r}_0.distcp", transforms[r]) for r in range(ranks)]
    without = mp.Described()
    without.order, without.paths, without.objects = d.order, d.paths, d.objects
    without.tensors = {k: (s, t, [] if k in shared else c) for k, (s, t, c) in d.tensors.items()}
    return shared, frags, without


@pytest.mark.parametrize("keys,ranks", [(1, 1), (7, 3), (40, 1001), (300, 2)])
def test_fragments_give_what_rank_0_spelling_every_chunk_gives(keys, ranks):
    """Torch's unpickler and the allow-listed reader read the same Metadata (every chunk in the
    same order, every storage entry) from prelude + fragments as from rank 0's own spelling:
    more than 128 keys (slots past 255), more than 1,000 chunks a key, a key named like a field,
    transforms, a second file, ranks with nothing."""
    rng = random.Random(keys * 7 + ranks)
    d = _described(rng, keys, ranks)
    d.order.insert(0, "sizes")  # (a key spelled like a field name: memoized before its own slot)
    d.paths["sizes"] = ("sizes",)
    d.tensors["sizes"] = ((ranks, 3), "float32", [((r, 0), (1, 3), ("x", 0, 12, None)) for r in range(ranks)])
    shared, frags, without = _split(d, ranks, rng)
    assert "sizes" in shared and len(shared) >= min(keys // 2, 2)
    spelled = metadata_stream(d, "sid", compat.DCP_VERSION)
    copied = metadata_stream(without, "sid", compat.DCP_VERSION, (shared, frags))
    a, b = pickle.loads(copied), pickle.loads(spelled)
    assert a.state_dict_metadata == b.state_dict_metadata and list(a.state_dict_metadata) == list(b.state_dict_metadata)
    assert a.planner_data == b.planner_data and a.storage_meta == b.storage_meta
    assert a.storage_data == b.storage_data  # (MetadataIndex.index is no part of equality)
    assert {k: v.__dict__ for k, v in a.storage_data.items()} == {k: v.__dict__ for k, v in b.storage_data.items()}
    assert all(k.index is None for k in a.storage_data if k.fqn in shared)
    mine, theirs = load_dcp_metadata(copied, "x", CLASSES), load_dcp_metadata(spelled, "x", CLASSES)
    assert mine == theirs


def _write_step(step, ranks: int, reverse: bool = False, backwards: int | None = None) -> None:
    """Every rank of ``ranks`` writes its part of one step of two row-sharded DTensors, a plain
    tensor and an object, in this process (a fake process group per rank). ``reverse``: the mesh
    lists the ranks backwards, so rank 0 holds the last rows; rank ``backwards`` holds its
    DTensors in the other order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shapes = {"model.w": (10, 3), "model.v": (5, 2)}
    for rank in range(ranks):
        dist.init_process_group("fake", rank=rank, world_size=ranks, store=FakeStore())
        try:
            mesh = DeviceMesh("cpu", list(range(ranks))[::-1] if reverse else list(range(ranks)))
            coord = mesh.get_coordinate()[0]
            state = {"model": {}, "extra": {"step": 4, "plain": torch.arange(4.0)}}
            for key, shape in (reversed(shapes.items()) if rank == backwards else shapes.items()):
                rows = -(-shape[0] // ranks)
                lo, hi = min(coord * rows, shape[0]), min((coord + 1) * rows, shape[0])
                local = torch.arange(lo * shape[1], hi * shape[1], dtype=torch.float32).reshape(hi - lo, shape[1])
                state["model"][key.split(".")[1]] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                                       shape=torch.Size(shape), stride=(shape[1], 1))
            step_writer.write_rank(step, rank, state, world_size=ranks)
        finally:
            dist.destroy_process_group()


def _commit(step, ranks: int):
    manifest = step_writer.commit_metadata(step, step_writer.read_rank_indexes(step, ranks, timeout=10))
    return manifest, pickle.loads(step.child(".metadata").read_bytes())


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_step_committed_from_fragments_reads_as_one_committed_without(tmp_path, ranks, monkeypatch):
    step = resolve(str(tmp_path / "a"))
    _write_step(step, ranks)
    parts = [step.child(rendezvous.part_name(r)).read_bytes() for r in range(ranks)]
    assert all(b"\0" in p for p in parts)  # (every rank wrote a fragment)
    _, copied = _commit(step, ranks)
    monkeypatch.setattr(shared_chunks, "rank_tail", lambda index, frozen, world_size=None: (None, b""))
    plain = resolve(str(tmp_path / "b"))
    _write_step(plain, ranks)
    assert all(b"\0" not in plain.child(rendezvous.part_name(r)).read_bytes() for r in range(ranks))
    _, spelled = _commit(plain, ranks)
    assert copied.state_dict_metadata == spelled.state_dict_metadata and copied.storage_data == spelled.storage_data
    assert {k.fqn for k in copied.storage_data if k.index is None} >= {"model.w", "model.v"}


def test_a_fragment_that_is_not_the_one_its_rank_wrote_is_a_damaged_index(tmp_path):
    step = resolve(str(tmp_path / "s"))
    _write_step(step, 3)
    part = step.child(rendezvous.part_name(1))
    raw = bytearray(part.read_bytes())
    raw[raw.index(b"\0") + 5] ^= 1  # (in its fragment, which rank 0 reads as it writes .metadata)
    part.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="rank 1's index is damaged") as got:
        _commit(step, 3)
    assert got.value.where.endswith(rendezvous.part_name(1))
    assert not step.child(".metadata").exists()  # (what was written of it is removed)


def _edit_part(step, rank: int, edit) -> None:
    part = step.child(rendezvous.part_name(rank))
    head, _, tail = part.read_bytes().partition(b"\0")
    index = json.loads(head)
    edit(index)
    part.write_bytes(rendezvous.part_bytes(index, tail))


def test_ranks_that_disagree_on_the_sharded_keys_get_rank_0s_spelling(tmp_path, monkeypatch):
    """A rank whose sharded keys are not rank 0's (another order, another model): its fragment's
    slots would be another key's; rank 0 spells every chunk itself, and the step is the same."""
    step = resolve(str(tmp_path / "s"))
    _write_step(step, 3, backwards=2)
    _, got = _commit(step, 3)
    assert all(k.index is not None for k in got.storage_data if k.fqn in ("model.w", "model.v"))
    monkeypatch.setattr(shared_chunks, "rank_tail", lambda index, frozen, world_size=None: (None, b""))  # (every chunk as JSON)
    want = resolve(str(tmp_path / "t"))
    _write_step(want, 3, backwards=2)
    _, expected = _commit(want, 3)
    assert got.state_dict_metadata == expected.state_dict_metadata and got.storage_data == expected.storage_data


def test_chunks_out_of_offset_order_get_rank_0s_spelling(tmp_path):
    """Rank 0 holds the last rows (a mesh that lists the ranks backwards): the fragments would give
    the chunk lists in rank order; rank 0 spells them in offset order, as before."""
    step = resolve(str(tmp_path / "s"))
    _write_step(step, 3, reverse=True)
    _, got = _commit(step, 3)
    for key in ("model.w", "model.v"):
        offsets = [c.offsets[0] for c in got.state_dict_metadata[key].chunks]
        assert offsets == sorted(offsets) and len(offsets) == 3
    assert all(k.index is not None for k in got.storage_data if k.fqn == "model.w")


def _random_layouts(rng: random.Random, count: int) -> list[tuple[tuple[int, ...], list]]:
    """Keys of every kind of layout, right and wrong: row shards (even, uneven, empty ones, rank
    order reversed or shuffled), 2-D tiles, scalars, 1-D and 3-D, a gap, an overlap, a box out of
    bounds, a row shard that does not span the other dims."""
    out = []
    for _ in range(count):
        kind = rng.choice(["rows", "rows", "rows", "tiles", "scalar", "gap", "overlap", "outside", "narrow", "shifted", "far",
                           "huge"])
        ndim = rng.choice([1, 2, 3])
        shape = tuple(rng.randrange(0, 9) if d == 0 else rng.randrange(1, 4) for d in range(ndim))
        if kind == "huge":  # (2**61 rows: past what one sort key holds with the key's number)
            shape = ((1 << 61) + rng.randrange(9), *shape[1:])
        if kind == "scalar":
            out.append(((), [((), ())] * rng.choice([1, 1, 2])))
            continue
        ranks = rng.randrange(1, 6)
        per = -(-shape[0] // ranks) if shape[0] else 0
        boxes = []
        for r in range(ranks):
            lo = min(r * per, shape[0])
            hi = min(lo + per, shape[0])
            boxes.append(((lo, *(0,) * (ndim - 1)), (hi - lo, *shape[1:])))
        if kind == "tiles" and ndim >= 2 and shape[1] >= 2:
            boxes = [((o[0], c), (s[0], w)) + () for (o, s) in boxes for c, w in ((0, 1), (1, shape[1] - 1))]
            boxes = [((o[0], o[1], *(0,) * (ndim - 2)), (s[0], s[1], *shape[2:])) for o, s in boxes]
        elif kind == "gap" and boxes:
            boxes.pop(rng.randrange(len(boxes)))
        elif kind == "overlap" and boxes:
            boxes.append(boxes[rng.randrange(len(boxes))])
        elif kind == "outside" and boxes:
            o, s = boxes[-1]
            boxes[-1] = (o, (s[0] + 1, *s[1:]))
        elif kind == "shifted" and sum(1 for _, sz in boxes if sz[0]) >= 2:  # (a gap and an overlap: the rows still add up)
            j = next(j for j, (_, sz) in enumerate(boxes) if sz[0])
            o, sz = boxes[j]
            boxes[j] = ((o[0] + 1, *o[1:]), sz)
        elif kind == "far" and boxes:  # (an empty shard past the end)
            boxes.append(((shape[0] + 2, *(0,) * (ndim - 1)), (0, *shape[1:])))
        elif kind == "narrow" and ndim >= 2 and boxes and shape[1] > 1:
            o, s = boxes[0]
            boxes[0] = (o, (s[0], s[1] - 1, *s[2:]))
        order = rng.choice(["rank", "reversed", "shuffled"])
        if order == "reversed":
            boxes.reverse()
        elif order == "shuffled":
            rng.shuffle(boxes)
        out.append((shape, boxes))
    return out


def test_the_tables_tiling_check_agrees_with_tiles_exactly_key_by_key():
    """shared_chunks.check_tiling (row shards proved in array operations, the rest by
    tiles_exactly) finds a problem in exactly the keys tiles_exactly does, and says the chunks are
    in order exactly when a stable sort by offsets leaves every key's chunks where they are."""
    from ckpttool.layout import tiles_exactly

    rng = random.Random(5)
    for trial in range(300):
        layouts = _random_layouts(rng, rng.randrange(1, 8))
        width = max(len(shape) for shape, _ in layouts)
        rows = []
        for i, (shape, boxes) in enumerate(layouts):
            pad = width - len(shape)
            for j, (o, s) in enumerate(boxes):
                rows.append([i, *o, *(0,) * pad, *s, *(1,) * pad, 7 * j, 3, 0, j % 3])
        table = shared_chunks.Table([f"k{i}" for i in range(len(layouts))], [shape for shape, _ in layouts],
                                    ["float32"] * len(layouts), width, [], None, [], [], None,
                                    _rows=torch.tensor(rows, dtype=torch.int64).view(-1, 2 * width + 5))
        problems, in_order = shared_chunks.check_tiling(table)
        want = {i: tiles_exactly(shape, boxes) for i, (shape, boxes) in enumerate(layouts)}
        assert set(problems) == {i for i, p in want.items() if p}, (trial, layouts, problems)
        assert all(problems[i] == want[i] for i in problems)
        ordered = all(boxes == sorted(boxes, key=lambda b: b[0]) for _, boxes in layouts)
        assert in_order == ordered, (trial, layouts)


def test_ranks_that_all_follow_fsdp2s_layout_need_no_row_read_and_one_that_does_not_gets_its_rows_checked(tmp_path):
    """Every rank of N says its chunks are FSDP2's of N (checked by the rank against its own): rank
    0 reads no row and the step is the same as one whose rows rank 0 checked; a rank that does not
    say so has every rank's rows checked."""
    ranks = 3
    steps = {}
    for case in ("rule", "one without"):
        step = steps[case] = resolve(str(tmp_path / case.replace(" ", "-")))
        _write_step(step, ranks)
        if case == "one without":
            _edit_part(step, 1, lambda index: index["sharded"].__setitem__(5, None))
        indexes = step_writer.read_rank_indexes(step, ranks, timeout=10)
        table = shared_chunks.read_tails(indexes, lambda r: str(r))
        assert table.rule == (ranks if case == "rule" else None)
        assert shared_chunks.check_tiling(table) == ({}, True)
        assert (table._rows is None) == (case == "rule")  # (no row read under the rule)
        step_writer.commit_metadata(step, indexes)
    got = {case: pickle.loads(step.child(".metadata").read_bytes()) for case, step in steps.items()}
    assert got["rule"].state_dict_metadata == got["one without"].state_dict_metadata
    assert got["rule"].storage_data == got["one without"].storage_data


def test_a_tail_read_from_its_file_by_range_gives_the_same_step(tmp_path, monkeypatch):
    """Parts longer than what rank 0 reads when they appear: it reads each rank's fragment from
    the file when it writes it into .metadata (and no rank's rows under the rule)."""
    got = {}
    for case in ("whole", "by range"):
        step = resolve(str(tmp_path / case.replace(" ", "-")))
        _write_step(step, 3)
        if case == "by range":
            heads = [step.child(rendezvous.part_name(r)).read_bytes().index(b"\0") for r in (1, 2)]
            monkeypatch.setattr(rendezvous, "PART_HEAD", max(heads) + 8)
            reads = []
            real = rendezvous.Tail.read
            monkeypatch.setattr(rendezvous.Tail, "read", lambda self, o, n: reads.append((self.loc is not None and
                                                                                          o + n > len(self.held), n))
                                or real(self, o, n))
        got[case] = _commit(step, 3)[1]
    assert got["whole"].state_dict_metadata == got["by range"].state_dict_metadata
    assert got["whole"].storage_data == got["by range"].storage_data
    assert sum(1 for from_file, _ in reads if from_file) == 2  # (ranks 1 and 2: their fragments, nothing else)


def test_empty_shards_are_left_out_of_metadata_only_where_every_rank_is_under_fsdp2s_rule(tmp_path):
    """Under the rule the step's load index makes the empty shards (an offline reshard tells a
    one-row tensor sharded over N ranks from a replicated one by them), so .metadata need not
    list them; where one rank is not under it there is no index, and .metadata lists them all."""
    counts = {}
    for case in ("rule", "one without"):
        step = resolve(str(tmp_path / case.replace(" ", "-")))
        _write_step(step, 4)  # (model.v: 5 rows over 4 ranks, rank 3's shard empty)
        if case == "one without":
            _edit_part(step, 1, lambda index: index["sharded"].__setitem__(5, None))
        md = _commit(step, 4)[1]
        counts[case] = [list(c.sizes) for c in md.state_dict_metadata["model.v"].chunks]
    assert counts == {"rule": [[2, 2], [2, 2], [1, 2]], "one without": [[2, 2], [2, 2], [1, 2], [0, 2]]}
