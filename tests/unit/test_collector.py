"""A convert's and a load's records are read with Python's cyclic collector held off (a record's
reads make dicts, tuples and lists and no cycle; collecting them as they came took 10-18% of the
CPU of 5,000 small records: docs/benchmarks.md), and the collector is back on after, also after a
failure."""

from __future__ import annotations

import gc

import pytest
import torch

from ckpttool import Checkpointer, load
from ckpttool.errors import CkptError
from ckpttool.offline.convert import convert
from ckpttool.offline.reshard import reshard
from ckpttool.offline.verify import verify_path


def _many(n: int = 3000, fill: float | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    for i in range(n):
        m.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(16) if fill is None else torch.full((16,), fill)))
    return m


class _Collections:
    def __enter__(self) -> list[int]:
        self.seen: list[int] = []
        gc.callbacks.append(self._count)
        return self.seen

    def _count(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.seen.append(info["generation"])

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._count)


def test_a_convert_and_a_load_of_many_records_run_without_collections_and_leave_the_collector_on(tmp_path):
    model = _many()
    Checkpointer(str(tmp_path / "run")).save(1, model)
    step = str(tmp_path / "run" / "step-1")
    assert gc.isenabled()
    gc.collect()
    with _Collections() as during_convert:
        convert(step, str(tmp_path / "out.safetensors"))
    gc.collect()
    with _Collections() as during_reshard:
        reshard(step, str(tmp_path / "on2"), world_size=2)
    gc.collect()
    with _Collections() as during_verify:
        assert verify_path(str(tmp_path / "on2")).ok
    fresh = _many(fill=0.0)
    gc.collect()
    with _Collections() as during_load:
        load(step, fresh)
    assert gc.isenabled()
    assert len(during_reshard) <= 3 and len(during_verify) <= 3, (len(during_reshard), len(during_verify))
    # (with the collector on: 88 and 69 collections, 33 and 24 with it off only while records were read)
    assert len(during_convert) <= 3 and len(during_load) <= 3, (len(during_convert), len(during_load))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


def test_the_collector_is_back_on_after_a_convert_that_failed(tmp_path):
    Checkpointer(str(tmp_path / "run")).save(1, _many(50))
    step = tmp_path / "run" / "step-1"
    data = step / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a record's bytes changed: the convert fails its check
    data.write_bytes(bytes(raw))
    with pytest.raises(CkptError):
        convert(str(step), str(tmp_path / "out.safetensors"))
    assert gc.isenabled()


@pytest.mark.parametrize("writer", ["ckpttool", "torch"])
def test_a_command_leaves_no_cyclic_garbage(tmp_path, writer):
    """What a command built (a source's index: objects for every record) is freed by reference
    counting when it ends: none of it waits in a cycle for the collector (which scanned 156,000
    objects after a convert of 5,000 records: 33 ms)."""
    model = _many(500)
    step = str(tmp_path / "run" / "step-1")
    if writer == "torch":
        import torch.distributed.checkpoint as dcp

        dcp.save(model.state_dict(), checkpoint_id=step, no_dist=True)
    else:
        Checkpointer(str(tmp_path / "run")).save(1, model)
    fresh = _many(500, fill=0.0)
    commands = {"convert": lambda: convert(step, str(tmp_path / "out.safetensors"), force=True),
                "reshard": lambda: reshard(step, str(tmp_path / "on3"), world_size=3, force=True),
                "verify": lambda: verify_path(step), "load": lambda: load(step, fresh)}
    left = {}
    for name, command in commands.items():
        command()  # (once first: what a first call imports and caches is not garbage)
        gc.collect()
        gc.disable()
        try:
            command()
            left[name] = gc.collect()
        finally:
            gc.enable()
    assert max(left.values()) < 100, left  # (a cycle through the index: 15,000 and more here)
