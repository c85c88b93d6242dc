"""Save on W ranks, load on W' ranks, with the real trainer and real gloo processes."""

from __future__ import annotations

import pytest
import torch

from ckpttool import Checkpointer

from .harness import run_ranks
from .workloads import assert_same, initial_state, load_into_fresh, plain_dcp_load, train_run


@pytest.mark.parametrize("w_save", [1, 2, 3])
@pytest.mark.parametrize("w_load", [1, 2, 3])
def test_save_on_w_load_on_w_prime_bitwise(saved, w_save, w_load):
    root, trained = saved[w_save]
    loaded = run_ranks(load_into_fresh, w_load, root)
    for r in loaded:  # every rank agrees
        assert r["step"] == 3
        assert r["extra"]["step"] == 3 and r["extra"]["model_size"] == "tiny"
        assert_same(trained["state"], r["state"], f"saved on {w_save}, loaded on {w_load}")


def test_initial_weights_do_not_depend_on_world_size():
    # The trap: reset_parameters() after to_empty on a CPU mesh tiles one shard over all ranks.
    ref = run_ranks(initial_state, 1)[0]
    for w in (2, 3):
        for r in run_ranks(initial_state, w):
            assert_same(ref, r, f"init at world size {w}")
    # and the weights are not trivially equal: two different seeds differ
    other = run_ranks(initial_state, 1, seed=1)[0]
    assert not torch.equal(other["model.output.weight"], ref["model.output.weight"])


def test_older_step_loads_and_steps_listed(saved):
    root, _ = saved[2]
    assert Checkpointer(root).steps() == [2, 3]
    r = run_ranks(load_into_fresh, 2, root, 2)
    assert r[0]["step"] == 2 and r[0]["extra"]["step"] == 2


@pytest.mark.parametrize("w_load", [1, 3])
def test_plain_torch_dcp_load_reads_our_step(saved, w_load):
    root, trained = saved[2]
    r = run_ranks(plain_dcp_load, w_load, f"{root}/step-3")
    assert_same(trained["state"], r[0]["state"], "plain dcp.load")


def test_resume_is_as_if_never_interrupted(tmp_path):
    straight = run_ranks(train_run, 2, steps=6)[0]
    root = str(tmp_path / "ck")
    first = run_ranks(train_run, 2, steps=3, ckpt_dir=root, save_every=3)[0]
    second = run_ranks(train_run, 2, steps=6, ckpt_dir=root, save_every=3, verify_after_load=True)[0]
    assert second["start"] == 3
    assert first["losses"] + second["losses"] == straight["losses"]
    assert_same(straight["state"], second["state"], "6 straight vs 3 + resume 3")


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_trainer_resume_matches_straight_run(tmp_path, writer):
    straight = run_ranks(train_run, 2, steps=4)[0]
    root = str(tmp_path / "ck")
    run_ranks(train_run, 2, steps=2, ckpt_dir=root, save_every=1, async_save=True, keep_last=1, writer=writer)
    second = run_ranks(train_run, 2, steps=4, ckpt_dir=root, save_every=1, async_save=True, keep_last=2, keep_every=3,
                       writer=writer)[0]
    assert second["start"] == 2
    assert_same(straight["state"], second["state"], "async saves, resumed")
    assert Checkpointer(root).steps() == [3, 4]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_trainer_with_dropout_and_warmup_resumes_bitwise(tmp_path, async_save):
    """Dropout masks from each rank's own generator (saved per rank), a LambdaLR warmup (saved
    through its state dict): stopped at step 3 and resumed in new processes, the losses, learning
    rates and final weights are those of the run that never stopped."""
    opts = {"dropout": 0.1, "warmup": 4}
    straight = run_ranks(train_run, 2, steps=6, **opts)[0]
    root = str(tmp_path / "ck")
    first = run_ranks(train_run, 2, steps=3, ckpt_dir=root, save_every=3, async_save=async_save, **opts)[0]
    second = run_ranks(train_run, 2, steps=6, ckpt_dir=root, save_every=3, async_save=async_save, **opts)[0]
    assert second["start"] == 3
    assert first["losses"] + second["losses"] == straight["losses"]
    assert first["lrs"] + second["lrs"] == straight["lrs"] and len(set(straight["lrs"])) == 4  # it warmed up
    assert_same(straight["state"], second["state"], "dropout + warmup, resumed")
    assert straight["losses"] != run_ranks(train_run, 2, steps=6, warmup=4)[0]["losses"]  # dropout did something
