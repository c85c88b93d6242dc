"""Layout maths, exhaustively over small shapes, world sizes 1..8 and HSDP meshes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ckpttool.errors import UsageError
from ckpttool.layout import Mesh, fsdp_box, intersect, rank_box, relative, shard_range, slabs, stored_boxes, tiles_exactly, whole


@pytest.mark.parametrize("n", range(0, 13))
@pytest.mark.parametrize("w", range(1, 9))
def test_shard_range_matches_torch_chunk(n, w):
    t = torch.arange(n)
    chunks = list(torch.chunk(t, w)) if n else []
    for i in range(w):
        start, stop = shard_range(n, w, i)
        expect = chunks[i].tolist() if i < len(chunks) else []
        assert t[start:stop].tolist() == expect


def test_shard_range_matches_fsdp2_for_uneven_rows():
    # FSDP2 pads dim 0 to ceil(n/w) per rank: 5 rows on 4 ranks are 2,2,1,0
    assert [shard_range(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


@pytest.mark.parametrize("shape", [(7, 3), (1, 4), (9,), (0, 2), (), (4, 2, 3)])
@pytest.mark.parametrize("mesh", [Mesh(1, w) for w in range(1, 9)] + [Mesh(2, 2), Mesh(2, 3), Mesh(4, 2)])
def test_stored_boxes_tile_every_tensor_once(shape, mesh):
    boxes = [b for _, b in stored_boxes(shape, mesh)]
    assert tiles_exactly(shape, boxes) is None
    ranks = [r for r, _ in stored_boxes(shape, mesh)]
    assert all(0 <= r < mesh.shard for r in ranks)  # stored by replicate group 0 only


def test_rank_box_follows_shard_dim_of_hsdp():
    mesh = Mesh(2, 2)
    assert rank_box((5, 3), mesh, 0) == rank_box((5, 3), mesh, 2) == ((0, 0), (3, 3))
    assert rank_box((5, 3), mesh, 1) == rank_box((5, 3), mesh, 3) == ((3, 0), (2, 3))


def test_intersect_and_relative_against_tensor_indexing():
    t = torch.arange(6 * 5).reshape(6, 5)
    boxes = [((o0, o1), (s0, s1)) for o0, o1, s0, s1 in itertools.product(range(4), range(3), range(1, 4), range(1, 4))]
    for a, b in itertools.combinations(boxes[::7], 2):
        got = intersect(a, b)
        mask_a = torch.zeros(6, 5, dtype=torch.bool)
        mask_a[a[0][0] : a[0][0] + a[1][0], a[0][1] : a[0][1] + a[1][1]] = True
        mask_b = torch.zeros(6, 5, dtype=torch.bool)
        mask_b[b[0][0] : b[0][0] + b[1][0], b[0][1] : b[0][1] + b[1][1]] = True
        both = mask_a & mask_b
        if got is None:
            assert not both.any()
        else:
            assert both.sum().item() == math.prod(got[1])
            assert torch.equal(t[relative(got, whole((6, 5)))].flatten().sort().values, t[both].sort().values)


def test_zero_sized_boxes_never_overlap_and_scalars_always_do():
    assert intersect(((0,), (0,)), ((0,), (3,))) is None
    assert intersect(((), ()), ((), ())) == ((), ())


def test_tiles_exactly_names_gaps_overlaps_and_outside():
    assert "gap" in tiles_exactly((4,), [((0,), (2,))])
    assert "overlap" in tiles_exactly((4,), [((0,), (3,)), ((2,), (2,))])
    assert "outside" in tiles_exactly((4,), [((3,), (2,))])


@pytest.mark.parametrize("shape", [(10, 4), (3, 5, 7), (1000,), (), (0, 3), (2, 1, 9)])
@pytest.mark.parametrize("budget", [1, 7, 16, 60, 10**9])
def test_slabs_are_contiguous_in_c_order_and_under_budget(shape, budget):
    t = torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)
    pieces = []
    for offs, sizes in slabs(shape, 4, budget):
        assert math.prod(sizes) * 4 <= max(budget, 4)
        piece = t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
        pieces.append(piece.reshape(-1))
    assert torch.equal(torch.cat(pieces) if pieces else t.reshape(-1), t.reshape(-1))


def test_mesh_parse_errors_name_the_flag():
    assert Mesh.parse(4, "2x2") == Mesh(2, 2)
    assert Mesh.parse(3) == Mesh(1, 3)
    with pytest.raises(UsageError, match="--world-size"):
        Mesh.parse(0)
    with pytest.raises(UsageError, match="--mesh 2x3"):
        Mesh.parse(4, "2x3")
    with pytest.raises(UsageError, match="RxS"):
        Mesh.parse(4, "four")


def test_fsdp_box_empty_shard_is_none():
    assert fsdp_box((2, 3), 4, 3) is None
    assert fsdp_box((), 4, 3) == ((), ())


def test_stored_box_of_each_rank_is_stored_boxes():
    """The O(1) per-rank query the DCP sink uses gives exactly the boxes of stored_boxes, rank by rank."""
    from ckpttool.layout import stored_box_of

    for n in range(0, 14):
        for shard in range(1, 7):
            for replicate in (1, 2):
                mesh = Mesh(replicate, shard)
                for shape in ((n,), (n, 3), ()):
                    for sharded in (True, False):
                        expected = stored_boxes(shape, mesh, sharded)
                        got = [(r, b) for r in range(mesh.world_size) for b in stored_box_of(shape, mesh, r, sharded)]
                        assert got == expected, (shape, mesh, sharded)


def test_the_one_pass_check_of_row_shards_agrees_with_counting_every_row():
    """The fast path of tiles_exactly (row shards end to end, FSDP2's layout) says yes exactly
    when every row is covered once: random row layouts with gaps, overlaps, duplicates, empty
    shards, shuffled order and a box that does not span the other dims, against a count per row."""
    import random

    from ckpttool.layout import _rows_end_to_end

    rng = random.Random(0)
    said = {True: 0, False: 0}
    for _ in range(3000):
        rows, cols = rng.randint(1, 12), rng.randint(1, 3)
        cuts = sorted(rng.sample(range(1, rows), rng.randint(0, rows - 1))) if rows > 1 else []
        edges = [0, *cuts, rows]
        boxes = [((a, 0), (b - a, cols)) for a, b in zip(edges, edges[1:])]
        boxes += [((rows, 0), (0, cols))] * rng.randint(0, 2)  # empty shards past the end
        change = rng.randint(0, 5)
        if change == 1 and boxes:
            boxes.pop(rng.randrange(len(boxes)))
        elif change == 2:
            boxes.append(rng.choice(boxes))
        elif change == 3 and boxes:
            (o, c), (n, w) = boxes[0]
            boxes[0] = ((o, c), (n, max(0, w - 1)))
        elif change == 4 and boxes:
            (o, c), (n, w) = boxes[-1]
            boxes[-1] = ((max(0, o - 1), c), (n, w))
        elif change == 5:  # the last rows' shard one row too long: past the end
            (o, c), (n, w) = boxes[len(edges) - 2]
            boxes[len(edges) - 2] = ((o, c), (n + 1, w))
        rng.shuffle(boxes)
        count = [0] * rows
        for (o, c), (n, w) in boxes:
            if c == 0 and w == cols:
                for r in range(o, min(o + n, rows)):
                    count[r] += 1
        whole = all(c == 0 and w == cols for (_, c), (_, w) in boxes) and count == [1] * rows \
            and all(o + n <= rows for (o, _), (n, _) in boxes)
        fast = _rows_end_to_end((rows, cols), boxes)
        assert fast == whole, (rows, cols, boxes)
        assert not fast or tiles_exactly((rows, cols), boxes) is None
        said[fast] += 1
    assert said[True] > 300 and said[False] > 300, said
