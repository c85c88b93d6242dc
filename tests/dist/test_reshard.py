"""Offline reshard: plain torch loads the result on the target layout bitwise, the chunks are FSDP2's
boxes, each rank reads its own file, and resharding back gives the original bytes."""

from __future__ import annotations

import pytest

from ckpttool.formats.dcp import read_metadata
from ckpttool.offline.reshard import reshard
from ckpttool.storage import resolve

from ..helpers import assert_same_checkpoint, assert_same_nested
from .harness import run_ranks
from .workloads import plain_torch_load

TARGETS = [(1, None), (2, None), (3, None), (4, None), (4, "2x2")]
# The default suite loads a covering subset of the 4 x 5 sources and targets: every source and every
# target at least once; fewer, more, the same and coprime rank counts; 1 -> N and N -> 1. The rest of
# the matrix runs with -m slow (make test-all).
DEFAULT_CASES = {(1, 3, None), (2, 1, None), (3, 4, None), (4, 2, None), (2, 4, "2x2"), (3, 3, None)}
CASES = [pytest.param(s, d, m, marks=() if (s, d, m) in DEFAULT_CASES else pytest.mark.slow, id=f"{s}-{d}-{m}")
         for s in (1, 2, 3, 4) for d, m in TARGETS]


def chunk_layout(path: str) -> dict[str, list]:
    md = read_metadata(resolve(path))
    return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
            for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}


@pytest.mark.parametrize("w_src,w_dst,mesh", CASES)
def test_plain_torch_loads_resharded_checkpoint_bitwise(plain, tmp_path, w_src, w_dst, mesh):
    path, expected = plain[w_src]
    out = str(tmp_path / "out")
    report = reshard(path, out, world_size=w_dst, mesh=mesh)
    assert report.source_world_size == w_src and report.world_size == w_dst
    mesh_shape = tuple(int(x) for x in mesh.split("x")) if mesh else None
    results = run_ranks(plain_torch_load, w_dst, out, mesh_shape)
    assert_same_nested(results[0]["model"], expected["model"], "model")
    assert_same_nested(results[0]["optim"], expected["optim"], "optim")
    if mesh is None:
        # every rank read its own file, plus rank 0's file for replicated entries only
        ours = chunk_layout(out)
        for r in results:
            for fname, info in r["reads"].items():
                if fname == f"__{r['rank']}_0.distcp":
                    continue
                if w_src == 1:  # a 1-rank source cannot tell buffers from parameters: buffers get sharded
                    info["keys"].discard("model.counts")
                    if not info["keys"]:
                        continue
                assert fname == "__0_0.distcp", (r["rank"], fname)
                for key in info["keys"]:
                    assert key not in ours or len(ours[key]) == 1, (r["rank"], key, "sharded entry read from rank 0's file")


@pytest.mark.parametrize("w_src", [2, 3, 4])
@pytest.mark.parametrize("w_dst", [1, 2, 3, 4])
def test_chunks_equal_what_fsdp2_itself_saves(plain, tmp_path, w_src, w_dst):
    out = str(tmp_path / "out")
    reshard(plain[w_src][0], out, world_size=w_dst)
    assert chunk_layout(out) == chunk_layout(plain[w_dst][0])


def test_reshard_there_and_back_gives_the_original_bytes(plain, tmp_path):
    path, _ = plain[3]
    reshard(path, str(tmp_path / "w2"), world_size=2)
    reshard(str(tmp_path / "w2"), str(tmp_path / "back"), world_size=3, memory_budget="64B")
    assert chunk_layout(str(tmp_path / "back")) == chunk_layout(path)
    assert_same_checkpoint(path, str(tmp_path / "back"))


def test_hsdp_stores_each_box_once(plain, tmp_path):
    out = str(tmp_path / "hsdp")
    reshard(plain[4][0], out, world_size=4, mesh="2x2")
    layout = chunk_layout(out)
    w2 = chunk_layout(plain[2][0])
    assert layout == w2  # boxes follow the shard dim (2 shards), stored once
    # and each box is stored once: no two storage entries of a key share an offset
    md = read_metadata(resolve(out))
    seen = [(mi.fqn, tuple(mi.offset)) for mi in md.storage_data if mi.offset is not None]
    assert len(seen) == len(set(seen))


