"""The FSDP2 training loop behind ``torchrun -m ckpttool.trainer.train``: train, save, resume.

    torchrun --nproc_per_node 2 -m ckpttool.trainer.train --steps 6 --ckpt-dir runs/a --save-every 3

A run that stops after step N and resumes from ``step-N`` ends bitwise equal to one that never
stopped: the data of a step depends only on (seed, step), the model and AdamW state come back from
the checkpoint, and there is no other random state (no dropout, constant learning rate).
Rank 0 prints ``step {step} loss {loss:.6f}`` per step, where ``step`` counts from 0 and the loss is
the global mean, the same on every world size up to float reduction order.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from .model import PRESETS, Transformer, build_fsdp_model, local_batch


def make_parser() -> argparse.ArgumentParser:
    """The trainer's flags; ``ckpttool train`` passes its own through to this list unchanged."""
    parser = argparse.ArgumentParser(
        prog="python -m ckpttool.trainer.train",
        description="Train a small GPT-like model with FSDP2, saving and resuming through ckpttool.Checkpointer.",
    )
    parser.add_argument("--steps", type=int, required=True, help="total optimizer steps of the run (resumed ones included)")
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint root (path or fsspec URL); no checkpoints without it")
    parser.add_argument(
        "--save-every", type=int, default=0, help="save every N steps and at the last step; 0 never saves (default)"
    )
    parser.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="continue from the newest committed step under --ckpt-dir (default: on)",
    )
    parser.add_argument("--model-size", choices=sorted(PRESETS), default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument(
        "--batch-size", type=int, default=12, help="global batch size, divisible by the world size (default: 12)"
    )
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 gradient reduction")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 turns clipping off (default: 1.0)")
    parser.add_argument("--keep-last", type=int, default=None, help="keep only the newest N committed steps")
    parser.add_argument("--keep-every", type=int, default=None, help="with --keep-last, also keep every step divisible by N")
    parser.add_argument(
        "--async-save", action="store_true", help="save in the background (a snapshot; training goes on while it writes)"
    )
    parser.add_argument(
        "--verify-after-load",
        action="store_true",
        help="after resuming, check every rank's shards against the checkpoint's bytes (no all-gather)",
    )
    return parser


@dataclass
class TrainRun:
    """What :func:`run_training` leaves behind: the live model and optimizer, for tests to inspect."""

    losses: list[float]
    start_step: int
    model: Transformer
    optimizer: torch.optim.Optimizer


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Reject flag combinations that cannot work, naming the flag; raises :class:`UsageError`."""
    if args.steps < 0:
        raise UsageError(f"--steps must be >= 0, got {args.steps}")
    if args.save_every < 0:
        raise UsageError(f"--save-every must be >= 0, got {args.save_every}")
    if args.save_every > 0 and not args.ckpt_dir:
        raise UsageError("--save-every needs --ckpt-dir", hint="pass --ckpt-dir DIR, or drop --save-every")
    if args.keep_last is not None and args.keep_last < 1:
        raise UsageError(f"--keep-last must be >= 1, got {args.keep_last}")
    if args.keep_every is not None and args.keep_every < 1:
        raise UsageError(f"--keep-every must be >= 1, got {args.keep_every}")
    if args.batch_size < 1 or args.batch_size % world_size:
        raise UsageError(
            f"--batch-size {args.batch_size} does not split evenly over {world_size} ranks",
            hint="use a multiple of the world size, e.g. 12 for 1-4 ranks",
        )
    if args.grad_clip < 0:
        raise UsageError(f"--grad-clip must be >= 0, got {args.grad_clip}")


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
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise UsageError(
            "run_training needs an initialised process group",
            hint="launch with torchrun, or call main(), which creates one",
        )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_args(args, world_size)
    config = PRESETS[args.model_size]

    # The mesh follows the process group's backend, so gloo ranks on a GPU machine stay on CPU.
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (world_size,))
    model = build_fsdp_model(config, mesh, args.seed, mixed_precision=args.mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    device = next(model.parameters()).device

    ckpt = None
    start = 0
    if args.ckpt_dir:
        from .. import Checkpointer  # only needed when checkpointing

        ckpt = Checkpointer(args.ckpt_dir, keep_last=args.keep_last, keep_every=args.keep_every, async_save=args.async_save)
        if args.resume:
            res = ckpt.load(model, optimizer)
            if res is not None:
                _check_resumed_extra(res.extra, args, res.path)
                if args.verify_after_load:
                    from .. import verify_loaded

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
                # res.step optimizer steps are done: the next loop index is res.step itself.
                start = res.step

    criterion = nn.CrossEntropyLoss()
    losses: list[float] = []
    for step in range(start, args.steps):
        x, y = local_batch(step, rank, world_size, args.batch_size, config, args.seed)
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = criterion(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
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
            extra = {"step": done, "seed": args.seed, "batch_size": args.batch_size, "model_size": args.model_size}
            ckpt.save(done, model, optimizer, extra=extra)
    if ckpt is not None:
        ckpt.close()  # an async save still running finishes (or raises) here
    return TrainRun(losses=losses, start_step=start, model=model, optimizer=optimizer)


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
        # Plain `python -m ckpttool.trainer.train`: a world of one needs no rendezvous.
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
