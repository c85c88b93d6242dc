"""The FSDP2 training loop behind ``torchrun -m ckpttool.training.trainer.train``: train, save, resume.

    torchrun --nproc_per_node 2 -m ckpttool.training.trainer.train --steps 6 --ckpt-dir runs/a --save-every 3

A run that stops after step N and resumes from ``step-N`` on the same world size ends bitwise equal
to one that never stopped: the data of a step depends only on (seed, step), the model and AdamW
state come back from the checkpoint, and so do the learning-rate schedule (``--warmup``, a
LambdaLR saved through its state dict) and each rank's own generator state (``--dropout`` masks),
saved per rank. On another world size every rank's generator is seeded afresh from (seed, step,
rank): the dropout masks differ from those of an uninterrupted run, everything else is restored.
Rank 0 prints ``step {step} loss {loss:.6f}`` per step, where ``step`` counts from 0 and the loss is
the global mean, the same on every world size up to float reduction order.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import UsageError
from .args import check_args, make_parser
from .model import PRESETS, Transformer, build_fsdp_model, derive_seed, local_batch


@dataclass
class TrainRun:
    """What :func:`run_training` leaves behind: the live model and optimizer, for tests to inspect."""

    losses: list[float]
    start_step: int
    model: Transformer
    optimizer: torch.optim.Optimizer
    lrs: list[float]  # the learning rate each step ran with


def _check_resumed_extra(extra: dict, args: argparse.Namespace, path: str) -> None:
    """A resumed run must see the data the first run would have seen, so these flags must match."""
    for key, flag in (("seed", "--seed"), ("batch_size", "--batch-size"), ("model_size", "--model-size")):
        saved = extra.get(key)
        current = getattr(args, key)
        if saved is not None and saved != current:
            raise UsageError(
                f"{flag} {current} differs from the checkpoint's {saved}",
                where=path,
                hint=f"pass {flag} {saved} to resume it, or --no-resume with a new --ckpt-dir",
            )


def run_training(args: argparse.Namespace) -> TrainRun:
    """Train on the current process group (one must be initialised); returns this invocation's state.

    Raises :class:`UsageError` for bad flags or a checkpoint made with a different seed or batch
    size, and whatever the Checkpointer raises for storage or checkpoint problems.
    """
    if not dist.is_initialized():
        raise UsageError(
            "run_training needs an initialised process group",
            hint="launch with torchrun, or call main(), which creates one",
        )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_args(args, world_size)
    config = dataclasses.replace(PRESETS[args.model_size], dropout=args.dropout)
    # each rank's dropout masks come from its own generator, seeded from (seed, rank), saved per rank
    torch.manual_seed(derive_seed(args.seed, f"rank/{rank}"))
    model, optimizer, scheduler = _build(args, config, world_size)
    device = next(model.parameters()).device

    ckpt = _checkpointer(args)
    start = _resume(ckpt, model, optimizer, scheduler, args, rank) if ckpt is not None and args.resume else 0

    criterion = nn.CrossEntropyLoss()
    losses: list[float] = []
    lrs: list[float] = []
    for step in range(start, args.steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        x, y = local_batch(step, rank, world_size, args.batch_size, config, args.seed)
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = criterion(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        # Equal local batches, so the mean of local means is the global mean loss.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM)
        value = global_loss.item() / world_size
        losses.append(value)
        if rank == 0:
            print(f"step {step} loss {value:.6f}", flush=True)

        done = step + 1
        if ckpt is not None and args.save_every > 0 and (done % args.save_every == 0 or done == args.steps):
            extra = {"step": done, "seed": args.seed, "batch_size": args.batch_size, "model_size": args.model_size,
                     "rng": torch.get_rng_state(), **({"sched": scheduler} if scheduler is not None else {})}
            ckpt.save(done, model, optimizer, extra=extra)
    if ckpt is not None:
        ckpt.close()  # an async save still running finishes (or raises) here
    return TrainRun(losses=losses, start_step=start, model=model, optimizer=optimizer, lrs=lrs)


def _checkpointer(args: argparse.Namespace) -> Any:
    """The Checkpointer of ``--ckpt-dir`` (None without one), saying each commit on stdout."""
    if not args.ckpt_dir:
        return None
    from ..checkpointer import Checkpointer  # only needed when checkpointing

    return Checkpointer(args.ckpt_dir, keep_last=args.keep_last, keep_every=args.keep_every, async_save=args.async_save,
                        incremental=args.incremental, writer=args.writer,
                        on_commit=lambda step, url: print(f"committed step {step}: {url}", flush=True))


def _build(args: argparse.Namespace, config: Any, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The FSDP2 model on a 1-D mesh of every rank, its frozen parameters, the optimizer (built
    after sharding, over what trains) and the warmup schedule (None without --warmup)."""
    from torch.distributed.device_mesh import init_device_mesh

    # The mesh follows the process group's backend, so gloo ranks on a GPU machine stay on CPU.
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (world_size,))
    model = build_fsdp_model(config, mesh, args.seed, mixed_precision=args.mixed_precision)
    for prefix in args.freeze:  # a frozen base (fine-tuning): no gradient, no optimizer state
        matched = [p for name, p in model.named_parameters() if name.startswith(prefix)]
        if not matched:
            raise UsageError(f"--freeze {prefix}: no parameter name starts with it",
                             hint="names look like tok_embeddings.weight, layers.0.attention.wq.weight")
        for p in matched:
            p.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.1)
    # (none without --warmup: a scheduler adds ``initial_lr`` to the optimizer's groups, which a
    # checkpoint then holds and a plain optimizer loading it does not)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(args.warmup)) if args.warmup else None
    return model, optimizer, scheduler


