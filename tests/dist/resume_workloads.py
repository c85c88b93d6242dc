"""A user's training script, as the README's users write it: FSDP2, dropout, AdamW + LambdaLR, a
stateful data loader and each rank's RNG state in ``extra``; run straight, or stopped after a save
and resumed in new processes (module level, so ranks can import it)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .workloads import full

STEPS = 6


class ShuffledLoader:
    """A data loader with state: each rank walks its own shuffled order of sample ids (drawn from
    a generator of its own), ``state_dict`` / ``load_state_dict`` as torchdata's StatefulDataLoader."""

    def __init__(self, rank: int, samples: int = 64):
        gen = torch.Generator().manual_seed(1000 + rank)
        self.order = torch.randperm(samples, generator=gen).tolist()
        self.pos = 0
        self.epoch = 0

    def next(self) -> int:
        if self.pos == len(self.order):
            self.pos, self.epoch = 0, self.epoch + 1
        sample = self.order[self.pos]
        self.pos += 1
        return sample

    def state_dict(self) -> dict:
        return {"order": list(self.order), "pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.order, self.pos, self.epoch = list(state["order"]), state["pos"], state["epoch"]


def _setup():
    from torch.distributed.device_mesh import init_device_mesh

    from ckpttool.training.trainer.model import PRESETS, build_fsdp_model

    import dataclasses

    rank = dist.get_rank()
    torch.manual_seed(77 + rank)  # dropout masks: each rank its own generator
    config = dataclasses.replace(PRESETS["tiny"], dropout=0.2)
    model = build_fsdp_model(config, init_device_mesh("cpu", (dist.get_world_size(),)), seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))  # a lambda, as users write it
    return model, optimizer, sched, ShuffledLoader(rank)


def _train_step(model, optimizer, sched, loader) -> tuple[float, float]:
    from ckpttool.training.trainer.model import PRESETS, synthetic_batch

    x, y = synthetic_batch(loader.next(), 4, PRESETS["tiny"], 0)
    lr = optimizer.param_groups[0]["lr"]
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    sched.step()
    optimizer.zero_grad()
    return loss.item(), lr


def _final(model, optimizer) -> dict:
    out = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    for i, st in enumerate(optimizer.state.values()):
        out.update({f"optim.{i}.{k}": full(v) for k, v in st.items()})
    return out


def straight() -> dict:
    model, optimizer, sched, loader = _setup()
    steps = [_train_step(model, optimizer, sched, loader) for _ in range(STEPS)]
    return {"steps": steps, "final": _final(model, optimizer)}


def first_part(root: str, async_save: bool) -> dict:
    """Train 3 steps, save step 3 (async: and at once go on training, as a job that is then
    stopped would), stop."""
    from ckpttool import Checkpointer

    model, optimizer, sched, loader = _setup()
    steps = [_train_step(model, optimizer, sched, loader) for _ in range(3)]
    with Checkpointer(root, async_save=async_save) as ckpt:
        ckpt.save(3, model, optimizer, extra={"rng": torch.get_rng_state(), "sched": sched, "loader": loader})
        _train_step(model, optimizer, sched, loader)  # beyond the step: the save holds step 3 whatever comes next
    return {"steps": steps}


def resumed(root: str) -> dict:
    """A new process: build everything afresh, load the newest step, restore the scheduler and the
    loader in place and this rank's RNG state, and train to the end."""
    from ckpttool import Checkpointer

    model, optimizer, sched, loader = _setup()
    with Checkpointer(root) as ckpt:
        res = ckpt.load(model, optimizer, extra={"sched": sched, "loader": loader})
    torch.set_rng_state(res.extra["rng"])
    steps = [_train_step(model, optimizer, sched, loader) for _ in range(res.step, STEPS)]
    return {"start": res.step, "steps": steps, "final": _final(model, optimizer)}


def per_rank_save(root: str) -> None:
    """Save values of extra that differ between ranks (an RNG state, a loader position), one that
    is the same on every rank, and a Stateful loader."""
    from ckpttool import Checkpointer

    from .workloads import fresh_model

    model, optimizer = fresh_model(seed=0)
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    with Checkpointer(root, async_save=True) as ckpt:
        ckpt.save(1, model, optimizer, extra={"rng": torch.get_rng_state(), "loader": {"pos": 10 * rank, "epoch": 2},
                                              "same": 5, "data": ShuffledLoader(rank)})


def per_rank_load(root: str) -> dict:
    """Load on this world size: this rank's values, the warning said (if any) and every saved rank's values."""
    from ckpttool import Checkpointer

    from .workloads import fresh_model, keep_warnings

    records, handler = keep_warnings()
    try:
        model, optimizer = fresh_model(seed=3)
        loader = ShuffledLoader(99)
        res = Checkpointer(root).load(model, optimizer, extra={"data": loader})
    finally:
        logging.getLogger("ckpttool").removeHandler(handler)
    return {"extra": res.extra, "by_rank": res.extra_by_rank, "warnings": records, "loader": loader.state_dict()}


