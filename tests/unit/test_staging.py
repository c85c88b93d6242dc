"""Async-save staging: host buffers reused from save to save, a snapshot that training cannot
change, and on CUDA no second copy of the state on the device."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from ckpttool import Checkpointer, dist
from ckpttool.staging import Stager


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
def _async_run(tmp_path, device: str = "cpu"):
    """A model stepped once and an async Checkpointer on tmp_path/run: (root, model, optimizer, ckpt)."""
    root = str(tmp_path / "run")
    model, optimizer = _model(device)
    _step(model, optimizer, device)
    with Checkpointer(root, async_save=True) as ckpt:
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


def test_host_buffers_are_reused_and_the_snapshot_is_exact_when_training_goes_on_at_once(tmp_path):
    with _async_run(tmp_path) as (root, model, optimizer, ckpt):
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


def test_the_background_copy_is_fenced_before_the_next_optimizer_step(tmp_path, held_copy, monkeypatch):
    """save() returns while the CPU copy is held back, and the optimizer's next step waits for it
    (the fence releases the hold, standing in for a slow copy): the step saved is the state at the
    call, bit for bit."""
    real_fence = Stager.fence

    def fence(self):
        if self.copying:
            held_copy.set()  # only a fence with a copy in flight gets here: the step's pre-hook
        real_fence(self)

    monkeypatch.setattr(Stager, "fence", fence)
    with _async_run(tmp_path) as (root, model, optimizer, ckpt):
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


@pytest.fixture
def one_rank_mesh(tmp_path):
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    tdist.init_process_group("gloo", store=tdist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        tdist.destroy_process_group()


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
