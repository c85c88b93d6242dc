"""The one pipeline of every benchmark in ``bench/``: a script is a :class:`Spec` and ``main(SPEC, __name__)``. Options
-> (a child process: its case, a rank, a generator rank, and out) -> OUT_DIR and the machine's facts -> for each
:class:`Set` the script yields (a checkpoint and the cases on it): interleaved rounds, one representative run per case
(:func:`best_of`), rows and verdicts (``spec.derive``), the JSON rewritten -> text tables and verdicts, ``--md``,
``--plot`` (:func:`plot_file`) -> what it wrote removed, also on an error or SIGTERM -> ``spec.exit``'s status. Standard
library only at import time, like ``_common.py`` and ``_dist.py``: the parent stays small.
"""

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from _common import GB, ChildRun, cache_states, child_argv, machine_facts, read_json, remove, report_failure, run_child, write_json
from _dist import dcp_dir_of, dcp_files, finish_rank, gen_rank, init_rank, measure_ranks, mesh_label, mesh_world, model_dims

Row = dict[str, Any]


@dataclass
class Column:
    """A table column: ``key`` of a row (or a function of it) in ``fmt``; ``fmt=None``: text, left-aligned, kept in a failed row."""
    head: str
    key: str | Callable[[Row], Any]
    fmt: str | None = ".2f"

    def cell(self, row: Row) -> str:
        return f(self.key(row) if callable(self.key) else row.get(self.key), self.fmt)


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
    """A script's figure: its panels side by side, once per value of the row key ``split`` (a cache state) if given;
    bars coloured by ``color(row)``; the title is ``title(set)`` after the machine. ``more(pyplot, path, set)``: a
    figure of its own beside it (large.py's lines over time), its path returned if written."""
    panels: list[Panel]
    title: Callable[[dict[str, Any]], str]
    split: str | None = None
    color: Callable[[Row], str] | None = None
    more: Callable[[Any, str, dict[str, Any]], str | None] | None = None


@dataclass
class Set:
    """One table of a run: the cases measured on one checkpoint (``info``, its facts), in rounds. ``measure(case)``
    runs one case and returns its result (``ok`` true when it worked); ``explode(case, result)`` splits one run into
    several cases' results (a load measuring every cache state in the same processes); ``line(case, result)`` is its
    progress line; ``after_round()`` runs after each round. ``time_keys``/``peak_keys``/``pick``: as :func:`best_of`."""
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
    """A benchmark: ``sets(run)`` yields what to measure, one :class:`Set` at a time (a checkpoint is written when its
    set comes); ``derive(set, run)`` gives a measured set's rows and verdicts; ``options``: its own, flag -> keyword
    arguments of ``add_argument``, and ``flags``, the shared ones of :data:`FLAGS` it takes; ``child(args)`` is a case in
    a child process (returns its result), ``rank(args)`` a rank of a multi-rank case, ``hidden`` their extra options;
    ``epilogue(results)``: text printed and written after the tables; ``exit(results)``: a run's exit status (else 0)."""
    name: str
    title: str
    doc: str
    script: str
    sets: Callable[["Run"], Iterable[Set]]
    derive: Callable[[dict[str, Any], "Run"], tuple[list[Row], list[dict[str, Any]]]]
    columns: list[Column]
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    chart: Chart | None = None
    child: Callable[[argparse.Namespace], dict[str, Any]] | None = None
    rank: Callable[[argparse.Namespace], None] | None = None
    hidden: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    epilogue: Callable[[dict[str, Any]], str] | None = None
    exit: Callable[[dict[str, Any]], int] | None = None
    repeat: int = 2
    case_timeout: float = 1800
    verdict_widths: tuple[int, int] = (48, 40)


