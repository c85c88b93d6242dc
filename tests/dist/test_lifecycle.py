"""A run that ends, crashes or forgets to close never loses a step and never aborts:

- the README's Library example, run under torchrun verbatim, and run without its ``with`` (no
  ``close()``, ``destroy_process_group()`` while the last async save is still writing): exit 0,
  the last step committed and bitwise what was saved;
- kill -9 of every rank at random moments of sync and async saves, then a resume: the newest
  committed step always loads bitwise equal to what was saved at that step; nothing half-written
  is ever visible;
- the trainer's resume path run repeatedly beside a busy loop exits 0 every time.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ckpttool import Checkpointer

from .harness import spawn_ranks, wait_then_kill
from .workloads import assert_same

REPO = Path(__file__).resolve().parents[2]

RUNNER = """
import os, sys, torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from ckpttool.training.trainer.model import PRESETS, build_fsdp_model

dist.init_process_group("gloo")
model = build_fsdp_model(PRESETS["tiny"], init_device_mesh("cpu", (dist.get_world_size(),)), seed=3)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
total = int(os.environ["TOTAL"])
os.chdir(os.environ["WORKDIR"])
# ---- the README's example, as the README shows it ----
{example}
# ----
# each rank's own shards, with no collective: a full-state gather here (functional all-gathers)
# right before exit made torch 2.13's gloo abort the process ("terminate called without an
# active exception") in about 1 run of 10, with or without ckpttool in the script
torch.save({{k: v.to_local() for k, v in model.state_dict().items()}}, f"expected.{{dist.get_rank()}}.pt")
dist.destroy_process_group()
"""


def readme_example() -> str:
    """The first python block of the README's Library section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Library", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def without_with(example: str) -> str:
    """The same example as a user who does not use ``with`` writes it: no close() anywhere."""
    lines = example.splitlines()
    out = []
    inside = False
    for line in lines:
        m = re.match(r"with (Checkpointer\(.*\)) as (\w+):(.*)$", line)
        if m:
            out.append(f"{m.group(2)} = {m.group(1)}{m.group(3)}")
            inside = True
        elif inside and line.startswith("    "):
            out.append(line[4:])
        else:
            out.append(line)
    return "\n".join(out)