def plain_dcp_load_extra(path: str) -> dict:
    """Plain torch.distributed.checkpoint.load of a step with per-rank values: the model and rank
    0's values of extra, as before."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .workloads import fresh_model

    model, optimizer = fresh_model(seed=3)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "extra": {"rng": torch.zeros_like(torch.get_rng_state()),
                                                    "loader": {"pos": -1, "epoch": -1}, "same": -1}}
    dcp.load(state, checkpoint_id=path)
    return {"extra": state["extra"]}


def fallback_save_and_load(root: str) -> dict:
    """A placement ckpttool's own writer does not lay out (a strided shard, as FSDP2 + TP makes)
    sends an async save through DCP's writer: per-rank values and NaN counts must hold there too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckpttool import Checkpointer

    from .workloads import fresh_model

    rank = dist.get_rank()
    model, optimizer = fresh_model(seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # (split factor 1 lays out as Shard(0) for DCP; ckpttool's own writer takes Shard and Replicate only)
    strided = DTensor.from_local(torch.arange(4.0) + 4 * rank, mesh, [_StridedShard(0, split_factor=1)])
    if rank == 1:
        with torch.no_grad():
            model.norm.weight.to_local()[0] = float("nan")
    with Checkpointer(root, async_save=True) as ckpt:
        ckpt.save(1, model, optimizer, extra={"z": strided, "mine": torch.full((3,), float(rank)), "same": 1,
                                                     "loss": float("inf")})
    fresh, fopt = fresh_model(seed=3)
    res = Checkpointer(root).load(fresh, fopt)
    return {"extra": res.extra}


def _side(rank: int) -> tuple[torch.optim.Optimizer, object]:
    """A second model's optimizer (SGD with momentum: state keyed by int) and its LR scheduler,
    stepped so that their state is this rank's own."""
    torch.manual_seed(50 + rank)
    side = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(side.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(rank + 1):
        side(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    return opt, sched


def extra_kinds(rank: int) -> dict:
    """Values of extra whose kind, length or key types differ between ranks."""
    opt, sched = _side(rank)
    return {"mixed": torch.arange(3.0) if rank == 0 else f"rank {rank}'s note",  # a tensor on one rank, a str on another
            "lst": [torch.full((2,), float(i + rank)) for i in range(rank + 2)],  # one more entry on rank 1
            "ints": {1: "a", 2: torch.tensor([rank])},  # int keys
            "opt": opt, "sched": sched, "same": {"k": 1}}


def extra_kinds_save_and_load(root: str, async_save: bool) -> dict:
    """Save extra_kinds on every rank, then load into fresh objects: what each rank got back."""
    from ckpttool import Checkpointer

    from .workloads import fresh_model

    rank = dist.get_rank()
    model, optimizer = fresh_model(seed=0)
    saved = extra_kinds(rank)
    with Checkpointer(root, async_save=async_save) as ckpt:
        ckpt.save(1, model, optimizer, extra=saved)
    fresh, fopt = fresh_model(seed=3)
    opt, sched = _side(7)
    res = Checkpointer(root).load(fresh, fopt, extra={"opt": opt, "sched": sched})
    return {"extra": {k: v for k, v in res.extra.items() if k not in ("opt", "sched")},
            "opt": opt.state_dict(), "sched": sched.state_dict(),
            "want": {**{k: v for k, v in saved.items() if k not in ("opt", "sched")},
                     "opt_state": saved["opt"].state_dict(), "sched_state": saved["sched"].state_dict()}}


class NormNet(torch.nn.Module):
    """A BatchNorm1d between two layers, no SyncBatchNorm: each rank's running statistics are its own."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


def _norm_net(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = NormNet()
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def own_buffers_save(root: str, async_save: bool, through_dcp: bool = False) -> dict:
    """Train on each rank's own data (its running statistics drift apart), save step 1; every
    rank's buffers and weights as saved. ``through_dcp``: with a strided-shard DTensor in ``extra``,
    which sends the save through DCP's own writer."""
    from ckpttool import Checkpointer

    extra = None
    if through_dcp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        extra = {"z": DTensor.from_local(torch.arange(4.0), mesh, [_StridedShard(0, split_factor=1)])}
    model, optimizer = _norm_net(0)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(2):
        model(torch.randn(8, 4, generator=gen) * (1 + dist.get_rank())).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    if dist.get_rank() == 1:
        model.norm.running_var[0] = float("nan")  # (a rank's own value is counted where the step keeps it)
    with Checkpointer(root, async_save=async_save) as ckpt:
        ckpt.save(1, model, optimizer, extra=extra)
    return {"buffers": {n: b.clone() for n, b in model.named_buffers()}, "weights": {n: full(p) for n, p in model.named_parameters()}}


def own_buffers_load(root: str) -> dict:
    """Load the newest step on this world size: this rank's buffers and weights, what was warned,
    and whether verify_loaded agrees."""
    import ckpttool
    from ckpttool import Checkpointer

    from .workloads import keep_warnings

    records, handler = keep_warnings()
    try:
        model, optimizer = _norm_net(5)
        Checkpointer(root).load(model, optimizer)
        report = ckpttool.verify_loaded(model, optimizer, f"{root}/step-1")
    finally:
        logging.getLogger("ckpttool").removeHandler(handler)
    return {"buffers": {n: b.clone() for n, b in model.named_buffers()}, "weights": {n: full(p) for n, p in model.named_parameters()},
            "warnings": records, "verified": report.ok}