class Run:
    """What a script's sets see: the options, OUT_DIR, the work folder, the machine's facts, whether the cache is
    dropped before a case (unless --warm, where it can be: root, else said), the checkpoints written (removed at
    the end unless --keep) and ``extra`` keys for the results JSON."""

    def __init__(self, spec: Spec, args: argparse.Namespace) -> None:
        self.spec, self.args = spec, args
        self.out_dir = os.path.abspath(args.out_dir)
        self.work = os.path.join(self.out_dir, "work")
        os.makedirs(self.work, exist_ok=True)
        self.machine = machine_facts(self.out_dir)
        print(f"machine: {json.dumps(self.machine)}", flush=True)
        self.cold = not getattr(args, "warm", False) and "cold" in cache_states("cold", "running warm")
        self.made, self.extra = [], {}  # paths removed at the end; keys for the results JSON

    def checkpoint(self, size_gb: float, mesh: str = "2", cfg: dict[str, int] | None = None, how: str = "ckpttool",
                   name: str = "") -> tuple[str, Row]:
        """The DCP directory to measure and its facts, with ``file_bytes``: ``--src``'s (facts: ``SRC.json``, if any), else
        one of ``size_gb`` GB (``cfg``, by default :func:`model_dims`'s) saved on ``mesh`` by ``how`` (ckpttool: a training
        root; dcp: a DCP directory) as OUT_DIR/``name`` (facts: ``NAME.json``; an earlier one reused with ``--keep``)."""
        keep, src = getattr(self.args, "keep", False), getattr(self.args, "src", None)
        if src:
            step, info = dcp_dir_of(os.path.abspath(src)), read_json(os.path.abspath(src).rstrip("/") + ".json", {})
        else:
            root = os.path.join(self.out_dir, name or f"ckpt-{size_gb:g}GB-on-{mesh}")
            self.made += [] if keep else [root, root + ".json"]  # removed at the end (also if writing it fails)
            if keep and os.path.exists(root + ".json") and os.path.isdir(root):
                print(f"reusing {root}", flush=True)
                info = read_json(root + ".json")
            else:  # a set-up, not a case: if it fails, the benchmark stops
                print(f"saving {size_gb:g} GB with {how} on {mesh_label(mesh)} ...", flush=True)
                remove(root)
                cfg = cfg or model_dims(size_gb)
                gen = measure_ranks(self.spec.script, mesh_world(mesh), ["--_gen", root, json.dumps(cfg), mesh, how], self.work,
                                    f"gen-{mesh}")
                if gen.rc != 0:
                    raise SystemExit(f"writing the checkpoint {root} failed (exit {gen.rc}):\n{gen.log_tail}")
                info = {**gen.result["ranks"][0], "cfg": cfg, "mesh": mesh, "how": how, "gen_wall_s": gen.wall_s, "path": root}
                write_json(root + ".json", info)
            step = dcp_dir_of(root)
        info["file_bytes"] = sum(os.path.getsize(p) for p in dcp_files(step))  # what a raw read or copy of it moves
        print(f"   {step}: {info['file_bytes'] / GB:.2f} GB of DCP files", flush=True)
        return step, info

    def child(self, name: str, args: list[str]) -> tuple[dict[str, Any], ChildRun]:
        """Run one case of this script in a fresh child (``--_case``; its log ``work/NAME.log``): its
        result with ``ok``, ``rc``, its process tree's ``peak_kib`` and ``process_wall_s``; a failure reported."""
        result = os.path.join(self.work, f"{name}.result.json")
        run = run_child(child_argv(self.spec.script, *args, "--_result", result), result, os.path.join(self.work, f"{name}.log"),
                        timeout_s=self.args.case_timeout)
        r = dict(run.result)
        r.update(ok=run.rc == 0 and bool(run.result.get("ok")), rc=run.rc, peak_kib=run.peak_kib, process_wall_s=run.wall_s)
        if not r["ok"]:
            report_failure(name, run)
        return r, run

    def ranks(self, name: str, world: int, args: list[str]) -> tuple[list[dict[str, Any]] | None, ChildRun]:
        """Run one multi-rank case (``world`` ranks of this script): each rank's result, None if any failed (reported)."""
        run = measure_ranks(self.spec.script, world, args, self.work, name, timeout_s=self.args.case_timeout)
        ranks = run.result.get("ranks", []) if run.result else []
        if run.rc != 0 or not ranks or not all(r.get("ok") for r in ranks):
            report_failure(name, run)
            return None, run
        return ranks, run


#: options several benchmarks take (a :class:`Spec`'s ``flags`` names them)
FLAGS: dict[str, dict[str, Any]] = {"warm": dict(action="store_true", help="do not drop the page cache before each case"),
                                    "keep": dict(action="store_true", help="keep (and reuse) the generated checkpoint"),
                                    "budget": dict(default="1GiB", help="ckpttool's --memory-budget (default 1GiB)")}


