"""Per-rank folders whose optimizer numbers its parameters group by group (layer-wise LR decay, a
weight-decay split, named parameters), written with the FSDP2 guide's code, and loaded back with
ckpttool (module level, so ranks can import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .workloads import full


class Blocks(torch.nn.Module):
    """Three identical blocks: every parameter shape repeats, so shapes cannot tell them apart."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def build(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = Blocks()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            full_value = torch.randn(p.shape, generator=gen)
            rows = p.shape[0]
            per = -(-rows // dist.get_world_size())
            start = min(rows, per * dist.get_rank())
            local.copy_(full_value[start:start + local.shape[0]])
    return model


def optimizer_for(model: torch.nn.Module, layout: str) -> torch.optim.Optimizer:
    blocks = list(model.blocks)
    if layout == "single":
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    if layout == "shuffled":  # one group, in another order than model.parameters(), no names: shapes all alike
        return torch.optim.AdamW([p for i in (2, 0, 1) for p in blocks[i].parameters()], lr=0.01)
    if layout == "reversed":  # layer-wise LR decay, last layer first
        return torch.optim.AdamW([{"params": list(b.parameters()), "lr": 0.01 * 0.5 ** i} for i, b in enumerate(reversed(blocks))])
    if layout == "decay":  # the most common split: weights decay, biases do not
        weights = [b.weight for b in blocks]
        biases = [b.bias for b in blocks]
        return torch.optim.AdamW([{"params": biases, "weight_decay": 0.0}, {"params": weights, "weight_decay": 0.1}], lr=0.01)
    if layout == "frozen":  # a frozen block: the optimizer holds 4 of the 6 parameters
        for p in blocks[1].parameters():
            p.requires_grad_(False)
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    if layout == "named":  # built from named_parameters: torch records each group's names
        named = dict(model.named_parameters())
        order = [n for n in reversed(list(named))]
        return torch.optim.AdamW([{"params": [(n, named[n]) for n in order[:3]]}, {"params": [(n, named[n]) for n in order[3:]],
                                                                                   "lr": 0.02}], lr=0.01)
    raise ValueError(layout)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """Every parameter's optimizer state in full, by parameter name, and each group's settings by
    the names it holds (a collective: the same on every rank)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, object] = {}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}.{k}"] = full(v)
    for group in optimizer.param_groups:
        key = ",".join(names[id(p)] for p in group["params"])
        out[f"group[{key}]"] = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    return out


def save_folder(path: str, layout: str) -> dict[str, object]:
    """Train 2 steps and save with the guide's manual sharded checkpointing; returns the state."""
    import os

    model = build(seed=0)
    optimizer = optimizer_for(model, layout)
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    rank = dist.get_rank()
    os.makedirs(path, exist_ok=True)
    torch.save(model.state_dict(), f"{path}/model_rank_{rank}.pt")
    torch.save(optimizer.state_dict(), f"{path}/optim_rank_{rank}.pt")
    dist.barrier()
    return {"optim": optimizer_state(model, optimizer), "model": {k: full(v) for k, v in model.state_dict().items()}}


def load_folder(path: str, layout: str) -> dict[str, object]:
    """A fresh model and optimizer with the same groups, loaded with ckpttool.load (any world size)."""
    import ckpttool

    model = build(seed=1)
    optimizer = optimizer_for(model, layout)
    for step in range(1):  # every state exists, with other values
        model(torch.randn(4, 6)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    ckpttool.load(path, model, optimizer)
    return {"optim": optimizer_state(model, optimizer), "model": {k: full(v) for k, v in model.state_dict().items()}}


def load_with_other_groups(path: str, layout: str) -> str:
    """Load with an optimizer built otherwise than the saving job's: the error, on every rank."""
    import ckpttool
    from ckpttool.errors import CkptError

    model = build(seed=1)
    optimizer = optimizer_for(model, layout)
    try:
        ckpttool.load(path, model, optimizer)
    except (CkptError, RuntimeError) as exc:
        return str(exc)
    return "loaded"


def folder_with_rank_values(path: str, case: str) -> None:
    """A per-rank folder, the guide's way, whose values differ between ranks as ``case`` says:
    ``buffer`` (a plain tensor of the model), ``replica`` (a Replicate DTensor), ``rng`` (a per-rank
    group of RNG states: expected), ``mixed`` (rank 1's files from a run with one step more)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    rank = dist.get_rank()
    if case == "mixed":  # two runs, one step apart; the test puts rank 0 of one beside rank 1 of the other
        folder_with_rank_values(path, "plain")
        folder_with_rank_values(path + "-longer", "longer")
        return
    model = build(seed=0)
    optimizer = optimizer_for(model, "single")
    for step in range(3 if case == "longer" else 2):
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    if case == "buffer":
        state["counts"] = torch.arange(3.0) + rank  # a buffer each rank updated alone
    if case == "replica":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state["scale"] = DTensor.from_local(torch.ones(3) * (1.0 if rank == 0 else 1.5), mesh, [Replicate()], run_check=False)
    os.makedirs(path, exist_ok=True)
    torch.save(state, f"{path}/model_rank_{rank}.pt")
    torch.save(optimizer.state_dict(), f"{path}/optim_rank_{rank}.pt")
    if case == "rng":
        torch.manual_seed(100 + rank)
        torch.save({"cpu": torch.get_rng_state(), "epoch": 3}, f"{path}/rng_rank_{rank}.pt")
    dist.barrier()
