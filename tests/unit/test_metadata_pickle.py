"""The offline DCP sink's ``.metadata``, pickled from stand-ins under torch's names
(``formats/dcp/metadata_pickle.py``) without importing ``torch.distributed.checkpoint``."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest
import torch

from ckpttool import compat, convert
from ckpttool.dtypes import PLAIN
from ckpttool.formats.dcp import metadata_pickle as mp

from ..helpers import assert_bitwise


def _metadata(dtypes, *, transforms=None, key_prefix="model."):
    """Metadata with a chunked tensor of each dtype (two chunks, each its own Size objects, as
    the sink builds them), an object entry, and planner paths with an int component."""
    state, storage, planner = {}, {}, {}
    for i, name in enumerate(dtypes):
        key = f"{key_prefix}{name}"
        chunks = []
        for j, offsets in enumerate([(0, 0), (2, 0)]):
            storage[mp.metadata_index(key, mp.Size(offsets), j)] = mp.storage_info(f"__{j}_0.distcp", 100 * i, 50 + j, transforms)
            chunks.append(mp.ChunkStorageMetadata(offsets=mp.Size(offsets), sizes=mp.Size((2, 3))))
        state[key] = mp.TensorStorageMetadata(properties=mp.TensorProperties(name), size=mp.Size((4, 3)), chunks=chunks)
        planner[key] = (key_prefix.rstrip("."), name)
    storage[mp.metadata_index("optim.param_groups", None, None)] = mp.storage_info("__0_0.distcp", 9999, 77, transforms)
    state["optim.param_groups"] = mp.BytesStorageMetadata()
    planner["optim.param_groups"] = ("optim", "param_groups", 0)
    return mp.metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                       storage_meta=mp.StorageMeta(checkpoint_id=None, save_id="id", load_id=None, modules=[]))


def _strings(md):
    return [*md.state_dict_metadata, *(p for path in md.planner_data.values() for p in path if isinstance(p, str))]


@pytest.mark.parametrize("transforms", [None, ["stream.zstd/1"]])
def test_the_pickle_is_byte_for_byte_what_torchs_own_classes_pickle_to(transforms):
    """Every plain dtype, chunked tensors, an object entry, a transform: the stand-ins' pickle is
    the bytes torch's own Metadata (built from torch's classes) pickles to at the same protocol,
    and plain pickle.loads gives torch's classes, equal to those."""
    if transforms and not compat.has_record_transforms():
        pytest.skip("this torch's _StorageInfo has no transforms")
    md = _metadata(list(PLAIN), transforms=transforms)
    ours = mp.dumps(md, _strings(md), [t.properties.dtype for t in md.state_dict_metadata.values() if hasattr(t, "properties")])
    theirs = mp.to_torch(md)
    if "version" not in theirs.__dict__:  # torch < 2.9: no such field; ours carries it (ignored there)
        theirs.version = md.version
    assert ours == compat.dump_metadata(theirs, protocol=3)
    back = pickle.loads(ours)
    assert type(back) is type(theirs) and back == theirs
    assert back.state_dict_metadata["model.bfloat16"].properties.dtype is torch.bfloat16


def test_a_key_that_names_the_stand_ins_module_falls_back_to_torchs_classes(tmp_path):
    """The renaming rewrites GLOBAL opcodes by their bytes: a key holding those bytes is not
    rewritten with them. The sink then pickles torch's classes; the output loads in plain torch."""
    import torch.distributed.checkpoint as dcp

    key = f"c{mp.MODULE}\nSize\n"
    src = tmp_path / "src.pt"
    value = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    torch.save({key: value, "plain": value + 1}, src)
    out = tmp_path / "dcp"
    convert(str(src), str(out), to="dcp")
    template = {key: torch.empty(4, 3), "plain": torch.empty(4, 3)}
    dcp.load(template, checkpoint_id=str(out))
    assert_bitwise(template[key], value, key)
    assert_bitwise(template["plain"], value + 1, "plain")
    md = _metadata(["float32"], key_prefix=key)
    assert mp.dumps(md, _strings(md), ["float32"]) is None


