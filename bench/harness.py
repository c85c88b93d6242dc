"""The one pipeline every benchmark in ``bench/`` runs: a script is a :class:`Spec` (its options, what it
measures, how a result becomes rows and verdicts, its table and its chart) and ``main(SPEC)``.

The pipeline: options -> (a child process: its case, a rank, a generator rank, and out) -> OUT_DIR and
the machine's facts -> for each :class:`Set` the script yields (a checkpoint and the cases measured on
it): the cases in interleaved rounds, one representative run per case (:func:`best_of`), the rows and
verdicts (``spec.derive``), the JSON rewritten -> the text tables and verdicts, ``--md``, ``--plot``
(one chart function, :func:`chart`) -> the checkpoints it wrote and its work folder removed.

Standard library only at import time, like ``_common.py``: the parent stays small.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from _common import (
    GB, ChildRun, cold_cache, machine_facts, measure_child, remove, report_failure, write_json,
)

Row = dict[str, Any]


# --- what a script declares ----------------------------------------------------------------------


@dataclass
class Column:
    """A table column: ``key`` of a row (or a function of it), formatted with ``fmt``; ``fmt=None``:
    text, left-aligned, and also shown in a failed case's row."""

    head: str
    key: str | Callable[[Row], Any]
    fmt: str | None = ".2f"

    def cell(self, row: Row) -> str:
        value = self.key(row) if callable(self.key) else row.get(self.key)
        if value is None:
            return "–"
        return str(value) if self.fmt is None else format(value, self.fmt)


@dataclass
class Panel:
    """One panel of a chart: a horizontal bar of ``key`` per row (``also``: a lighter second bar
    beside it), an optional target line ``limit(set)`` (a value, or None for none), log scale."""

    key: str
    xlabel: str
    also: str | None = None
    legend: tuple[str, str] = ("", "")
    limit: Callable[[dict[str, Any]], float | None] | None = None
    limit_label: str = ""
    log: bool = False
    note: Callable[[Row], str] | None = None


@dataclass
class Chart:
    """A script's figure: its panels side by side, once per value of the row key ``split`` (a cache
    state) if given; bars coloured by ``color(row)``; the title is ``title(set)`` after the machine."""

    panels: list[Panel]
    title: Callable[[dict[str, Any]], str]
    split: str | None = None
    color: Callable[[Row], str] | None = None


@dataclass
class Set:
    """One table of a run: the cases measured on one checkpoint (``info``, its facts), in rounds.

    ``measure(case)`` runs one case and returns its result (``ok`` true when it worked);
    ``explode(case, result)``, when given, splits one run into several cases' results (a load that
    measures every cache state in the same processes); ``line(case, result)`` is its progress line.
    ``time_keys``/``peak_keys``/``pick``: as :func:`best_of`."""

    cases: list[str]
    measure: Callable[[str], dict[str, Any]]
    line: Callable[[str, dict[str, Any]], str]
    heading: str = ""
    tag: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    time_keys: list[str] = field(default_factory=lambda: ["seconds", "process_wall_s"])
    peak_keys: list[str] = field(default_factory=lambda: ["peak_kib"])
    pick: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None
    explode: Callable[[str, dict[str, Any]], dict[str, dict[str, Any]]] | None = None
    after_round: Callable[[], None] | None = None


@dataclass
class Spec:
    """A benchmark: ``options(parser)`` adds its own; ``sets(run)`` yields what to measure, one
    :class:`Set` at a time (a checkpoint is written when its set comes); ``derive(set, run)`` gives
    the rows and verdicts of a measured set; ``child(args)`` is a case in a child process (returns
    its result), ``rank(args)`` a rank of a multi-rank case; ``hidden`` their extra options;
    ``epilogue(results)``: text printed and written after the tables (a breakdown, a note)."""

    name: str
    title: str
    doc: str
    script: str
    options: Callable[[argparse.ArgumentParser], None]
    sets: Callable[["Run"], Iterable[Set]]
    derive: Callable[[dict[str, Any], "Run"], tuple[list[Row], list[dict[str, Any]]]]
    columns: list[Column]
    chart: Chart | None = None
    child: Callable[[argparse.Namespace], dict[str, Any]] | None = None
    rank: Callable[[argparse.Namespace], None] | None = None
    hidden: tuple[str, ...] = ()
    epilogue: Callable[[dict[str, Any]], str] | None = None
    repeat: int = 2
    case_timeout: float = 1800
    verdict_widths: tuple[int, int] = (48, 40)


