"""Every private, dunder or moved torch name ckpttool depends on, checked against the running torch.

``make test-matrix`` runs this file on the oldest declared torch, the pinned one and the newest
release. When a torch upgrade moves one of these names, the failure names it, says what ckpttool
uses it for and where to mend it (ckpttool/compat.py), instead of surfacing as a confusing error
deep inside a save or a convert.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import os
import pickle
import warnings

import torch

from ckpttool import compat
from ckpttool.safe_pickle import _DCP_CLASSES

from ..helpers import FIXTURES

TORCH = torch.__version__


def moved(name: str, use: str) -> str:
    return (f"torch {TORCH} moved or changed {name}, which ckpttool uses for {use}; "
            "mend ckpttool/compat.py (and docs/compat.md) for this release")


def test_storage_info_is_a_dataclass_with_path_offset_length():
    cls = compat.storage_info_class()
    fields = [f.name for f in dataclasses.fields(cls)]
    assert fields[:3] == ["relative_path", "offset", "length"], moved(
        "torch.distributed.checkpoint.filesystem._StorageInfo", "each record's entry in the .metadata ckpttool writes")
    info = compat.storage_info("__0_0.distcp", 7, 9)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 7, 9)


def test_record_transforms_exist():
    """Every release of the declared range (torch >= 2.7) has per-record transforms; the refusal
    below it is tested in tests/golden/test_realworld.py."""
    assert compat.has_record_transforms(), moved("_StorageInfo.transform_descriptors", "compressed records")
    try:
        extension = compat.zstd_extension()
    except ImportError:
        extension = None
    assert type(extension).__name__ == "ZStandard", moved(
        "torch.distributed.checkpoint._extension.ZStandard", "Checkpointer(compress='zstd')")
    info = compat.storage_info("__0_0.distcp", 0, 4, ["stream.zstd/1"])
    assert info.transform_descriptors == ["stream.zstd/1"]


def test_metadata_fields_and_version():
    from torch.distributed.checkpoint.metadata import Metadata

    fields = {f.name for f in dataclasses.fields(Metadata)}
    assert {"state_dict_metadata", "planner_data", "storage_data", "storage_meta"} <= fields, moved(
        "torch.distributed.checkpoint.metadata.Metadata", "the .metadata ckpttool writes")
    md = compat.dcp_metadata(state_dict_metadata={}, storage_data={})
    if "version" in fields:  # torch >= 2.9 records the DCP format version; ckpttool writes the same one
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        assert md.version == compat.DCP_VERSION == CURRENT_DCP_VERSION, moved("CURRENT_DCP_VERSION", "Metadata.version")
    # what this torch writes, every torch in the range unpickles (plain pickle: torch's own reader)
    assert pickle.loads(pickle.dumps(md)).state_dict_metadata == {}


def test_every_dcp_class_the_allow_list_admits_exists():
    for module, name in sorted(_DCP_CLASSES):
        value = getattr(importlib.import_module(module), name, None)
        assert inspect.isclass(value), moved(f"{module}.{name}", "reading DCP .metadata")


def test_fsspec_writer_is_torchs_fsspec_writer():
    private = importlib.import_module("torch.distributed.checkpoint._fsspec_filesystem").FsspecWriter
    assert compat.fsspec_writer_class() is private, moved(
        "torch.distributed.checkpoint.FsspecWriter", "Checkpointer saves to fsspec URLs")


def test_the_torch_save_format_names_still_resolve():
    """The names a torch.save pickle spells: torch.load must still know them, and they must still
    mean what ckpttool writes (the legacy storage table is the format's, checked against torch's)."""
    fn = compat.rebuild_tensor_v2()
    assert (fn.__module__, fn.__name__) == ("torch._utils", "_rebuild_tensor_v2"), moved(
        "torch._utils._rebuild_tensor_v2", "the tensors of every .pt and DCP record ckpttool writes")
    private = getattr(torch.storage, "_dtype_to_storage_type_map", None)
    if private is not None:
        assert private() == compat.LEGACY_STORAGE_NAMES, moved("torch.storage._dtype_to_storage_type_map",
                                                                "the storage names in torch.save pickles")
    with warnings.catch_warnings():  # the legacy classes warn when touched; ckpttool only writes their names
        warnings.simplefilter("ignore", UserWarning)
        resolved = {dtype: getattr(torch, name).dtype for dtype, name in compat.LEGACY_STORAGE_NAMES.items()}
    for dtype, name in compat.LEGACY_STORAGE_NAMES.items():
        assert resolved[dtype] == dtype, moved(f"torch.{name}", "the storage names in torch.save pickles")
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    assert b"torch._utils" in buf.getvalue() and b"_rebuild_tensor_v2" in buf.getvalue(), moved(
        "torch.save's pickle", "reading .pt files (the allow-list names _rebuild_tensor_v2)")


def test_dtensor_chunk_list_dunder_and_the_fake_process_group():
    """Rank 1 of 2 (torch's fake process group, as reshard --to torch-ranks uses it: no peers
    needed) holds rows 2..3 of a 4x3 Shard(0) tensor."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    assert hasattr(DTensor, "__create_chunk_list__"), moved("DTensor.__create_chunk_list__", "each shard's box")
    local, box = compat.local_shard_box(torch.zeros(2, 3))
    assert box == ((0, 0), (2, 3)) and local.shape == (2, 3)
    with compat.fake_rank(1, 2):
        assert tdist.get_rank() == 1 and tdist.get_world_size() == 2, moved(
            "torch.testing._internal.distributed.fake_pg.FakeStore", "reshard --to torch-ranks")
        mesh = init_device_mesh("cpu", (2,))
        shard = torch.arange(6.0).reshape(2, 3)
        value = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False, shape=(4, 3), stride=(3, 1))
        local, box = compat.local_shard_box(value)
        assert box == ((2, 0), (2, 3)) and torch.equal(local, shard), moved("DTensor.__create_chunk_list__", "each shard's box")
    assert not tdist.is_initialized()