def main(spec: Spec, module: str = "__main__", argv: list[str] | None = None) -> None:
    """Run the benchmark ``spec`` and exit with its status (``spec.exit(results)``, else 0) if ``module``, the script's
    ``__name__``, is ``"__main__"`` (imported, a script only defines its SPEC). See the module's docstring; the script's
    docstring, how it measures, is its --help."""
    if module != "__main__":
        return
    p = argparse.ArgumentParser(description=spec.doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kw in [*spec.options.items(), *((f"--{flag}", FLAGS[flag]) for flag in spec.flags)]:
        p.add_argument(flag, **kw)
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
    hidden = [(name, {}) for name in ("--_case", "--_src", "--_dst", "--_cfg", "--_mesh", "--_rdzv", "--_result", *spec.hidden)]
    for name, kw in hidden + [("--_rank", {"type": int}), ("--_world", {"type": int}), ("--_gen", {"nargs": 4})]:
        p.add_argument(name, **kw, help=argparse.SUPPRESS)  # what a child process receives
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            report(spec, json.load(fh), args, None)
    elif args._gen:  # a rank of the checkpoint generator
        init_rank(args)
        dst, cfg, mesh, how = args._gen
        finish_rank(args, gen_rank(dst, json.loads(cfg), mesh, how))
    elif args._rank is not None:  # a rank of a case
        spec.rank(args)
    elif args._case:  # a case in its child process
        write_json(args._result, spec.child(args))
    if args.from_json or args._gen or args._rank is not None or args._case:
        return

    def on_term(signum, frame):  # SIGTERM (run_all's, a kill): out through the clean-up below, which a second must not cut short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    run = Run(spec, args)
    out_json = args.json or os.path.join(run.out_dir, f"{spec.name}-results.json")
    command = [os.path.relpath(sys.executable), os.path.relpath(spec.script), *(argv if argv is not None else sys.argv[1:])]
    results: dict[str, Any] = {"command": " ".join(command), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": run.machine,
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
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write_json(out_json, results)
        report(spec, results, args, out_json)
    finally:
        for path in run.made:
            remove(path)
        remove(run.work)
    sys.exit(spec.exit(results) if spec.exit else 0)


def run_rounds(repeat: int, s: Set) -> dict[str, list[dict[str, Any]]]:
    """Every case of ``s`` in ``repeat`` interleaved rounds (the machine's drift touches all alike): its runs; a line per good one."""
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


def best_of(runs: list[Row], time_keys: list[str], peak_keys: list[str], pick: Callable[[list[Row]], Row] | None = None) -> Row:
    """One representative run of a case, ``pick``ed among the successful runs (default: the fastest, the smallest
    ``time_keys[0]``, runs without it last): every value of a row comes from one run. For the spread, each key in
    ``time_keys`` and ``peak_keys`` also gets ``KEY_all``, its value in each successful run in order; ``picked`` is the
    index of the chosen run among them, ``runs`` their number."""
    ok, key = [r for r in runs if r.get("ok")], time_keys[0]
    if not ok:
        return {"failed": True, "runs": runs}
    rep = pick(ok) if pick else min(ok, key=lambda r: r[key] if r.get(key) is not None else float("inf"))
    out = dict(rep)
    for k in [*time_keys, *peak_keys]:
        if any(r.get(k) is not None for r in ok):
            out[k + "_all"] = [r.get(k) for r in ok]
    out.update(picked=next(i for i, r in enumerate(ok) if r is rep), runs=len(ok))
    return out


def check(target: str, case: str, value: str, passed: bool | None) -> dict[str, Any]:
    """A verdict: target, case, the measured value in words, pass/fail (None: a figure without a target)."""
    return {"target": target, "case": case, "value": value, "pass": passed}


def peak_check(tag: str, peak_mib: float, limit_mib: float) -> dict[str, Any]:
    """The offline commands' memory verdict: the peak RSS of the process tree against the budget + 300 MB."""
    return check(f"peak RSS <= budget + 300 MB ({limit_mib:.0f} MiB)", tag, f"{peak_mib:.0f} MiB", peak_mib <= limit_mib)


def report(spec: Spec, results: dict[str, Any], args: argparse.Namespace, out_json: str | None) -> None:
    """Print each set's table and verdicts, one line each; write ``--md`` (what ran, where, when, then
    each set's tables) and ``--plot`` (one file per set, the second and later named with its tag)."""
    m = results.get("machine", {})
    facts = (f"{m.get('cpus')} cores ({m.get('cpu_model', '?')}), {m.get('mem_total_gib')} GiB RAM, swap {m.get('swap_gib')} GiB, "
             f"{m.get('disk_fs')} on {m.get('disk_device')} (rotational: {m.get('disk_rotational')}), kernel {m.get('kernel')}, "
             f"Python {m.get('python')}, torch {results.get('torch')}")
    md = [f"# {spec.title}\n\nCommand (from the repository root): `{results.get('command')}`\n\n"
          f"Run {results.get('started')} – {results.get('finished')} on: {facts}.\n\n"]
    w1, w2 = spec.verdict_widths
    for res in results["sets"]:
        checks = res["checks"]
        print("\n" + (f"{res['heading']}:\n" if res["heading"] else "") + render(spec.columns, res["rows"], markdown=False) + "\n")
        print("\n".join(f"{'INFO' if c['pass'] is None else 'PASS' if c['pass'] else 'FAIL'}  {c['target']:<{w1}} {c['case']:<{w2}} "
                        f"{c['value']}" for c in checks))
        verdicts = [[c["target"], c["case"], c["value"], "–" if c["pass"] is None else "pass" if c["pass"] else "**FAIL**"] for c in checks]
        md.append((f"### {res['heading']}\n\n" if res["heading"] else "") + render(spec.columns, res["rows"], markdown=True) + "\n\n"
                  + md_table(["target", "case", "measured", ""], verdicts, left=(0, 1, 2, 3)) + "\n")
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
            print(plot_file(args.plot if i == 0 else f"{base}-{res['tag'] or i}{ext}", spec.chart, res))


def render(columns: list[Column], rows: list[Row], markdown: bool) -> str:
    """A table of ``rows``; a failed case shows its text columns, then "failed"."""
    lines = []
    for r in rows:
        text = [c.cell(r) for c in columns if c.fmt is None]
        lines.append([*text, "failed"] + [""] * (len(columns) - len(text) - 1) if r.get("failed") else [c.cell(r) for c in columns])
    return md_table([c.head for c in columns], lines, tuple(i for i, c in enumerate(columns) if c.fmt is None), markdown)


def f(x: Any, fmt: str | None = ".2f") -> str:
    """A number in a sentence or cell (``fmt=None``: text), or a dash where there is no value (no reference ran)."""
    return "–" if x is None else str(x) if fmt is None else format(x, fmt)


def md_table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,), markdown: bool = True) -> str:
    """A Markdown table (not ``markdown``: aligned plain text); columns in ``left`` left-aligned, numbers right."""
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i in left else "---:" for i in range(len(head))) + "|"]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = [head, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in lines)


