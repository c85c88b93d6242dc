"""Async-save staging: host buffers reused from save to save, a snapshot that training cannot
change, and on CUDA no second copy of the state on the device."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from ckpttool import Checkpointer
from ckpttool import rendezvous as dist
from ckpttool.training.staging import Stager


def _model(device: str = "cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer


def _step(model, optimizer, device: str = "cpu", width: int = 64) -> None:
    model(torch.randn(16, width, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for i, st in optimizer.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.detach().cpu().clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _loaded(root: str, step: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    model, optimizer = _model(device)
    _step(model, optimizer, device)  # the optimizer's state exists, with other values
    Checkpointer(root).load(model, optimizer, step=step)
    return _snapshot(model, optimizer)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k]), k


@contextlib.contextmanager
def _async_run(tmp_path, device: str = "cpu", writer: str = "thread"):
    """A model stepped once and an async Checkpointer on tmp_path/run: (root, model, optimizer, ckpt)."""
    root = str(tmp_path / "run")
    model, optimizer = _model(device)
    _step(model, optimizer, device)
    with Checkpointer(root, async_save=True, writer=writer) as ckpt:
        yield root, model, optimizer, ckpt


def _snapshot_and_save(ckpt, step: int, model, optimizer) -> dict[str, torch.Tensor]:
    expected = _snapshot(model, optimizer)
    ckpt.save(step, model, optimizer)
    return expected


@pytest.fixture
def held_copy(monkeypatch):
    """The background staging copy waits at its start until the returned event is set (set at
    teardown too, so a failing test cannot leave a save hanging)."""
    gate = threading.Event()
    real = dist.pause_point
    monkeypatch.setattr(dist, "pause_point", lambda name: gate.wait(30) if name == "stage-copy" else real(name))
    yield gate
    gate.set()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_host_buffers_are_reused_and_the_snapshot_is_exact_when_training_goes_on_at_once(tmp_path, writer):
    with _async_run(tmp_path, writer=writer) as (root, model, optimizer, ckpt):
        expected1 = _snapshot_and_save(ckpt, 1, model, optimizer)
        first = {k: b.data_ptr() for k, b in ckpt.staging.buffers.items()}
        _step(model, optimizer)  # at once: forward (BatchNorm statistics), backward, step
        _step(model, optimizer)
        expected2 = _snapshot_and_save(ckpt, 2, model, optimizer)
        second = {k: b.data_ptr() for k, b in ckpt.staging.buffers.items()}
        _step(model, optimizer)
    assert first == second and len(first) >= 8  # the same host memory, every tensor
    _assert_same(_loaded(root, 1), expected1)
    _assert_same(_loaded(root, 2), expected2)
    assert not torch.equal(expected1["model.0.weight"], expected2["model.0.weight"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_is_pinned_host_memory_never_a_second_device_copy(tmp_path):
    with _async_run(tmp_path, "cuda") as (root, model, optimizer, ckpt):
        state_bytes = sum(t.numel() * t.element_size() for t in _snapshot(model, optimizer).values())
        expected = _snapshot(model, optimizer)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        ckpt.save(1, model, optimizer)
        during = torch.cuda.memory_allocated()
        assert during - before < state_bytes // 2  # no copy of the state on the device
        assert all(b.is_pinned() and b.device.type == "cpu" for b in ckpt.staging.buffers.values())
        _step(model, optimizer, "cuda")  # the pre-step fence orders the step after the copies
    _assert_same(_loaded(root, 1, "cuda"), expected)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_the_background_copy_is_fenced_before_the_next_optimizer_step(tmp_path, held_copy, monkeypatch, writer):
    """save() returns while the CPU copy thread is held back, and the optimizer's next step
    finishes the copy first (the fence copies what the copy thread has not taken, and then
    releases the hold): the step saved is the state at the call, bit for bit."""
    real = Stager.before_write

    def before_write(self, storages):
        copying = self.copying and storages is None  # (a forward's write of a buffer finishes nothing)
        real(self, storages)
        if copying:
            assert not self.copying  # the fence finished the copy itself
            held_copy.set()

    monkeypatch.setattr(Stager, "before_write", before_write)
    with _async_run(tmp_path, writer=writer) as (root, model, optimizer, ckpt):
        expected = _snapshot_and_save(ckpt, 1, model, optimizer)
        assert ckpt.staging.copying  # save() did not wait for the copy
        _step(model, optimizer)  # at once: the step must wait for the copy
        assert not ckpt.staging.copying
    _assert_same(_loaded(root, 1), expected)


class _Counting(torch.nn.Module):
    """A linear layer with a buffer its forward changes in place (as running statistics are)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x):
        self.seen.add_(x.detach().sum(0))
        return self.lin(x)


