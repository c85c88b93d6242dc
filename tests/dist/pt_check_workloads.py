"""Rank functions for loading one torch.save file onto several ranks with its CRC-32s checked
together (tests/dist/test_pt_checks.py): a plain module sharded with fully_shard."""

from __future__ import annotations

from typing import Any

ROWS, COLS = 512, 1024  # 2 MiB of fp32: one rank's rows are 1 MiB, far above what the rest of a load reads


def model_and_state():
    import torch

    torch.manual_seed(0)
    weight = torch.randn(ROWS + 64, COLS)
    # "weight" views the first ROWS rows of a larger storage: torch.save writes the whole storage, and
    # the 64 rows after the view are bytes of its record no rank reads for the model
    return {"weight": weight[:ROWS], "bias": torch.randn(COLS)}


def sharded():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = torch.nn.Module()
        model.weight = torch.nn.Parameter(torch.empty(ROWS, COLS))
        model.bias = torch.nn.Parameter(torch.empty(COLS))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model.to_empty(device="cpu")
    return model


def rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def load_pt(path: str, verify: bool = True) -> dict[str, Any]:
    """Load ``path`` into the sharded module: the full state it holds (rank 0), the bytes this rank
    read during the load and its shard's bytes, or the error it raised."""
    import torch.distributed as dist

    import ckpttool
    from ckpttool.errors import CkptError
    from tests.dist.pretrained_workloads import full_state

    model = sharded()
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    ckpttool.load(path, model, verify=False)  # imports done (a module's first import reads its files)
    before = rchar()
    try:
        ckpttool.load(path, model, verify=verify)
    except CkptError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "read": rchar() - before, "shard": shard}
    read = rchar() - before
    state = full_state(model)
    return {"state": state if dist.get_rank() == 0 else None, "read": read, "shard": shard, "error": None}