def _resume(ckpt: Any, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, args: argparse.Namespace,
            rank: int) -> int:
    """Load the newest committed step (model, optimizer, schedule, this rank's generator), checked
    against the flags and with --verify-after-load against the files; returns the next step."""
    res = ckpt.load(model, optimizer)
    if rank == 0:
        print(f"resumed from step {res.step}: {res.path}" if res is not None
              else f"no committed step under {args.ckpt_dir}: starting at step 0", flush=True)
    if res is None:
        return 0
    _check_resumed_extra(res.extra, args, res.path)
    if scheduler is not None and "sched" in res.extra:
        scheduler.load_state_dict(res.extra["sched"])
    if "rng" in res.extra:
        torch.set_rng_state(res.extra["rng"])  # this rank's own, saved by this rank
    else:  # another world size (or a checkpoint without it): a fresh, deterministic generator
        torch.manual_seed(derive_seed(args.seed, f"rank/{rank}/step/{res.step}"))
    if args.verify_after_load:
        from ..loaded import verify_loaded

        report = verify_loaded(model, optimizer, res.path)
        if not report.ok:
            first = report.mismatches[0]
            raise UsageError(
                f"{len(report.mismatches)} shard(s) differ from the checkpoint after loading; "
                f"first: {first.key} on rank {first.rank} at {first.first_index}",
                where=res.path,
                hint="run `ckpttool verify` on the checkpoint",
            )
        if rank == 0:
            print(f"verified {report.tensors_checked} loaded shards against {res.path}", flush=True)
    return res.step  # res.step optimizer steps are done: the next loop index is res.step itself


def warmup(steps: int):
    """The learning-rate factor of a linear warmup over ``steps`` steps."""
    return _Warmup(steps)


class _Warmup:
    """A LambdaLR factor whose state (``steps``) the scheduler's state dict keeps."""

    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)


def train(args: argparse.Namespace) -> list[float]:
    """Run the loop on the current process group; returns the global losses of the steps run now."""
    return run_training(args).losses


def _init_process_group() -> bool:
    """Join torchrun's group (or make a 1-rank one outside torchrun); True if this call created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        # Plain `python -m ckpttool.training.trainer.train`: a world of one needs no rendezvous.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: parse flags, train, tear the group down; exits non-zero on any error."""
    args = make_parser().parse_args(argv)
    created = False
    rank = os.environ.get("RANK", "0")
    try:
        created = _init_process_group()
        rank = str(dist.get_rank())
        train(args)
    except Exception as exc:  # every rank reports its own failure, then torchrun sees the exit code
        print(f"[rank {rank}] ckpttool train failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if os.environ.get("CKPTTOOL_DEBUG"):
            traceback.print_exc()
        return 1
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """Leave without interpreter finalization, once everything is committed and flushed.

    gloo's worker threads release a collective's tensors after it completes; under CPU load that
    can lag behind the main thread. A tensor whose Python object died meanwhile needs the GIL to be
    freed, and once the interpreter is finalizing a thread asking for it is torn down inside a
    noexcept destructor: std::terminate, "terminate called without an active exception", exit
    code 1 from a run that succeeded. By now the trainer has closed its Checkpointer (every save
    committed, the lease released) and destroyed the process group, so nothing is left for
    finalization to do but that race.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
