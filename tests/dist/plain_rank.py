"""One rank of a job started as a plain process, as a cluster's own launcher would start it (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the job's store): nothing kills the survivors
when a rank dies. ``python tests/dist/plain_rank.py SCENARIO ROOT OUT`` runs one scenario of
:mod:`tests.dist.test_dead_ranks` and writes what this rank saw to ``OUT.<rank>.json``.

The scenario's settings come from the environment: CKPTTOOL_TEST_MODE (sync/async),
CKPTTOOL_TEST_VICTIM (the rank the test kills), CKPTTOOL_TEST_POINT (where it stops), CKPTTOOL_TEST_SIZE,
CKPTTOOL_TEST_DEAD_AFTER (None: the Checkpointer's default).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def killed_mid_save(root: str, out: str) -> dict:
    """Save step 2 whole, then step 4, in which the victim stops at the pause point and is killed;
    every live rank reports what its save / wait / close raised, and when."""
    import torch.distributed as dist

    from ckpttool import Checkpointer
    from tests.dist.workloads import _train_steps, fresh_model

    rank = dist.get_rank()
    mode, victim = os.environ["CKPTTOOL_TEST_MODE"], int(os.environ["CKPTTOOL_TEST_VICTIM"])
    dead_after = os.environ.get("CKPTTOOL_TEST_DEAD_AFTER")
    options = {"dead_after": float(dead_after)} if dead_after else {}
    model, optimizer = fresh_model(seed=0, model_size=os.environ.get("CKPTTOOL_TEST_SIZE", "tiny"))
    ckpt = Checkpointer(root, async_save=mode == "async", **options)
    _train_steps(model, optimizer, 0, 2)
    ckpt.save(2, model, optimizer, extra={"step": 2})
    ckpt.wait()
    dist.barrier()
    _train_steps(model, optimizer, 2, 2)
    if rank == victim:
        os.environ["CKPTTOOL_PAUSE_AT"] = os.environ["CKPTTOOL_TEST_POINT"]
    seen: dict = {"rank": rank}
    try:
        ckpt.save(4, model, optimizer, extra={"step": 4})
        seen["saved"] = time.time()
        ckpt.wait()
        seen["outcome"] = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        seen.update(outcome=type(exc).__name__, message=str(exc), at=time.time(), ranks=getattr(exc, "ranks", None))
    try:
        ckpt.close()
    except Exception as exc:  # noqa: BLE001
        seen["close"] = f"{type(exc).__name__}: {exc}"
    seen["closed"] = time.time()
    return seen


def main() -> None:
    scenario, root, out = sys.argv[1:4]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    seen = globals()[scenario](root, out)
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(seen, f)
    # the process exits as a training script does, its process group still up: the test times it


if __name__ == "__main__":
    main()
