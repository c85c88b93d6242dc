"""Async-save staging: host buffers reused from save to save, a snapshot that training cannot
change, and on CUDA no second copy of the state on the device."""

from __future__ import annotations

import pytest
import torch

from ckpttool import Checkpointer


def _model(device: str = "cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer


def _step(model, optimizer, device: str = "cpu") -> None:
    model(torch.randn(16, 64, device=device)).square().mean().backward()
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


def test_host_buffers_are_reused_and_the_snapshot_is_exact_when_training_goes_on_at_once(tmp_path):
    root = str(tmp_path / "run")
    model, optimizer = _model()
    _step(model, optimizer)
    with Checkpointer(root, async_save=True) as ckpt:
        expected1 = _snapshot(model, optimizer)
        ckpt.save(1, model, optimizer)
        first = {k: b.data_ptr() for k, b in ckpt._stager.buffers.items()}
        _step(model, optimizer)  # at once: forward (BatchNorm statistics), backward, step
        _step(model, optimizer)
        expected2 = _snapshot(model, optimizer)
        ckpt.save(2, model, optimizer)
        second = {k: b.data_ptr() for k, b in ckpt._stager.buffers.items()}
        _step(model, optimizer)
    assert first == second and len(first) >= 8  # the same host memory, every tensor
    _assert_same(_loaded(root, 1), expected1)
    _assert_same(_loaded(root, 2), expected2)
    assert not torch.equal(expected1["model.0.weight"], expected2["model.0.weight"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_is_pinned_host_memory_never_a_second_device_copy(tmp_path):
    root = str(tmp_path / "run")
    model, optimizer = _model("cuda")
    _step(model, optimizer, "cuda")
    state_bytes = sum(t.numel() * t.element_size() for t in _snapshot(model, optimizer).values())
    with Checkpointer(root, async_save=True) as ckpt:
        expected = _snapshot(model, optimizer)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        ckpt.save(1, model, optimizer)
        during = torch.cuda.memory_allocated()
        assert during - before < state_bytes // 2  # no copy of the state on the device
        assert all(b.is_pinned() and b.device.type == "cpu" for b in ckpt._stager.buffers.values())
        _step(model, optimizer, "cuda")  # the pre-step fence orders the step after the copies
    _assert_same(_loaded(root, 1, "cuda"), expected)


def test_the_background_copy_is_fenced_before_the_next_optimizer_step(tmp_path, monkeypatch):
    """save() returns while the CPU copy is still running (slowed down here by 0.5 s), and the
    optimizer's next step waits for it: the step saved is the state at the call, bit for bit."""
    monkeypatch.setenv("CKPTTOOL_DELAY_AT", "stage-copy:0.5")
    root = str(tmp_path / "run")
    model, optimizer = _model()
    _step(model, optimizer)
    with Checkpointer(root, async_save=True) as ckpt:
        expected = _snapshot(model, optimizer)
        ckpt.save(1, model, optimizer)
        copier = ckpt._stager._copier
        assert copier is not None and copier.is_alive()  # save() did not wait for the copy
        _step(model, optimizer)  # at once: the step must wait for the copy
        assert not copier.is_alive()
    _assert_same(_loaded(root, 1), expected)


def test_a_failed_background_copy_fails_its_own_save_only():
    """The writer of the save whose copy failed raises the error (wait()); a later save that copies
    at the call does not raise it again."""
    from ckpttool.staging import Stager

    def broken():
        raise RuntimeError("copy failed")

    stager = Stager(before_copy=broken)
    state = {"w": torch.arange(4.0)}
    staged = stager.stage(state, 0, None, background=True)
    with pytest.raises(RuntimeError, match="copy failed"):
        stager.wait()
    staged = stager.stage(state, 0, None)  # no fence to rely on: copied at the call
    stager.wait()
    assert torch.equal(staged["w"].local, state["w"])