def run_example(tmp_path: Path, example: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(RUNNER.format(example=textwrap.dedent(example)))
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        cwd=tmp_path, env={**os.environ, "TOTAL": "3", "WORKDIR": str(tmp_path), "OMP_NUM_THREADS": "1", **env},
        capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize("form", ["with", pytest.param("no close, group destroyed mid-save", marks=pytest.mark.slow)])
def test_the_readme_example_commits_its_last_step(tmp_path, form):
    example = readme_example()
    assert "with Checkpointer(" in example and "async_save=True" in example and "close()" not in example
    env = {}
    if form != "with":
        example = without_with(example)
        assert "with " not in example
        env = {"CKPTTOOL_DELAY_AT": "after-write:3"}  # the last save is still writing when the script ends
    proc = run_example(tmp_path, example, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "terminate called" not in proc.stderr
    root = tmp_path / "runs" / "exp1"
    ckpt = Checkpointer(root)
    assert ckpt.steps() == [1, 2, 3] and ckpt.incomplete() == []
    shards = [torch.load(tmp_path / f"expected.{r}.pt", weights_only=True) for r in range(2)]
    expected = {k: torch.cat([s[k] for s in shards]) for k in shards[0]}  # FSDP2's Shard(0) on 2 ranks
    from ckpttool.training.trainer.model import PRESETS, build_model

    model = build_model(PRESETS["tiny"], seed=11)
    assert ckpt.load(model).step == 3
    assert_same({k: v for k, v in model.state_dict().items()}, expected, "the README's last step")


# --- kill -9 at random moments -------------------------------------------------------------------


def save_forever(root: str, expect_dir: str, async_save: bool) -> None:
    """Train and save every step, recording this rank's shards first (what the step will hold) so
    the test can check what survives a kill."""
    from torch.distributed.tensor import DTensor

    import torch.distributed as dist

    from .workloads import _train_steps, fresh_model

    model, optimizer = fresh_model(seed=0)
    ckpt = Checkpointer(root, async_save=async_save, keep_last=3)
    res = ckpt.load(model, optimizer)
    step = res.step if res else 0
    while True:
        _train_steps(model, optimizer, step, 1)
        step += 1
        # recorded before the save (what it will hold; for an async save, the snapshot) and
        # atomically: the kill may land at any moment, and step N may commit only once its record exists
        shards = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}
        record = os.path.join(expect_dir, f"step-{step}-rank-{dist.get_rank()}.pt")
        torch.save(shards, record + ".tmp")
        os.replace(record + ".tmp", record)
        ckpt.save(step, model, optimizer, extra={"step": step})


def load_shards(root: str) -> dict[str, object]:
    from torch.distributed.tensor import DTensor

    from .workloads import fresh_model

    model, optimizer = fresh_model(seed=999)
    res = Checkpointer(root).load(model, optimizer)
    return {"step": res.step, "shards": {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
                                         for k, v in model.state_dict().items()}}


def soak(tmp_path: Path, kills: int, seed: int) -> list[tuple[str, float, int]]:
    """``kills`` rounds of: start 2 ranks saving every step (sync and async alternating), kill -9
    both at a random moment, check the newest committed step. Returns (mode, kill time, step)."""
    from .harness import run_ranks

    rnd = random.Random(seed)
    root = str(tmp_path / "run")
    expect = tmp_path / "expect"
    expect.mkdir()
    log = []
    for round_ in range(kills):
        async_save = round_ % 2 == 1
        before = (Checkpointer(root).steps() or [0])[-1] if os.path.isdir(root) else 0
        with tempfile.TemporaryDirectory() as rdzv:
            procs, out = spawn_ranks(save_forever, 2, rdzv, root, str(expect), async_save)
            at = rnd.uniform(4.0, 12.0)
            deadline = time.monotonic() + at

            def ready() -> bool:  # the random moment, and at least one new step committed (a slow machine)
                return time.monotonic() >= deadline and (Checkpointer(root).steps() or [0])[-1] > before

            wait_then_kill(procs, ready, timeout=at + 120, out=out)
        ckpt = Checkpointer(root)
        steps = ckpt.steps()
        assert steps, f"round {round_}: nothing committed"
        assert all(not n.startswith("step-") or int(n.split("-")[1]) > steps[-1] for n in ckpt.incomplete())
        results = run_ranks(load_shards, 2, root)
        for rank, r in enumerate(results):
            assert r["step"] == steps[-1]
            recorded = torch.load(expect / f"step-{r['step']}-rank-{rank}.pt", weights_only=True)
            assert_same(r["shards"], recorded, f"round {round_} rank {rank} step {r['step']}")
        log.append(("async" if async_save else "sync", round(at, 2), steps[-1]))
    return log


@pytest.mark.slow
def test_kill_9_at_random_moments_never_loses_a_committed_step(tmp_path):
    log = soak(tmp_path, kills=2, seed=1)
    assert [mode for mode, _, _ in log] == ["sync", "async"]


@pytest.mark.slow
def test_soak_many_kills(tmp_path):
    log = soak(tmp_path, kills=int(os.environ.get("SOAK_KILLS", "12")), seed=int(os.environ.get("SOAK_SEED", "7")))
    print("soak:", log)


# --- the trainer's resume path under load ----------------------------------------------------------


def resume_runs_under_load(tmp_path: Path, runs: int) -> list[int]:
    base = tmp_path / "base"
    cli = [sys.executable, "-m", "ckpttool.cli", "train", "--nproc", "2", "--save-every", "2"]
    first = subprocess.run([*cli, "--steps", "4", "--ckpt-dir", str(base)], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    # the run says where it started and each step it committed
    assert f"no committed step under {base}: starting at step 0" in first.stdout, first.stdout
    assert f"committed step 2: {base}/step-2" in first.stdout and f"committed step 4: {base}/step-4" in first.stdout
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    codes = []
    try:
        for i in range(runs):
            root = tmp_path / f"r{i}"
            subprocess.run(["cp", "-r", str(base), str(root)], check=True)
            proc = subprocess.run([*cli, "--steps", "6", "--ckpt-dir", str(root)], capture_output=True, text=True, timeout=300)
            assert "terminate called" not in proc.stderr, proc.stderr
            assert proc.returncode == 0, proc.stderr
            assert f"resumed from step 4: {root}/step-4" in proc.stdout and f"committed step 6: {root}/step-6" in proc.stdout
            assert Checkpointer(root).steps()[-1] == 6
            codes.append(proc.returncode)
    finally:
        busy.kill()
        busy.wait()
    return codes


def test_trainer_resume_under_load_exits_0(tmp_path):
    assert resume_runs_under_load(tmp_path, runs=2) == [0, 0]


@pytest.mark.slow
def test_trainer_resume_under_load_20_times(tmp_path):
    assert resume_runs_under_load(tmp_path, runs=20) == [0] * 20