def test_dtensor_buffers_are_copied_at_the_call(tmp_path, one_rank_mesh, held_copy):
    """Buffers that are DTensors (distribute_module replicates them) are copied at the call, not by
    the background copy: a forward right after save() changes them before the optimizer's fence."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    torch.manual_seed(0)
    model = distribute_module(_Counting(), one_rank_mesh,
                              input_fn=lambda mod, inputs, mesh: tuple(DTensor.from_local(t, mesh, [Replicate()]) for t in inputs))
    assert isinstance(model.seen, DTensor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, optimizer, width=8)
    with Checkpointer(str(tmp_path / "run"), async_save=True) as ckpt:
        seen = model.seen.to_local().clone()
        ckpt.save(1, model, optimizer)
        assert ckpt.staging.copying  # the parameters' copy is held back
        model(torch.ones(4, 8))  # a forward before the next step: the buffer changes in place
        assert not torch.equal(model.seen.to_local(), seen)
        held_copy.set()
        ckpt.wait()
        ckpt.load(model, optimizer, step=1)
    assert torch.equal(model.seen.to_local(), seen)


def test_a_failed_background_copy_fails_its_own_save_only():
    """The writer of the save whose copy failed raises the error (wait()); the next save, in the
    background too and staged without waiting for the first, does not raise it again."""
    fail = iter([True])

    def broken_once():
        if next(fail, False):
            raise RuntimeError("copy failed")

    stager = Stager(before_copy=broken_once)
    state = {"w": torch.arange(4.0)}
    stager.stage(state, 0, None, background=True)
    with pytest.raises(RuntimeError, match="copy failed"):
        stager.wait()
    staged = stager.stage({"w": torch.arange(4.0) + 1}, 0, None, background=True)
    stager.wait()
    assert torch.equal(staged["w"].local, torch.arange(4.0) + 1)


def test_a_failed_background_copy_fails_that_checkpointer_save_and_not_the_next(tmp_path, monkeypatch):
    """Through Checkpointer: the save whose copy failed raises (at the next save, as every
    background error does); the save after it commits."""
    fail = iter([True])
    real = dist.pause_point

    def pause(name):
        if name == "stage-copy" and next(fail, False):
            raise RuntimeError("copy failed")
        real(name)

    monkeypatch.setattr(dist, "pause_point", pause)
    with _async_run(tmp_path) as (root, model, optimizer, ckpt):
        ckpt.save(1, model, optimizer)
        _step(model, optimizer)
        with pytest.raises(RuntimeError, match="copy failed"):
            ckpt.save(2, model, optimizer)
        expected = _snapshot_and_save(ckpt, 3, model, optimizer)
        ckpt.wait()
    _assert_same(_loaded(root, 3), expected)


def test_what_each_tensor_needs_is_kept_between_saves_and_redone_when_it_changes():
    """The second stage() of the same tensors plans nothing afresh; a tensor replaced, or given
    another shape in place, is planned again (its buffer follows); a key gone loses its buffer;
    every staged copy is the tensor's value at its stage()."""
    a, b, c = torch.arange(4.0), torch.ones(3), torch.zeros(2)
    state = {"model": {"a": a, "b": b}, "optim": {"c": c, "lr": 0.1}}
    stager = Stager()
    stager.stage(state, 0, None)
    assert stager.planned == 3
    a.add_(1)
    staged = stager.stage(state, 0, None)
    assert stager.planned == 0 and torch.equal(staged["model"]["a"].local, torch.arange(4.0) + 1)
    state["model"]["b"] = torch.full((3,), 5.0)  # another tensor object under the same key
    c.resize_(5).fill_(2)  # the same tensor object, another shape
    staged = stager.stage(state, 0, None)
    assert stager.planned == 2
    assert torch.equal(staged["model"]["b"].local, torch.full((3,), 5.0))
    assert torch.equal(staged["optim"]["c"].local, torch.full((5,), 2.0)) and staged["optim"]["c"].shape == (5,)
    del state["optim"]["c"]
    stager.stage(state, 0, None)
    assert set(stager.buffers) == {"model.a", "model.b"}


