"""The trainer's flags, without torch: ``ckpttool train`` checks them (and lists them in its
``--help``) before it imports torch or starts a rank."""

from __future__ import annotations

import argparse

from ...errors import UsageError

#: the model presets of ``trainer/model.py`` (a test checks that they agree)
PRESET_NAMES = ("1g", "small", "tiny")


def make_parser() -> argparse.ArgumentParser:
    """The trainer's flags; ``ckpttool train`` passes its own through to this list unchanged."""
    parser = argparse.ArgumentParser(
        prog="python -m ckpttool.training.trainer.train",
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
    parser.add_argument("--model-size", choices=PRESET_NAMES, default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument(
        "--batch-size", type=int, default=12, help="global batch size, divisible by the world size (default: 12)"
    )
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 gradient reduction")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="residual dropout; each rank draws its masks from its own generator, saved per rank (default: 0)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="linear learning-rate warmup over N steps (a LambdaLR, saved with each step; default: 0, constant)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 turns clipping off (default: 1.0)")
    parser.add_argument("--keep-last", type=int, default=None, help="keep only the newest N committed steps")
    parser.add_argument("--keep-every", type=int, default=None, help="with --keep-last, also keep every step divisible by N")
    parser.add_argument(
        "--async-save", action="store_true", help="save in the background (a snapshot; training goes on while it writes)"
    )
    parser.add_argument(
        "--writer", choices=("thread", "process"), default="thread",
        help="with --async-save: write in a background thread (default) or in a process of each rank's own",
    )
    parser.add_argument(
        "--freeze", action="append", default=[], metavar="PREFIX",
        help="freeze the parameters whose names start with PREFIX (repeatable; e.g. tok_embeddings, layers.0.): they do not train",
    )
    parser.add_argument(
        "--incremental", action="store_true",
        help="each save shares the previous step's file of frozen parameters (a hard link) when they did not change",
    )
    parser.add_argument(
        "--verify-after-load",
        action="store_true",
        help="after resuming, check every rank's shards against the checkpoint's bytes (no all-gather)",
    )
    return parser


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Reject flag combinations that cannot work, naming the flag; raises :class:`UsageError`."""
    if args.steps < 0:
        raise UsageError(f"--steps must be >= 0, got {args.steps}")
    if args.save_every < 0:
        raise UsageError(f"--save-every must be >= 0, got {args.save_every}")
    if args.save_every > 0 and not args.ckpt_dir:
        raise UsageError("--save-every needs --ckpt-dir", hint="pass --ckpt-dir DIR, or drop --save-every")
    if args.incremental and not args.ckpt_dir:
        raise UsageError("--incremental needs --ckpt-dir", hint="pass --ckpt-dir DIR, or drop --incremental")
    if args.keep_last is not None and args.keep_last < 1:
        raise UsageError(f"--keep-last must be >= 1, got {args.keep_last}")
    if args.keep_every is not None and args.keep_every < 1:
        raise UsageError(f"--keep-every must be >= 1, got {args.keep_every}")
    if args.batch_size < 1 or args.batch_size % world_size:
        raise UsageError(
            f"--batch-size {args.batch_size} does not split evenly over {world_size} ranks",
            hint="use a multiple of the world size, e.g. 12 for 1-4 ranks",
        )
    if not 0.0 <= args.dropout < 1.0:
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.grad_clip < 0:
        raise UsageError(f"--grad-clip must be >= 0, got {args.grad_clip}")