def plot_file(path: str, c: Chart, res: dict[str, Any]) -> str:
    """Write the figure of one set to ``path`` (PNG): for each split value, each panel's bars (first
    case on top; by default grey for the physical limits, blue for ckpttool, red for the rest), the
    target line where the panel has one. Returns the line to print; matplotlib is not a project
    dependency: without it, this says so instead of failing the run."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    rows = [r for r in res["rows"] if not r.get("failed")]
    if not rows:
        return "no case succeeded: no plot"
    splits = sorted({r[c.split] for r in rows}, key=lambda v: v != "cold") if c.split else [None]
    color = c.color or (lambda r: "#888888" if r.get("case", "").startswith(("raw", "crc", "cp"))
                        else "#1f77b4" if r.get("case", "").startswith("ckpt") else "#d62728")
    fig, axes = plt.subplots(1, len(c.panels) * len(splits), figsize=(6.5 * len(c.panels) * len(splits), 5.5), squeeze=False)
    for j, split in enumerate(splits):
        rs = [r for r in rows if c.split is None or r[c.split] == split]
        y, colors = list(range(len(rs))), [color(r) for r in rs]
        for panel, ax in zip(c.panels, axes[0][j * len(c.panels):]):
            shift, height = (0.2, 0.4) if panel.also else (0.0, 0.8)
            bars = [(panel.key, -shift, None, panel.legend[0])] + ([(panel.also, shift, 0.4, panel.legend[1])] if panel.also else [])
            for key, dy, alpha, label in bars:  # the second, lighter, beside the first
                ax.barh([i + dy for i in y], [r.get(key) or 0 for r in rs], height=height, color=colors, alpha=alpha, label=label or None)
            for i, r in enumerate(rs if panel.note else []):
                ax.text(r.get(panel.key) or 0, i, " " + panel.note(r), va="center", fontsize=7)
            lim = panel.limit(res) if panel.limit else None
            if lim is not None:
                ax.axvline(lim, color="r", ls="-.", label=panel.limit_label)
            ax.set(xlabel=panel.xlabel, xscale="log" if panel.log else "linear")
            ax.set_yticks(y, [r["label"] for r in rs], fontsize=8)
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3, which="both")
            if split is not None:
                ax.set_title(f"{c.split} {split}", fontsize=9)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    m = res["machine"]
    brief = f"{m.get('cpus')} cores, {m.get('mem_total_gib')} GiB RAM, {m.get('disk_fs')} on {m.get('disk_device')}"
    fig.suptitle(f"{c.title(res)}: {brief}, torch {res.get('torch')}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    more = c.more(plt, path, res) if c.more is not None else None
    return f"plot written to {path}" + (f"\nplot written to {more}" if more else "")