def test_staged_state_has_the_keys_and_nesting_the_writer_flattens():
    """stage() walks a state as index.flatten does (DCP's rule for lists, tuples are leaves) and
    gives it back nested the same way, every tensor a HostShard under its flat key."""
    from ckpttool.errors import CorruptCheckpointError
    from ckpttool.training.step_writer import HostShard
    from ckpttool.index import flatten

    t = [torch.full((2,), float(i)) for i in range(5)]
    state = {"a": {"b": [t[0], {"c": t[1]}], "d": [1, [2, 3]], "e": (t[2],)}, "f": [[t[3]]], 3: {"x": t[4], "y": None}}
    stager = Stager()
    staged = stager.stage(state, 0, None)
    want, want_paths = flatten(state)
    got, got_paths = flatten(staged, is_tensor=lambda v: isinstance(v, (torch.Tensor, HostShard)))
    assert list(got) == list(want) and got_paths == want_paths
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[key], HostShard) and torch.equal(got[key].local, value), key
        elif key == "a.e":  # an object holding a tensor: a copy of it (a snapshot), equal
            assert type(got[key]) is tuple and got[key][0] is not value[0] and torch.equal(got[key][0], value[0])
        elif isinstance(value, list):  # a mutable object: a copy made at the call, equal
            assert got[key] == value and got[key] is not value and got[key][1] is not value[1], key
        else:
            assert got[key] is value, key
    state["a"]["d"][1].append(4)  # the caller changes an object after the call: the staged copy does not
    assert flatten(staged, is_tensor=lambda v: isinstance(v, (torch.Tensor, HostShard)))[0]["a.d"] == [1, [2, 3]]
    assert set(stager.buffers) == {k for k, v in want.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(CorruptCheckpointError, match="same key"):
        stager.stage({"a.b": t[0], "a": {"b": t[1]}}, 0, None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")
@pytest.mark.parametrize("writer_nice", [19, None])
def test_async_saves_start_their_threads_once_and_write_at_the_writer_priority(tmp_path, monkeypatch, writer_nice):
    """Three async saves start two threads in all (the copy, the writer); the copy runs at the
    training thread's priority (the optimizer's step may wait for it), the write at writer_nice;
    every step loads back as it was at its save."""
    starts = []
    real_start = threading.Thread.start

    def start(self):
        starts.append(self.name)
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    nice = {}
    real_pause = dist.pause_point

    def pause(name):
        if name in ("stage-copy", "after-write"):
            nice.setdefault(name, set()).add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        real_pause(name)

    monkeypatch.setattr(dist, "pause_point", pause)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    root = str(tmp_path / "run")
    model, optimizer = _model()
    _step(model, optimizer)
    expected = {}
    with Checkpointer(root, async_save=True, writer_nice=writer_nice) as ckpt:
        for step in range(1, 4):
            expected[step] = _snapshot_and_save(ckpt, step, model, optimizer)
            _step(model, optimizer)
    assert [n for n in starts if n != "ckpttool-lease"] == ["ckpttool-stage", "ckpttool-save"]
    assert nice == {"stage-copy": {mine}, "after-write": {mine if writer_nice is None else max(mine, writer_nice)}}
    for step, want in expected.items():
        _assert_same(_loaded(root, step), want)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_tensors_inside_an_object_are_a_snapshot_too(tmp_path, writer):
    """A tuple of tensors is one object to DCP (pickled by the writer, later): what an async save
    writes is its value at the call, even when training changes the tensors at once."""
    first, second = torch.arange(3.0), torch.ones(2)
    extra = {"pair": (first, {"w": second}, [second]), "plain": (1, 2.0)}
    with _async_run(tmp_path, writer=writer) as (root, model, optimizer, ckpt):
        ckpt.save(1, model, optimizer, extra=extra)
        first.add_(10)  # at once, before the writer pickles the objects
        second.mul_(3)
        ckpt.wait()
        res = ckpt.load(model, optimizer, step=1)
    pair = res.extra["pair"]
    assert torch.equal(pair[0], torch.arange(3.0)) and torch.equal(pair[1]["w"], torch.ones(2)) and torch.equal(pair[2][0], torch.ones(2))
    assert res.extra["plain"] == (1, 2.0)


def test_a_list_of_tensors_in_extra_round_trips_through_an_async_save(tmp_path):
    with _async_run(tmp_path) as (root, model, optimizer, ckpt):
        ckpt.save(1, model, optimizer, extra={"rng": [torch.arange(3.0), torch.ones(2)]})
        ckpt.wait()
        res = ckpt.load(model, optimizer, step=1)
    assert torch.equal(res.extra["rng"][0], torch.arange(3.0)) and torch.equal(res.extra["rng"][1], torch.ones(2))


def test_cpu_buffers_are_views_of_one_block_of_the_states_size():
    """One allocation holds every CPU buffer (the state's bytes, each buffer 64-byte aligned),
    reused from save to save; a tensor that has no place in it gets a new block for all."""
    state = {"a": torch.randn(100), "b": torch.randn(3, 5, dtype=torch.float64), "c": torch.tensor(7), "e": torch.empty(0, 4),
             "h": torch.ones(3, dtype=torch.bfloat16)}
    stager = Stager()
    staged = stager.stage(state, 0, None)

    def blocks():
        return {b.untyped_storage().data_ptr() for b in stager.buffers.values() if b.numel()}

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    (block,) = blocks()
    size = next(b for b in stager.buffers.values() if b.numel()).untyped_storage().nbytes()
    assert nbytes <= size <= nbytes + 64 * len(state)
    assert all(torch.equal(staged[k].local, v) and staged[k].local.dtype == v.dtype for k, v in state.items())
    ptrs = {k: b.data_ptr() for k, b in stager.buffers.items()}
    state["a"].add_(1)
    staged = stager.stage(state, 0, None)
    assert {k: b.data_ptr() for k, b in stager.buffers.items()} == ptrs and blocks() == {block}
    assert torch.equal(staged["a"].local, state["a"])
    state["d"] = torch.arange(6, dtype=torch.int32)
    staged = stager.stage(state, 0, None)
    assert len(blocks()) == 1 and blocks() != {block}
    assert all(torch.equal(staged[k].local, v) for k, v in state.items())


def test_a_placement_the_writer_does_not_lay_out_falls_back_and_the_next_save_is_staged(tmp_path, one_rank_mesh):
    """An async save holding a strided-shard DTensor (FSDP2 with tensor parallelism makes them)
    is written by DCP's own writer (found while staging, after other tensors were planned); the
    next save, without it, is staged again and every step loads back as it was."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    root = str(tmp_path / "run")
    model, optimizer = _model()
    _step(model, optimizer)
    with Checkpointer(root, async_save=True) as ckpt:
        expected1 = _snapshot_and_save(ckpt, 1, model, optimizer)  # staged: the buffers exist
        strided = DTensor.from_local(torch.arange(4.0), one_rank_mesh, [_StridedShard(0, split_factor=2)])
        seen = torch.ones(3)  # planned afresh before "z" is found: never kept without its buffer
        ckpt.save(2, model, optimizer, extra={"seen": seen, "z": strided})
        ckpt.wait()
        _step(model, optimizer)
        expected3 = _snapshot(model, optimizer)
        ckpt.save(3, model, optimizer, extra={"seen": seen})
        ckpt.wait()
        assert torch.equal(ckpt.load(model, optimizer, step=3).extra["seen"], seen)
        assert ckpt.steps() == [1, 2, 3]
    _assert_same(_loaded(root, 1), expected1)
    _assert_same(_loaded(root, 3), expected3)


# In-place writes the write guard must see although no schema or storage object says so plainly
# (each found by a red-team run on the first version of the guard): the step stays exact.

@torch.library.custom_op("ckpttool_test::lerp_", mutates_args=("x",))
def _lerp_(x: torch.Tensor, y: torch.Tensor, weight: float) -> None:
    x.lerp_(y, weight)


def _in_place_by_custom_op(model, optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            _lerp_(p, torch.zeros_like(p), 0.5)  # an EMA-like custom op: its own kernel moves the version first


def _in_place_through_an_offset_alias(model, optimizer) -> None:
    # a tensor over the same memory from past the start of the weight's storage, not the same storage object
    torch.from_dlpack(model[0].weight.detach()[1:]).mul_(2.0)


@pytest.mark.parametrize("edit", [_in_place_by_custom_op, _in_place_through_an_offset_alias], ids=["custom op", "offset alias"])
def test_writes_the_guard_must_see_on_the_saving_thread_keep_the_step_exact(tmp_path, held_copy, edit):
    # (a collective's write, c10d::allreduce_, is one of EDITS in tests/dist/test_snapshot.py)
    with _async_run(tmp_path) as (root, model, optimizer, ckpt):
        expected = _snapshot_and_save(ckpt, 1, model, optimizer)
        assert ckpt.staging.copying
        edit(model, optimizer)
        after = _snapshot(model, optimizer)
        held_copy.set()
        ckpt.wait()  # no SnapshotError: the guard copied before the write
    _assert_same(_loaded(root, 1), expected)
    assert not torch.equal(after["model.0.weight"], expected["model.0.weight"])


def test_a_compiled_optimizer_step_while_the_copy_is_in_flight_breaks_nothing(tmp_path, held_copy):
    """A guard taken off the dispatch stack inside a compiled frame left torch's Python dispatch key
    on with no mode: every later factory op failed with an internal assert."""
    import torch._dynamo

    torch._dynamo.reset()
    with _async_run(tmp_path) as (root, model, optimizer, ckpt):
        step = torch.compile(optimizer.step, backend="eager")
        expected = _snapshot_and_save(ckpt, 1, model, optimizer)
        model(torch.randn(16, 64)).square().mean().backward()
        step()  # the pre-step fence runs inside the compiled frame
        optimizer.zero_grad()
        torch.empty(2)  # (the failure)
        held_copy.set()
        expected2 = _snapshot_and_save(ckpt, 2, model, optimizer)
        _step(model, optimizer)
    _assert_same(_loaded(root, 1), expected)
    _assert_same(_loaded(root, 2), expected2)
    torch._dynamo.reset()


def test_a_write_guarded_while_the_copy_thread_finishes_copies_nothing_twice_and_fails_nothing(tmp_path, held_copy, monkeypatch):
    """The copy thread may finish (and let go of its list of tensors) while the saving thread's
    guard looks up what a write touches: found by torch 2.7's FSDP all-gather in a forward right
    after save() (an IndexError in the training thread)."""
    from ckpttool.training import staging

    real = staging.memory_span
    with _async_run(tmp_path) as (root, model, optimizer, ckpt):
        expected = _snapshot_and_save(ckpt, 1, model, optimizer)
        copy = ckpt.staging._pending

        def span_as_the_copy_finishes(t):
            if copy.items:  # the copy thread finishes at this very moment
                held_copy.set()
                copy.run()
            return real(t)

        monkeypatch.setattr(staging, "memory_span", span_as_the_copy_finishes)
        with torch.no_grad():
            model[0].weight.mul_(2.0)
        ckpt.wait()
    _assert_same(_loaded(root, 1), expected)


def _in_another_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_another_threads_write_through_p_data_is_not_seen_and_wait_first_keeps_the_step_exact(tmp_path, held_copy):
    """What the README's list of writes not seen says, shown: ``p.data`` is a new tensor with a
    version counter of its own, so another thread's ``p.data.mul_()`` during the copy is seen by no
    guard and no counter the copy checks: the step holds the values as the copy found them. The
    same thread's write through the tensor itself fails the save (SnapshotError); the cure for the
    other, ``ckpt.wait()`` before it, keeps the step exact."""
    from ckpttool.errors import SnapshotError

    weight = "model.0.weight"
    with _async_run(tmp_path) as (root, model, optimizer, ckpt):
        expected = _snapshot_and_save(ckpt, 1, model, optimizer)
        _in_another_thread(lambda: model[0].weight.data.mul_(2.0))  # before its copy: not seen
        held_copy.set()
        ckpt.wait()  # no error
        torn = _loaded(root, 1)
        assert torch.equal(torn[weight], expected[weight] * 2) and not torch.equal(torn[weight], expected[weight])

        held_copy.clear()
        _snapshot_and_save(ckpt, 2, model, optimizer)

        def counted():
            with torch.no_grad():
                model[0].weight.mul_(2.0)  # the tensor itself: its version counter moves

        _in_another_thread(counted)
        held_copy.set()
        with pytest.raises(SnapshotError, match="changed in place after save"):
            ckpt.wait()

        expected3 = _snapshot_and_save(ckpt, 3, model, optimizer)
        ckpt.wait()  # the cure: the copy is done before the other thread writes
        _in_another_thread(lambda: model[0].weight.data.mul_(2.0))
    assert ckpt.steps() == [1, 3]
    _assert_same(_loaded(root, 3), expected3)
    # the README's list of writes not seen names it, with the cure
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    said = readme[readme.index("Not seen at all:"):]
    assert "another thread's `p.data.mul_()`" in said and "plain or DTensor" in said and "call `ckpt.wait()` before such writes" in said


@pytest.mark.parametrize("shared", [False, True], ids=["thread", "process"])
def test_a_large_buffer_starts_at_a_page_and_its_record_data_at_a_page_of_the_file(tmp_path, shared):
    """A staged buffer over ``TEMPLATE_BYTES`` starts at a page of memory and its record's data at a
    page of the data file: the data file's writer then sends it to disk from the buffer (O_DIRECT
    where allowed) instead of copying it into its own (``LocalFile._from_source``)."""
    import json

    from ckpttool.formats.dcp.records import TEMPLATE_BYTES

    torch.manual_seed(0)
    state = {"small": torch.randn(3), "big": torch.randn(300, 1024), "odd": torch.randn(5),
             "big2": torch.randn(257, 1025, dtype=torch.float64), "tiny": torch.ones(2, dtype=torch.bfloat16)}
    stager = Stager(shared=shared)
    stager.stage(state, 0, None)
    large = {k for k, v in state.items() if v.numel() * v.element_size() > TEMPLATE_BYTES}
    assert large == {"big", "big2"}
    assert all(stager.buffers[k].data_ptr() % 4096 == 0 for k in large)
    model = torch.nn.Linear(1024, 300)  # its weight: 1.2 MB, one record over TEMPLATE_BYTES
    writer = "process" if shared else "thread"
    with Checkpointer(str(tmp_path / "run"), async_save=True, writer=writer) as ckpt:
        ckpt.save(1, model)
        ckpt.wait()
    (rows,) = json.loads((tmp_path / "run" / "step-1" / "__0.manifest").read_text())["records"].values()
    starts = [row[0] + row[3]["data"][0] for row in rows if len(row) > 3 and row[3]["data"][1] > TEMPLATE_BYTES]
    assert len(starts) == 1 and starts[0] % 4096 == 0, starts
    again = torch.nn.Linear(1024, 300)
    from ckpttool import load

    load(str(tmp_path / "run" / "step-1"), again)
    assert torch.equal(again.weight, model.weight) and torch.equal(again.bias, model.bias)