def test_an_offline_reshard_does_not_import_torchs_checkpoint_package(tmp_path):
    """The import it saves (0.8-1.3 s here): a reshard in a fresh interpreter ends with no
    torch.distributed.checkpoint module loaded, and its output loads in plain torch."""
    src = tmp_path / "src.pt"
    state = {"w": torch.randn(6, 4), "b": torch.randn(6).to(torch.bfloat16), "step": 3}
    torch.save(state, src)
    dcp_dir = tmp_path / "dcp"
    convert(str(src), str(dcp_dir), to="dcp")
    out = tmp_path / "w3"
    code = (
        "import sys\n"
        "from ckpttool.offline.reshard import reshard\n"
        f"reshard({str(dcp_dir)!r}, {str(out)!r}, world_size=3)\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
    import torch.distributed.checkpoint as dcp

    template = {"w": torch.empty(6, 4), "b": torch.empty(6, dtype=torch.bfloat16), "step": 0}
    dcp.load(template, checkpoint_id=str(out))
    for k in ("w", "b"):
        assert_bitwise(template[k], state[k], k)
    assert template["step"] == 3


def _described(rng, n_keys: int, n_chunks: int) -> "mp.Described":
    """A step's description with every kind of entry: row-sharded tensors of many dtypes (empty
    chunks, offsets and lengths past 2**31 and 2**32, transforms on some records), objects, a
    scalar, planner paths with ints, keys that are not plain ASCII or name our own modules."""
    d = mp.Described()
    for i in range(n_keys):
        key = [f"model.l{i}.w", f"optim.state.{i}.ß\udcff", f"model.{mp.MODULE}.{i}"][i % 3]
        d.order.append(key)
        d.paths[key] = (*key.split("."), *((i,) if i % 2 else ()))
        if i % 4 == 3:
            d.objects[key] = ("__0_0.distcp", rng.randrange(1 << 40), rng.randrange(1000), ["stream.zstd/1"] if i % 8 == 7 else None)
            continue
        rows, cols = rng.randrange(0, 70000), rng.randrange(1, 5)
        c = max(1, -(-rows // n_chunks))
        chunks = []
        for r in range(n_chunks):
            o = min(r * c, rows)
            chunks.append(((o, 0), (max(0, min(c, rows - o)), cols),
                           (f"__{r}_0.distcp", rng.randrange(1 << 34), rng.randrange(1 << 33), ["a/1"] if rng.random() < 0.1 else None)))
        d.tensors[key] = ((rows, cols), rng.choice(list(PLAIN)), chunks)
    d.order.append("scalar")
    d.tensors["scalar"] = ((), "float32", [((), (), ("__0_0.distcp", 5, 4, None))])
    d.order.append("cube")
    d.tensors["cube"] = ((2, 3, 4, 5), "int8", [((0, 0, 0, 0), (2, 3, 4, 5), ("__0_0.distcp", 9, 120, None))])
    return d


@pytest.mark.slow
def test_the_opcode_writer_gives_what_the_object_graph_pickles_to_and_fewer_bytes():
    """metadata_emit writes .metadata opcode by opcode: plain pickle (torch's classes) and the
    allow-listed reader both get from it exactly what they get from the object graph's pickle
    (every field, every dict in the same order), batches past the pickler's 1000 included, in
    fewer bytes."""
    import random

    from ckpttool.formats.dcp.metadata_emit import metadata_stream
    from ckpttool.safe_pickle import load_dcp_metadata
    from ckpttool.formats.dcp.metadata_types import CLASSES

    rng = random.Random(0)
    for trial in range(12):
        d = _described(rng, rng.randrange(1, 40), rng.choice([1, 3, 999, 1000, 1001, 2500]))
        new = metadata_stream(d, "sid", compat.DCP_VERSION)
        old = mp.pickled_metadata(d, "sid")
        a, b = pickle.loads(new), pickle.loads(old)
        assert a == b, trial
        versioned = "version" in {f.name for f in dataclasses.fields(type(a))}  # (torch >= 2.9)
        if versioned:
            assert a.version == b.version
        assert list(a.state_dict_metadata) == list(b.state_dict_metadata) and list(a.planner_data) == list(b.planner_data)
        assert [(k.__dict__, v.__dict__) for k, v in a.storage_data.items()] == \
            [(k.__dict__, v.__dict__) for k, v in b.storage_data.items()]
        mine, theirs = load_dcp_metadata(new, "x", CLASSES), load_dcp_metadata(old, "x", CLASSES)
        if not versioned:  # (an older torch's own classes, the graph's fallback, carry no version; ours always do)
            mine.version = theirs.version = None
        assert mine == theirs
        if sum(len(t[2]) for t in d.tensors.values()) > 5000:  # (its prelude names every class once: a few hundred bytes)
            assert len(new) < 0.7 * len(old), (len(new), len(old))
    assert mp.metadata_bytes(d, "sid") == new  # the writer of every step's .metadata