# --- a run ---------------------------------------------------------------------------------------


class Run:
    """What a script's sets see: the options, OUT_DIR, the work folder (removed at the end), the
    machine's facts, whether the cache is dropped before a case, and the checkpoints it wrote."""

    def __init__(self, spec: Spec, args: argparse.Namespace) -> None:
        self.spec, self.args = spec, args
        self.out_dir = os.path.abspath(args.out_dir)
        self.work = os.path.join(self.out_dir, "work")
        os.makedirs(self.work, exist_ok=True)
        self.machine = machine_facts(self.out_dir)
        print(f"machine: {json.dumps(self.machine)}", flush=True)
        self.cold = cold_cache(getattr(args, "warm", False))
        self.made: list[str] = []  # checkpoints this run wrote: removed at the end unless --keep
        self.extra: dict[str, Any] = {}  # top-level keys a script adds to the results JSON (a baseline)

    def checkpoint(self, size_gb: float, mesh: str = "2", use_src: bool = True) -> tuple[str, dict[str, Any]]:
        """``--src``'s DCP directory (unless not ``use_src``), else a ckpttool checkpoint of ``size_gb``
        written on ``mesh`` (reused with ``--keep``); its facts, with ``file_bytes``."""
        from _dist import checkpoint, dcp_bytes, dcp_dir_of, existing_checkpoint

        if use_src and getattr(self.args, "src", None):
            step, info = existing_checkpoint(self.args.src)
        else:
            root, info = checkpoint(self.spec.script, self.out_dir, size_gb, mesh, getattr(self.args, "keep", False), self.work)
            step = dcp_dir_of(root)
            if not getattr(self.args, "keep", False):
                self.made.append(root)
        info["file_bytes"] = dcp_bytes(step)
        print(f"   {step}: {info['file_bytes'] / GB:.2f} GB of DCP files", flush=True)
        return step, info

    def child(self, name: str, args: list[str]) -> tuple[dict[str, Any], ChildRun]:
        """Run one case of this script in a fresh child (``--_case``): its result with ``ok``,
        ``rc``, its process tree's ``peak_kib`` and ``process_wall_s``; the failure reported."""
        run = measure_child(self.spec.script, args, self.work, name, timeout_s=self.args.case_timeout)
        r = dict(run.result)
        r.update(ok=run.rc == 0 and bool(run.result.get("ok")), rc=run.rc, peak_kib=run.peak_kib, process_wall_s=run.wall_s)
        if not r["ok"]:
            report_failure(name, run)
        return r, run

    def ranks(self, name: str, world: int, args: list[str]) -> tuple[list[dict[str, Any]] | None, ChildRun]:
        """Run one multi-rank case (``world`` rank processes of this script); each rank's result,
        or None when any failed (reported)."""
        from _dist import measure_ranks, rank_results

        run = measure_ranks(self.spec.script, world, args, self.work, name, timeout_s=self.args.case_timeout)
        return rank_results(name, run), run


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its docstring (how it measures) is the --help."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common(p: argparse.ArgumentParser, spec: Spec) -> None:
    """The options every benchmark has, and the hidden ones its child processes receive."""
    default_dir = f"/tmp/ckpttool-bench-{spec.name}"
    p.add_argument("--repeat", type=int, default=spec.repeat,
                   help=f"runs of each case, rounds interleaved; one representative run is reported (default {spec.repeat})")
    p.add_argument("--out-dir", default=default_dir, help=f"where checkpoints and outputs go: the disk under test (default {default_dir})")
    p.add_argument("--case-timeout", type=float, default=spec.case_timeout,
                   help=f"seconds before a case's whole process group is killed (default {spec.case_timeout:g})")
    p.add_argument("--json", help=f"write the results JSON here (default OUT_DIR/{spec.name}-results.json)")
    p.add_argument("--md", help="write the Markdown results here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--from-json", metavar="JSON", help="run nothing: print the tables and write --md and --plot from a saved --json")
    for name in ("--_case", "--_src", "--_dst", "--_cfg", "--_mesh", "--_rdzv", "--_result", *spec.hidden):
        p.add_argument(name, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_gen", nargs=4, help=argparse.SUPPRESS)


def main(spec: Spec, argv: list[str] | None = None) -> int:
    """Run the benchmark ``spec`` (see the module's docstring)."""
    p = parser(spec.doc)
    spec.options(p)
    add_common(p, spec)
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            report(spec, json.load(fh), args, None)
        return 0
    if args._gen:  # a rank of the checkpoint generator
        from _dist import finish_rank, gen_rank, init_rank

        init_rank(args)
        dst, cfg, mesh, how = args._gen
        finish_rank(args, gen_rank(dst, json.loads(cfg), mesh, how))
        return 0
    if args._rank is not None and spec.rank is not None:
        spec.rank(args)
        return 0
    if args._case and spec.child is not None:
        write_json(args._result, spec.child(args))
        return 0
    run = Run(spec, args)
    out_json = args.json or os.path.join(run.out_dir, f"{spec.name}-results.json")
    command = [os.path.relpath(sys.executable), os.path.relpath(spec.script), *(argv if argv is not None else sys.argv[1:])]
    results: dict[str, Any] = {"command": " ".join(command), "started": now(), "machine": run.machine,
                               "cold": run.cold, "repeat": args.repeat, "sets": []}
    try:
        for s in spec.sets(run):
            if s.heading:
                print(f"\n== {s.heading}", flush=True)
            runs = run_rounds(args.repeat, s)
            res = {"heading": s.heading, "tag": s.tag, "checkpoint": s.info, "torch": s.info.get("torch"), "machine": run.machine,
                   "options": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                   "cases": {n: best_of(rs, s.time_keys, s.peak_keys, s.pick) for n, rs in runs.items()}, "all_runs": runs}
            res["torch"] = res["torch"] or next((c.get("torch") for c in res["cases"].values() if c.get("torch")), None)
            res["rows"], res["checks"] = spec.derive(res, run)
            results["sets"].append(res)
            results["torch"] = results.get("torch") or res["torch"]
            write_json(out_json, {**results, **run.extra})
        results.update(run.extra)
        results["finished"] = now()
        write_json(out_json, results)
        report(spec, results, args, out_json)
    finally:
        if not getattr(args, "keep", False):
            from _dist import remove_checkpoint

            for root in run.made:
                remove_checkpoint(root)
        remove(run.work)
    return 0


def now() -> str:
    """The local time as the results show when a run started and finished."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


def run_rounds(repeat: int, s: Set) -> dict[str, list[dict[str, Any]]]:
    """Every case of ``s`` ``repeat`` times, rounds interleaved (a drift of the machine touches every
    case alike), a progress line per successful run; each case's runs in order."""
    runs: dict[str, list[dict[str, Any]]] = {} if s.explode else {n: [] for n in s.cases}
    for rnd in range(repeat):
        for case in s.cases:
            r = s.measure(case)
            for name, one in (s.explode(case, r) if s.explode else {case: r}).items():
                runs.setdefault(name, []).append(one)
                if one.get("ok"):
                    print(f"   [{rnd + 1}/{repeat}] {s.line(name, one)}", flush=True)
        if s.after_round is not None:
            s.after_round()
    return runs


def best_of(runs: list[dict[str, Any]], time_keys: list[str], peak_keys: list[str],
            pick: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """One representative run of a case; every reported value comes from that run.

    ``pick`` chooses it among the successful runs (default: the smallest ``time_keys[0]``, the
    fastest run); values of different runs are never mixed into one row. For the spread, every
    key in ``time_keys`` and ``peak_keys`` also gets ``KEY_all``: its value in each successful run,
    in run order. ``picked`` is the index of the chosen run among them, ``runs`` their number.
    """
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return {"failed": True, "runs": runs}
    rep = (pick or pick_smallest(time_keys[0]))(ok)
    out = dict(rep)
    for k in [*time_keys, *peak_keys]:
        if any(r.get(k) is not None for r in ok):
            out[k + "_all"] = [r.get(k) for r in ok]
    out["picked"] = next(i for i, r in enumerate(ok) if r is rep)
    out["runs"] = len(ok)
    return out


def pick_smallest(key: str) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """A ``best_of`` pick: the run with the smallest ``key`` (runs without it last)."""
    return lambda ok: min(ok, key=lambda r: r[key] if r.get(key) is not None else float("inf"))


def check(target: str, case: str, value: str, passed: bool | None) -> dict[str, Any]:
    """A verdict: a target, the case it is about, the measured value in words, pass/fail (None: a
    figure reported without a target)."""
    return {"target": target, "case": case, "value": value, "pass": passed}


# --- reporting -----------------------------------------------------------------------------------


def report(spec: Spec, results: dict[str, Any], args: argparse.Namespace, out_json: str | None) -> None:
    """Print each set's table and verdicts; write ``--md`` and ``--plot`` (one file per set, the
    second and later ones named with the set's tag)."""
    md = [md_header(spec.title, results)]
    for res in results["sets"]:
        print_results(render(spec.columns, res["rows"], markdown=False), res["checks"], res["heading"], spec.verdict_widths)
        md.append((f"### {res['heading']}\n\n" if res["heading"] else "")
                  + render(spec.columns, res["rows"], markdown=True) + "\n\n" + verdict_md(res["checks"]) + "\n")
    if spec.epilogue is not None:
        text = spec.epilogue(results)
        print("\n" + text)
        md.append(text)
    if out_json:
        print(f"\nresults: {out_json}")
    if args.md:
        with open(args.md, "w") as fh:
            fh.write("\n".join(md))
        print(f"markdown: {args.md}")
    if args.plot and spec.chart is not None:
        base, ext = os.path.splitext(args.plot)
        for i, res in enumerate(results["sets"]):
            path = args.plot if i == 0 else f"{base}-{res['tag'] or i}{ext}"
            print(plot_file(path, spec.chart, res))


def render(columns: list[Column], rows: list[Row], markdown: bool) -> str:
    """A table of ``rows``; a failed case shows its text columns, then "failed"."""
    head = [c.head for c in columns]
    left = tuple(i for i, c in enumerate(columns) if c.fmt is None)
    lines = []
    for r in rows:
        if r.get("failed"):
            text = [c.cell(r) for c in columns if c.fmt is None]
            lines.append([*text, "failed"] + [""] * (len(head) - len(text) - 1))
        else:
            lines.append([c.cell(r) for c in columns])
    return (md_table if markdown else text_table)(head, lines, left)


def f(x: float | None, fmt: str = ".2f") -> str:
    """A number in a sentence or cell, or a dash where there is no value (no reference ran)."""
    return "–" if x is None else format(x, fmt)


def md_table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    """A Markdown table; the columns in ``left`` are left-aligned, the others (numbers) right-aligned."""
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i in left else "---:" for i in range(len(head))) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def text_table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    """The same table as aligned plain text, for the terminal."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def md_header(title: str, results: dict[str, Any]) -> str:
    """The top of a results file: what ran, where, when."""
    m = results.get("machine", {})
    facts = (f"{m.get('cpus')} cores ({m.get('cpu_model', '?')}), {m.get('mem_total_gib')} GiB RAM, swap {m.get('swap_gib')} GiB, "
             f"{m.get('disk_fs')} on {m.get('disk_device')} (rotational: {m.get('disk_rotational')}), kernel {m.get('kernel')}, "
             f"Python {m.get('python')}, torch {results.get('torch')}")
    return (f"# {title}\n\nCommand (from the repository root): `{results.get('command')}`\n\n"
            f"Run {results.get('started')} – {results.get('finished')} on: {facts}.\n\n")


def _mark(passed: bool | None) -> str:
    return "INFO" if passed is None else "PASS" if passed else "FAIL"


def verdict_md(checks: list[dict[str, Any]]) -> str:
    """The verdicts as a Markdown table."""
    rows = [[c["target"], c["case"], c["value"], "–" if c["pass"] is None else "pass" if c["pass"] else "**FAIL**"] for c in checks]
    return md_table(["target", "case", "measured", ""], rows, left=(0, 1, 2, 3))


def print_results(text: str, checks: list[dict[str, Any]], heading: str = "", widths: tuple[int, int] = (48, 40)) -> None:
    """Print a results table (under ``heading``, if any) and the verdict of each target, one line each."""
    print("\n" + (f"{heading}:\n" if heading else "") + text + "\n")
    print("\n".join(f"{_mark(c['pass'])}  {c['target']:<{widths[0]}} {c['case']:<{widths[1]}} {c['value']}" for c in checks))


# --- the one chart -------------------------------------------------------------------------------


def default_color(row: Row) -> str:
    """Grey for the physical limits (raw reads, writes, copies), blue for ckpttool, red for the rest
    (plain torch, the tools compared with)."""
    name = row.get("case", "")
    return "#888888" if name.startswith(("raw", "crc", "cp")) else "#1f77b4" if name.startswith("ckpt") else "#d62728"


def chart(plt, c: Chart, res: dict[str, Any]):
    """The figure of one set: for each split value, each panel's bars (first case on top), the
    target line where the panel has one; returns ``(figure, title)``."""
    rows = [r for r in res["rows"] if not r.get("failed")]
    splits = sorted({r[c.split] for r in rows}, key=lambda v: v != "cold") if c.split else [None]
    color = c.color or default_color
    fig, axes = plt.subplots(1, len(c.panels) * len(splits), figsize=(6.5 * len(c.panels) * len(splits), 5.5), squeeze=False)
    for j, split in enumerate(splits):
        rs = [r for r in rows if c.split is None or r[c.split] == split]
        for k, panel in enumerate(c.panels):
            ax = axes[0][j * len(c.panels) + k]
            y = list(range(len(rs)))
            colors = [color(r) for r in rs]
            shift, height = (0.2, 0.4) if panel.also else (0.0, 0.8)
            ax.barh([i - shift for i in y], [r.get(panel.key) or 0 for r in rs], height=height, color=colors,
                    label=panel.legend[0] or None)
            if panel.also:
                ax.barh([i + shift for i in y], [r.get(panel.also) or 0 for r in rs], height=height, color=colors, alpha=0.4,
                        label=panel.legend[1] or None)
            if panel.note:
                for i, r in enumerate(rs):
                    ax.text(r.get(panel.key) or 0, i, " " + panel.note(r), va="center", fontsize=7)
            lim = panel.limit(res) if panel.limit else None
            if lim is not None:
                ax.axvline(lim, color="r", ls="-.", label=panel.limit_label)
            if panel.log:
                ax.set_xscale("log")
            ax.set_yticks(y)
            ax.set_yticklabels([r["label"] for r in rs], fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(panel.xlabel)
            ax.grid(axis="x", alpha=0.3, which="both")
            if split is not None:
                ax.set_title(f"{c.split} {split}", fontsize=9)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    m = res["machine"]
    brief = f"{m.get('cpus')} cores, {m.get('mem_total_gib')} GiB RAM, {m.get('disk_fs')} on {m.get('disk_device')}"
    return fig, f"{c.title(res)}: {brief}, torch {res.get('torch')}"


def plot_file(path: str, c: Chart, res: dict[str, Any]) -> str:
    """Write ``c``'s figure of ``res`` to ``path`` (PNG); returns the line to print. matplotlib is not
    a project dependency: without it, this says so instead of failing the run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    if not any(not r.get("failed") for r in res["rows"]):
        return "no case succeeded: no plot"
    fig, title = chart(plt, c, res)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"