def test_a_dtensors_local_part_and_spec_and_the_dispatch_stack():
    """What an async save reads of a DTensor without its public calls (the local shard, the spec
    object, the same one while the layout holds), and how the write guard finds itself on this
    thread's dispatch stack."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    with compat.fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        value = DTensor.from_local(torch.arange(6.0).reshape(2, 3), mesh, [Shard(0)], run_check=False, shape=(4, 3), stride=(3, 1))
        assert compat.local_tensor(value) is value.to_local() or torch.equal(compat.local_tensor(value), value.to_local()), moved(
            "DTensor._local_tensor", "an async save's copy of each shard")
        spec = compat.dtensor_spec(value)
        assert spec is not None and spec is compat.dtensor_spec(value) and tuple(spec.placements) == (Shard(0),), moved(
            "DTensor._spec", "an async save's plan of each tensor")
    assert compat.dtensor_spec(torch.zeros(2)) is None
    mode_class = compat.dispatch_mode_class()
    before = compat.dispatch_stack()
    with mode_class() as mode:
        assert compat.dispatch_stack()[-1] is mode, moved("torch._C._get_dispatch_stack_at", "the async save's write guard")
    assert compat.dispatch_stack() == before


def test_ckpttool_writes_the_metadata_every_release_reads(tmp_path, monkeypatch):
    """Both DCP writers (offline convert/reshard, and Checkpointer's collective-free save) write
    TensorProperties as the five fields torch <= 2.14 unpickles, even where the object pickles as
    six by itself, as on torch 2.15 (simulated on every release: __getstate__ gives a sixth field)."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    from ckpttool import Checkpointer, convert

    native_get = TensorProperties.__getstate__
    with monkeypatch.context() as m:
        m.setattr(TensorProperties, "__getstate__", lambda self: tuple(native_get(self))[:5] + (None,))
        convert(os.path.join(FIXTURES, "plain.pt"), str(tmp_path / "offline"))
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        with Checkpointer(str(tmp_path / "run")) as ckpt:
            ckpt.save(1, model, optimizer)
    seen: list[int] = []

    def recording(self, state):  # counts the fields only: a sixth would not unpack on torch <= 2.14
        seen.append(len(state))

    monkeypatch.setattr(TensorProperties, "__setstate__", recording)
    for step_dir in (tmp_path / "offline", tmp_path / "run" / "step-1"):
        seen.clear()
        with open(step_dir / ".metadata", "rb") as f:
            pickle.load(f)  # plain pickle, as torch's reader does
        assert seen and set(seen) == {5}, (step_dir, seen)