# --- reshard --like: any layout, FSDP + TP included ----------------------------------------------


def stored_layout(path: str) -> dict[str, list]:
    """key -> sorted (offsets, sizes, file) of every chunk: what --like must reproduce."""
    md = read_metadata(resolve(path))
    out: dict[str, list] = {}
    for index, info in md.storage_data.items():
        if index.offset is None:
            continue
        chunk = next(c for c in md.state_dict_metadata[index.fqn].chunks if tuple(c.offsets) == tuple(index.offset))
        out.setdefault(index.fqn, []).append((tuple(index.offset), tuple(chunk.sizes), info.relative_path))
    return {k: sorted(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory):
    """A TPNet trained one step and saved by plain torch with FSDP2 on 2 ranks (its full state), and
    the initial state of a new job saved by plain torch on a 2x2 (dp, tp) mesh."""
    from .workloads import tpnet_save

    base = tmp_path_factory.mktemp("tp")
    src, other = str(base / "fsdp2"), str(base / "fsdp-tp")
    expected = run_ranks(tpnet_save, 2, src, 1, True)[0]
    run_ranks(tpnet_save, 4, other, 2, False)
    return src, other, expected


def test_like_an_fsdp_tp_checkpoint_plain_torch_loads_it_bitwise(tp_pair, tmp_path):
    from .workloads import tpnet_load

    src, other, expected = tp_pair
    out = str(tmp_path / "out")
    report = reshard(src, out, like=other)
    assert report.world_size == 4 and report.source_world_size == 2
    layout = stored_layout(out)
    assert layout == stored_layout(other)  # every key's chunks, in the same ranks' files
    w2 = read_metadata(resolve(out)).state_dict_metadata["model.w2.weight"]
    assert any(c.sizes[1] < w2.size[1] for c in w2.chunks), "the rowwise layer is not cut along dim 1"
    assert layout != stored_layout(src)
    results = run_ranks(tpnet_load, 4, out, 2)
    assert_same_nested(results[0]["model"], expected["model"], "model")
    assert_same_nested(results[0]["optim"], expected["optim"], "optim")


def test_like_a_plain_fsdp2_checkpoint_equals_resharding_to_its_world_size(plain, tmp_path):
    out = str(tmp_path / "out")
    report = reshard(plain[2][0], out, like=plain[3][0])
    assert report.world_size == 3 and report.mesh == f"like {resolve(plain[3][0]).url}"
    assert stored_layout(out) == stored_layout(plain[3][0])
    assert_same_checkpoint(plain[2][0], out)


def test_like_refuses_another_model_and_bad_options(plain, tp_pair, tmp_path):
    from ckpttool.errors import MismatchError, UsageError

    src, other, _ = tp_pair
    with pytest.raises(MismatchError, match="other tensors.*model.emb.weight"):
        reshard(plain[2][0], str(tmp_path / "a"), like=other)
    with pytest.raises(UsageError, match="either --world-size or --like"):
        reshard(src, str(tmp_path / "b"), world_size=2, like=other)
    with pytest.raises(UsageError, match="either --world-size or --like"):
        reshard(src, str(tmp_path / "c"))
    assert not any((tmp_path / n).exists() for n in "abc")


def test_like_refuses_a_shape_that_differs_and_the_cli_says_so_in_one_line(tp_pair, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from click.testing import CliRunner

    from ckpttool.cli import main

    src, _, expected = tp_pair
    odd = {"model": dict(expected["model"]), "optim": expected["optim"]}
    odd["model"]["w1.weight"] = torch.zeros(16, 9)
    dcp.save(odd, checkpoint_id=str(tmp_path / "odd"), no_dist=True)
    result = CliRunner().invoke(main, ["reshard", src, str(tmp_path / "out"), "--like", str(tmp_path / "odd")])
    assert result.exit_code == 2, result.output
    assert "'model.w1.weight' has shape [16, 8] in the source but [16, 9] in --like" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
    result = CliRunner().invoke(main, ["reshard", src, str(tmp_path / "out"), "--like", tp_pair[1], "--json"])
    assert result.exit_code == 0, result.output
    assert '"world_size": 4' in result.output


def test_mesh_dp_x_tp_lays_out_fsdp_plus_tp_as_plain_torch_saves_it_and_plain_torch_loads_it(tp_pair, tmp_path):
    """--mesh 2x2 --tp-colwise w1 --tp-rowwise w2 from the FSDP2 checkpoint of 2 ranks: every
    tensor-parallel key's chunks are those plain torch saves on the 2x2 (dp, tp) mesh, in the same
    ranks' files (w1 by rows, tp first; w2 by columns); the others have the same boxes (which rank
    stores a replicated chunk is torch's choice); plain dcp.load on 2x2 gets the state bitwise."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    from .workloads import tpnet_load

    src, other, expected = tp_pair
    out = str(tmp_path / "out")
    result = CliRunner().invoke(main, ["reshard", src, out, "--world-size", "4", "--mesh", "2x2",
                                       "--tp-colwise", "w1", "--tp-rowwise", "w2", "--json"])
    assert result.exit_code == 0, result.output
    assert '"mesh": "2x2 (dp x tp)"' in result.output
    mine, theirs = stored_layout(out), stored_layout(other)
    assert mine.keys() == theirs.keys()
    tp_keys = [k for k in theirs if (".w1." in k or ".w2." in k) and not k.endswith(".step")]
    assert len(tp_keys) == 9
    for key in theirs:
        if key in tp_keys:
            assert mine[key] == theirs[key], key
        else:
            assert [c[:2] for c in mine[key]] == [c[:2] for c in theirs[key]], key
    results = run_ranks(tpnet_load, 4, out, 2)
    assert_same_nested(results[0]["model"], expected["model"], "model")
    assert_same_nested(results[0]["optim"], expected["optim"], "optim")


def test_mesh_dp_x_tp_refuses_a_layer_it_cannot_find_and_a_plan_without_a_mesh(tp_pair, tmp_path):
    from click.testing import CliRunner

    from ckpttool.cli import main

    src = tp_pair[0]
    out = str(tmp_path / "out")
    result = CliRunner().invoke(main, ["reshard", src, out, "--world-size", "4", "--mesh", "2x2", "--tp-colwise", "wq"])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        "error: --tp-colwise 'wq' matches no tensor of the checkpoint "
        "(name a layer as its keys do (w1 matches model.w1.weight), or a glob of whole keys)"]
    result = CliRunner().invoke(main, ["reshard", src, out, "--world-size", "4", "--tp-rowwise", "w2"])
    assert result.exit_code == 2 and "need --mesh DPxTP" in result.output
    assert not (tmp_path / "out").exists()


def test_like_bounds_the_ranks_its_file_names_claim(plain, tmp_path):
    """OTHER's file names say how many rank files DST gets: a hostile one naming rank 70000 must be
    refused before anything is written, not answered with 70,001 files."""
    import pickle
    import shutil

    from ckpttool.errors import FormatError

    other = tmp_path / "other"
    shutil.copytree(plain[3][0], other)
    md = pickle.loads((other / ".metadata").read_bytes())  # our own fixture: trusted here
    obj = next(i for i in md.storage_data if i.offset is None)
    md.storage_data[obj].relative_path = "__70000_0.distcp"
    (other / ".metadata").write_bytes(pickle.dumps(md))
    shutil.copy(other / "__0_0.distcp", other / "__70000_0.distcp")
    with pytest.raises(FormatError, match="written by 70001 ranks"):
        reshard(plain[2][0], str(tmp_path / "out"), like=str(other))
    assert not (tmp_path / "out").exists() and len(list(tmp_path.iterdir())) == 1

