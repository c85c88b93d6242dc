"""The ``ckpttool`` command line: parse, call the library, render text or ``--json``, exit code.

Exit codes: 0 ok, 1 verification found a difference, 2 bad usage or unreadable input. Errors
are one line on stderr (what, where, what to do); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from typing import Any

import click

from . import formats
from .choices import CAST_DTYPES, COMPRESSIONS, human_bytes, parse_size
from .errors import EXIT_BAD_INPUT, CkptError, UsageError

SIZE_HELP = "sizes like 512MiB, 2GB or plain bytes"


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Check a size option while parsing, before torch is imported; the library parses it again."""
    if value is not None:
        try:
            parse_size(value)
        except CkptError as exc:
            raise click.BadParameter(f"{exc.what} ({exc.hint})" if exc.hint else exc.what) from None
    return value


# --- shared plumbing -----------------------------------------------------------------------------


def _set_root_flag(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().params[param.name] = True


class _Command(click.Command):
    """Every command also takes the global ``--debug`` and ``-q``, so they work after its name too
    (``ckpttool verify X --debug``, as the one-line errors suggest)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params += [
            click.Option(["--debug"], is_flag=True, expose_value=False, callback=_set_root_flag,
                         help="Show tracebacks instead of one-line errors."),
            click.Option(["--quiet", "-q"], is_flag=True, expose_value=False, callback=_set_root_flag, help="No progress on stderr."),
        ]


def _debug(ctx: click.Context) -> bool:
    root = ctx.find_root()
    return bool(root.params.get("debug")) or os.environ.get("CKPTTOOL_DEBUG") == "1"


def _quiet(ctx: click.Context) -> bool:
    return bool(ctx.find_root().params.get("quiet"))


def _speaks() -> bool:
    """Whether this process prints: a lone one, or worker 0 of several (the others stay quiet)."""
    from .parallel import launched

    return not launched() or os.environ.get("RANK", "0") == "0"


nproc_option = click.option("--nproc", type=click.IntRange(1, 256), default=1, show_default=True,
                            help="Split the work between up to N local worker processes (gloo); the output is byte-identical. "
                                 "Fewer start (or none) where the cores or the input's size say they would not pay for "
                                 "their start, and a line on stderr says so; CKPTTOOL_SPLIT=always starts N. "
                                 "Under torchrun (torchrun ... -m ckpttool ...) torchrun's processes are the workers.")


def _spread(ctx: click.Context, nproc: int, src: str, dst: str | None, storage_options: tuple[str, ...]) -> None:
    """With ``--nproc N`` (and not already a worker): run this command line as the workers that pay
    for their start (:func:`parallel.workers_for`; saying so on stderr when fewer than N) and exit
    with its code. Otherwise return, and the command runs here."""
    from .parallel import ENV_SPLIT, launch, launched, workers_for

    if nproc <= 1 or launched():
        return
    options = _storage_options(storage_options)
    workers, why = workers_for(nproc, src, dst, options)
    if why is not None and not _quiet(ctx):
        ran = "in one process" if workers == 1 else f"{workers} workers"
        click.echo(f"ckpttool: --nproc {nproc}: running {ran}: {why} ({ENV_SPLIT}=always starts {nproc})", err=True)
    if workers > 1:
        ctx.exit(launch(workers, sys.argv[1:], dst, options))  # (a worker's count is WORLD_SIZE, not --nproc)



class _Group(click.Group):
    """Maps library errors to one line and an exit code for every command."""

    command_class = _Command

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """As click's, but a worker of a parallel offline command (``--nproc``, torchrun) ends with
        ``os._exit`` once its output is flushed: its gloo threads may still drop the last
        reference to a collective's temporary tensor, which needs the interpreter an exiting
        process is tearing down ("terminate called without an active exception", SIGABRT, seen
        about once in 20 torchrun runs on a loaded machine). Everything it wrote is closed by then,
        and :func:`parallel.leave` has waited for the other workers, so that none exits (under
        torchrun, a non-zero exit stops the rest) before worker 0 has printed."""
        from . import parallel

        code: Any = 0
        try:
            return super().main(*args, **kwargs)
        except SystemExit as exc:
            if not parallel.joined:  # not a worker (train under torchrun included): exit as usual
                raise
            code = exc.code
        if not isinstance(code, int):
            if code is not None:
                print(code, file=sys.stderr)
            code = 0 if code is None else 1
        sys.stdout.flush()
        sys.stderr.flush()
        parallel.leave()
        os._exit(code)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CkptError as exc:
            if _debug(ctx):
                traceback.print_exc()
            if _speaks():
                click.echo(f"error: {exc.message()}", err=True)
            ctx.exit(exc.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted; partial output was removed", err=True)
            ctx.exit(130)
        except Exception as exc:  # a bug, or an error we do not know yet: still one line
            if _debug(ctx):
                traceback.print_exc()
            if _speaks():
                click.echo(f"error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", err=True)
            ctx.exit(EXIT_BAD_INPUT)


class Progress:
    """One self-overwriting line on stderr; silent when stderr is not a terminal or with --quiet."""

    def __init__(self, label: str, enabled: bool):
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self.shown = False

    def __call__(self, done: int, total: int, key: str) -> None:
        if not self.enabled:
            return
        pct = 100.0 * done / total if total else 100.0
        line = f"\r{self.label}: {pct:5.1f}% {human_bytes(done)}/{human_bytes(total)} {key[-40:]}"
        sys.stderr.write(line.ljust(100)[:120])
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--storage-option")
        k, v = pair.split("=", 1)
        out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


storage_option = click.option(
    "--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE", help="fsspec option for URLs (repeatable)."
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout, for scripts.")


def write_options(command: Any) -> Any:
    """The options of every command that writes a checkpoint (convert, reshard), in one place:
    --compress, --memory-budget, --force, --nproc, --json, --storage-option; and the context."""
    for option in reversed([
        click.option("--compress", type=click.Choice(COMPRESSIONS),
                     help="DCP output: store each record zstd-compressed, as torch's FileSystemWriter(_extensions=[ZStandard()]) "
                          "does (plain torch reads it; needs ckpttool[zstd])."),
        click.option("--memory-budget", metavar="SIZE", default="1GiB", show_default=True, callback=_size,
                     help="Most tensor data held in memory at once."),
        click.option("--force", is_flag=True, help="Replace DST if it exists (never a DST that contains SRC, lies in it, or is a training root)."),
        nproc_option, json_option, storage_option, click.pass_context,
    ]):
        command = option(command)
    return command


only_option = click.option("--only", metavar="KEY", help="Keep one top-level key and drop its prefix (e.g. --only model).")
optimizer_order_option = click.option(
    "--optimizer-order", "optimizer_order", type=click.Choice(["model"]),
    help="A per-rank folder whose optimizer records no parameter names (built from model.parameters()): state that it "
         "numbered the model's parameters in the order the model file lists them, so its indices become their names "
         "(the output records that its names rest on this). Without it such state stays keyed by index, as torch wrote it.")


def _emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, default=str))


# --- the commands --------------------------------------------------------------------------------


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
@click.version_option(package_name="ckpttool")
def main(debug: bool, quiet: bool) -> None:
    """Inspect, convert, reshard and verify PyTorch distributed checkpoints.

    \b
    Exit codes: 0 ok, 1 verification found a difference, 2 bad usage or unreadable input.
    Paths are local paths or fsspec URLs (file://, memory://, s3://...).
    """


@main.command()
@click.argument("path")
@optimizer_order_option
@json_option
@storage_option
@click.pass_context
def inspect(ctx: click.Context, path: str, optimizer_order: str | None, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """Show what a checkpoint or a training root holds.

    \b
    For a checkpoint (DCP directory, torch.save file, safetensors file or sharded directory):
    its format, every key with shape, dtype, bytes, chunks and files, object values, total size.
    For a training root (a directory of step-<N>): committed and incomplete steps.

    \b
    Examples:
      ckpttool inspect runs/exp1
      ckpttool inspect runs/exp1/step-100 --json | jq '.entries | length'
      ckpttool inspect model.safetensors
    """
    from .offline.describe import inspect_path, render_text

    report = inspect_path(path, _storage_options(storage_options), optimizer_order=optimizer_order)
    if as_json:
        _emit_json(report)
    else:
        click.echo(render_text(report))


@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--to", type=click.Choice([*formats.output_names(), "hf"]),
              help="Output format (default: from DST's suffix); hf: a folder from_pretrained reads (with --like).")
@only_option
@click.option("--dtype", type=click.Choice(CAST_DTYPES), help="Cast floating-point tensors; integer tensors and 0-d counters (AdamW step) keep their dtype.")
@click.option("--max-shard-size", metavar="SIZE", callback=_size,
              help=f"Write HF-sharded files of up to SIZE ({SIZE_HELP}): safetensors, or torch .bin with --to torch; "
                   "with --to hf, instead of --like's own files.")
@click.option("--like", metavar="HF_DIR", help="--to hf: the save_pretrained folder whose names, shapes, weight files (one "
              "model.safetensors, or its shards and their split) and other files (config, tokenizer) to follow.")
@click.option("--key-map", "key_map", metavar="REGEX=REPLACEMENT", multiple=True,
              help="--to hf: rename the source's keys (re.sub, in the order given) to --like's names.")
@optimizer_order_option
@write_options
def convert(ctx: click.Context, src: str, dst: str, to: str | None, only: str | None, dtype: str | None, max_shard_size: str | None,
            like: str | None, key_map: tuple[str, ...], optimizer_order: str | None, compress: str | None, memory_budget: str,
            force: bool, nproc: int, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """Convert SRC to DST between DCP, torch.save and safetensors.

    \b
    The output format comes from --to, else from DST's suffix:
      {suffixes}.
    Tensors stream slab by slab, so memory stays under --memory-budget whatever the checkpoint's
    size (a DCP record or a torch file is read by byte range; every format streams, none needs a
    whole tensor in memory).
    The output is written under a temporary name and appears only when complete.
    safetensors holds tensors; other entries go into its header metadata when they are JSON-able,
    and the command lists those it had to drop. Every record read is checked (CRC-32, and the
    manifest of a ckpttool step); the source is distrusted: see docs/security.md for the limits.

    \b
    Examples:
      ckpttool convert runs/exp1/step-100 full.pt
      ckpttool convert runs/exp1/step-100 model.safetensors --only model --dtype bfloat16
      ckpttool convert runs/exp1/step-100 hf/ --to safetensors --only model --max-shard-size 2GB
      ckpttool convert full.pt restored-dcp/
      ckpttool convert runs/exp1/step-100 hf/ --to safetensors --only model --max-shard-size 5GB --nproc 4
      ckpttool convert runs/exp1/step-100 finetuned/ --to hf --like meta-llama-3-8b/
      ckpttool convert fsdp-rank-files/ full.pt --optimizer-order model
    """
    from .offline.convert import convert as run_convert

    if any("=" not in rule for rule in key_map):
        raise click.BadParameter("takes REGEX=REPLACEMENT", param_hint="--key-map")
    rules = dict(rule.split("=", 1) for rule in key_map) or None
    _spread(ctx, nproc, src, dst, storage_options)
    report = _write(ctx, "convert", as_json, lambda progress, many: run_convert(
        src, dst, to=to, only=only, dtype=dtype, max_shard_size=max_shard_size, compress=compress, memory_budget=memory_budget,
        force=force, storage_options=_storage_options(storage_options), progress=progress, parallel=many, like=like,
        key_map=rules, optimizer_order=optimizer_order))
    if report is None:
        return
    click.echo(f"wrote {report.dst} ({report.dst_format}): {report.tensors} tensors, {human_bytes(report.bytes)}, {report.objects} objects")
    if report.dropped:
        click.echo(f"dropped {len(report.dropped)} non-tensor entries that {report.dst_format} cannot hold: {', '.join(report.dropped)}", err=True)
    for note in report.notes:
        click.echo(f"note: {note}", err=True)


def _write(ctx: click.Context, what: str, as_json: bool, run: Any) -> Any:
    """Run a command that writes a checkpoint (``run(progress, parallel)``) with its progress line
    and its workers; returns the report to render as text, or None once it is printed as JSON (or
    when this worker is not the one that speaks)."""
    from .parallel import workers

    progress = Progress(what, not _quiet(ctx) and not as_json and _speaks())
    try:
        with workers() as many:
            report = run(progress, many)
    finally:
        progress.close()
    if not _speaks():
        return None
    if as_json:
        _emit_json(report.__dict__)
        return None
    return report


def _suffix_help() -> str:
    """'.safetensors -> safetensors, .pt/.pth/.bin -> torch, anything else -> a dcp directory', from the registry."""
    parts = [f"{'/'.join(r.suffixes)} -> {r.name}" for r in formats.registrations() if r.suffixes]
    default = next(r.name for r in formats.registrations() if r.default)
    return ", ".join([*parts, f"anything else -> a {default} directory"])


convert.help = (convert.help or "").replace("{suffixes}", _suffix_help())


@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--world-size", type=int, help="Ranks of the job that will load DST (1 to 65536).")
@click.option("--mesh", metavar="RxS", help="HSDP mesh: R replicas x S shards (R*S = world size); boxes follow the shard dim. "
                                             "With --tp-colwise/--tp-rowwise: DPxTP, FSDP2 over DP and tensor parallelism over TP.")
@click.option("--tp-colwise", metavar="LAYER", multiple=True,
              help="With --mesh DPxTP: a layer cut by rows over TP (ColwiseParallel): a dotted name inside its keys (w1) or a glob "
                   "of whole keys; repeatable.")
@click.option("--tp-rowwise", metavar="LAYER", multiple=True,
              help="With --mesh DPxTP: a layer whose weight is cut by columns over TP (RowwiseParallel); repeatable.")
@click.option("--like", metavar="OTHER", help="Lay DST out exactly as the DCP checkpoint OTHER (every key's chunks, in the same "
                                              "ranks' files): save the new job's initial state once on its mesh, then reshard to it. "
                                              "Instead of --world-size.")
@only_option
@click.option("--to", "to", type=click.Choice(formats.reshard_outputs()), default="dcp", show_default=True,
              help="Write DCP, or a per-rank torch.save folder (<key>_rank_<R>.pt of DTensors, as FSDP2's manual "
                   "sharded checkpointing writes them).")
@optimizer_order_option
@write_options
def reshard(ctx: click.Context, src: str, dst: str, world_size: int | None, mesh: str | None, tp_colwise: tuple[str, ...],
            tp_rowwise: tuple[str, ...], like: str | None, only: str | None, to: str, optimizer_order: str | None,
            compress: str | None, memory_budget: str, force: bool, nproc: int, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """Rewrite a DCP checkpoint (or a per-rank torch.save folder) for a new world size, in one process, without a cluster.

    \b
    DST is laid out as FSDP2 Shard(0) on WORLD_SIZE ranks (torch.chunk along dim 0, so the last
    shards may be short or empty): one __<rank>_0.distcp per rank holding exactly that rank's
    boxes, so each rank of the new job reads its own file (replicated entries such as buffers,
    scalars and objects are stored once, in rank 0's file). Plain torch.distributed.checkpoint.load
    reads DST. SRC may be written by ckpttool or by plain torch, on any world size.

    \b
    With --like OTHER, DST takes OTHER's layout instead, whatever it is (FSDP+TP on a 2-D mesh,
    shards on dim 1, ...): every key's chunks as OTHER has them, in the same ranks' files. OTHER
    must hold the same tensor keys and shapes (its data is not read).

    With --mesh DPxTP and --tp-colwise/--tp-rowwise, DST is laid out for FSDP2 over DP ranks and
    tensor parallelism over TP (rank = dp_index * TP + tp_index): colwise layers cut by rows over
    TP, rowwise layers' weights by columns, then FSDP2's rows over DP; other tensors Shard(0) over
    DP, stored once.

    With --to torch-ranks, DST is a per-rank folder for the new job, as its ranks would write it
    with FSDP2's manual sharded checkpointing (model_rank_<R>.pt, optim_rank_<R>.pt of DTensors,
    the optimizer keyed by parameter index; other keys once, as <key>.pt): each rank of the new
    job torch.loads its own files.

    \b
    Examples:
      ckpttool reshard runs/exp1/step-100 step-100-w4 --world-size 4
      ckpttool reshard runs/exp1/step-100 step-100-hsdp --world-size 4 --mesh 2x2
      ckpttool reshard runs/exp1/step-100 step-100-w8-zstd --world-size 8 --compress zstd
      ckpttool reshard runs/exp1/step-100 step-100-tp --like runs/exp2-tp/step-0
      ckpttool reshard runs/exp1/step-100 step-100-fsdp-tp --world-size 4 --mesh 2x2 --tp-colwise w1 --tp-rowwise w2
      ckpttool reshard runs/exp1/step-100 step-100-w64 --world-size 64 --nproc 8
      ckpttool reshard ckpt-dir-of-rank-files ranks-w3 --world-size 3 --to torch-ranks
      torchrun --nnodes 4 --nproc_per_node 8 ... -m ckpttool reshard s3://b/step-100 s3://b/w1024 --world-size 1024
    """
    from .offline.reshard import reshard as run_reshard

    _spread(ctx, nproc, src, dst, storage_options)
    report = _write(ctx, "reshard", as_json, lambda progress, many: run_reshard(
        src, dst, world_size=world_size, mesh=mesh, tp_colwise=tp_colwise, tp_rowwise=tp_rowwise, like=like, only=only,
        parallel=many, compress=compress, to=to, memory_budget=memory_budget, force=force,
        storage_options=_storage_options(storage_options), progress=progress, optimizer_order=optimizer_order))
    if report is None:
        return
    click.echo(f"wrote {report.dst}: {report.tensors} tensors, {human_bytes(report.bytes)} for {report.world_size} ranks "
               f"({'' if report.mesh.startswith('like ') else 'mesh '}{report.mesh}; source had {report.source_world_size})")
    for note in report.notes:
        click.echo(f"note: {note}", err=True)


@main.command()
@click.argument("path")
@click.option("--against", "other", metavar="OTHER", help="Compare entry by entry with another checkpoint in any format.")
@click.option("--only", metavar="KEY", help="Check only entries under this top-level key (with --against: compare them, prefix dropped).")
@click.option("--against-only", metavar="KEY", help="With --against: compare only OTHER's entries under this top-level key, prefix dropped.")
@click.option("--rtol", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="Relative tolerance for --against (default: bitwise).")
@click.option("--atol", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="Absolute tolerance for --against.")
@click.option("--cast", is_flag=True, help="With --against: where dtypes differ, cast PATH's values to OTHER's dtype first (for exports made with --dtype).")
@click.option("--memory-budget", metavar="SIZE", default="1GiB", show_default=True, callback=_size, help="Most tensor data held in memory at once.")
@optimizer_order_option
@nproc_option
@json_option
@storage_option
@click.pass_context
def verify(ctx: click.Context, path: str, other: str | None, only: str | None, against_only: str | None, rtol: float, atol: float, cast: bool,
           memory_budget: str, optimizer_order: str | None, nproc: int, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """Check a checkpoint's integrity, or compare it with another.

    \b
    Integrity (any format, or every committed step of a training root): every referenced file
    exists and every byte range lies inside it; every tensor's chunks tile its shape with no gap
    or overlap; every record decodes to its declared dtype and shape; the bytes are the ones
    written (the CRC-32 torch stores for every record of DCP and torch.save files, and the
    manifest of a ckpttool step, .metadata included; safetensors has no checksums); pickles are
    read through the allow-list, never run; no path leads out of the checkpoint. A training root
    also lists steps whose commit record is damaged. Limits, what is not checked: docs/security.md.
    With --against: keys missing on either side, dtype and shape differences, values bitwise
    (or within --rtol/--atol, with max differences and the first differing index).
    Exit 0 when nothing is wrong, 1 when problems or differences were found, 2 when PATH cannot
    be read at all.

    \b
    Examples:
      ckpttool verify runs/exp1
      ckpttool verify runs/exp1/step-100 --json
      ckpttool verify runs/exp1/step-100 --against model.safetensors --only model
      ckpttool verify runs/exp1/step-100 --against model-bf16.safetensors --only model --cast
      ckpttool verify hf-export/ --against runs/exp1/step-100 --against-only model
      ckpttool verify s3://bucket/runs/exp1 --nproc 8
    """
    from .parallel import launched, workers
    from .offline.verify import verify_against, verify_path

    if other and (nproc > 1 or launched()):
        raise UsageError("--against runs in one process", hint="split integrity checks only: verify PATH --nproc N")
    _spread(ctx, nproc, path, None, storage_options)
    progress = Progress("verify", not _quiet(ctx) and not as_json and _speaks())
    opts = _storage_options(storage_options)
    try:
        if other:
            report = verify_against(path, other, only=only, against_only=against_only, rtol=rtol, atol=atol, cast=cast, memory_budget=parse_size(memory_budget, "--memory-budget"),
                                    storage_options=opts, progress=progress, optimizer_order=optimizer_order)
        else:
            with workers() as many:
                report = verify_path(path, only=only, storage_options=opts, progress=progress, parallel=many,
                                     optimizer_order=optimizer_order)
    finally:
        progress.close()
    if not _speaks():
        ctx.exit(report.exit_code)
    from .rendezvous import pause_point

    pause_point("report")  # tests slow worker 0 down here: the others must not exit before it prints
    if as_json:
        _emit_json(report.to_json())
    else:
        for problem in report.problems:
            click.echo(f"problem: {problem.line()}")
        for note in report.notes:
            click.echo(f"note: {note}")
        scope = (f"{report.tensors_checked} tensors ({human_bytes(report.bytes_checked)}) and {report.objects_checked} objects "
                 f"{'checked' if report.ok else 'examined'} in {report.path}")
        click.echo(f"OK: {scope}" if report.ok else f"{len(report.problems)} problem(s) found; {scope}")
    ctx.exit(report.exit_code)


@main.command()
@click.argument("root")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@json_option
@storage_option
def clean(root: str, dry_run: bool, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """Remove the step directories under a training root that never committed.

    A crash or kill during a save leaves a hidden .step-<N>.tmp-* directory (or, on object
    stores, a step-<N> without its commit record). Load ignores them; this removes them. Do not
    run it while a job is saving into ROOT.

    \b
    Examples:
      ckpttool clean runs/exp1 --dry-run
      ckpttool clean runs/exp1
    """
    from .training.checkpointer import Checkpointer
    from .errors import NotFoundError

    with Checkpointer(root, storage_options=_storage_options(storage_options)) as ckpt:  # releases the lease clean takes
        if not ckpt.root.exists():
            raise NotFoundError("training root does not exist", where=ckpt.root.url, hint="check the path")
        names = ckpt.incomplete() if dry_run else ckpt.clean()
    if as_json:
        _emit_json({"root": ckpt.root.url, "removed": [] if dry_run else names, "would_remove": names if dry_run else []})
        return
    verb = "would remove" if dry_run else "removed"
    click.echo(f"{verb} {len(names)} incomplete step(s){': ' + ', '.join(names) if names else ''}")


class _TrainCommand(_Command):
    """``train``'s help also lists the trainer's own flags (argparse's, passed through)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_options(ctx, formatter)
        from .training.trainer.args import make_parser

        rows = []
        for action in make_parser()._actions:
            if not action.option_strings or "-h" in action.option_strings:
                continue
            names = ", ".join(action.option_strings)
            if action.metavar or (action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction)):
                names += f" {action.metavar or action.dest.upper()}"
            text = action.help or ""
            if action.choices:
                text += f" (one of {', '.join(map(str, action.choices))})"
            if action.required:
                text += " [required]"
            rows.append((names, text))
        with formatter.section("Trainer options (passed to every rank)"):
            formatter.write_dl(rows)


@main.command(cls=_TrainCommand, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--nproc", type=int, default=2, show_default=True, help="Ranks to start (processes on this machine).")
@click.pass_context
def train(ctx: click.Context, nproc: int) -> None:
    """Train the bundled FSDP2 Transformer on NPROC ranks (launches torchrun for you).

    Every other option goes to the trainer (listed below); they are checked before any rank starts.

    \b
    Examples:
      ckpttool train --nproc 2 --steps 20 --ckpt-dir runs/exp1 --save-every 5
      ckpttool train --nproc 2 --steps 40 --ckpt-dir runs/exp1 --save-every 5   # resumes at 20
    """
    if nproc < 1:
        raise click.BadParameter("must be at least 1", param_hint="--nproc")
    from .training.trainer.args import check_args, make_parser

    parser = make_parser()
    try:
        args = parser.parse_args(ctx.args)
    except SystemExit as exc:  # argparse printed its usage line already
        ctx.exit(EXIT_BAD_INPUT if exc.code else 0)
    check_args(args, nproc)  # flag errors now, with one line, not from every rank under torchrun
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "ckpttool.training.trainer.train", *ctx.args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if _debug(ctx):
        env["CKPTTOOL_DEBUG"] = "1"  # the ranks print their tracebacks too
    ctx.exit(_run_torchrun(cmd, env, _debug(ctx)))


def _run_torchrun(cmd: list[str], env: dict[str, str], debug: bool) -> int:
    """Run torchrun, passing the ranks' output through but not torchrun's own traceback of a
    failed rank (each rank has already said what failed, in one line); --debug keeps it."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    hiding = False
    for line in proc.stderr:
        if not debug and (line.startswith("Traceback (most recent call last)") or "elastic/multiprocessing/api.py" in line):
            hiding = True  # torchrun's report of a failed child: the rank's own line came before
        if not hiding:
            sys.stderr.write(line)
    code = proc.wait()
    if code and hiding:
        click.echo(f"error: training failed (torchrun exit code {code}); the ranks' messages are above "
                   "(run with --debug for torchrun's report)", err=True)
    return code


if __name__ == "__main__":
    main()
