"""Benchmark: loading a checkpoint into FSDP2 / HSDP models on the same and on other world sizes.

A ~1 GB state (fp32 params + AdamW exp_avg + exp_avg_sq) is saved with ckpttool's Checkpointer
(sync) from 2 gloo CPU ranks; for comparison, the same-size state is also saved natively at every
target layout (1, 3, 4 ranks and HSDP 2x2), so each resharding load can be compared with a load
that needs no resharding on the same number of ranks. Every case is a fresh set of rank processes
(bundled Transformer built with ``build_fsdp_model`` on the target mesh, AdamW state created before
the clock starts) that times

  dcp.load        plain torch: ``get_state_dict``, ``dcp.load``, ``set_state_dict`` (no checks)
  load, no checks ``Checkpointer.load(model, optimizer, verify=False)``
  load            ``Checkpointer.load(model, optimizer)``: every record's CRC-32 and the manifest
                  checked (barrier to barrier, slowest rank)
  verify_loaded   ``ckpttool.verify_loaded(model, optimizer, path)`` right after it

first with the page cache dropped before the processes start (cold; rank 0 drops the page cache
again, and all ranks wait for it, before each of the other loads and before verify_loaded, so
every cold figure reads cold), then the same loads and check again in the same processes (warm:
every byte was just read). Peak RSS per rank (VmHWM, reset before each phase) and of the whole
process tree (sum of the processes' anonymous + shmem pages, both phases together).

Each case runs ``--repeat`` times; the run with the smallest load time is reported, every value
of a row (verify time and memory included) from that run; the JSON keeps each key's value in every
run (``KEY_all``).

    .venv/bin/python bench/load.py --size 1 --md docs/bench/load.md --plot docs/img/bench-load.png

Targets: a resharding load <= 1.1x the load of the same-size checkpoint saved on that layout;
verify_loaded <= 1x the load time (issue "resharding loads"); the checks a load makes by default
cost <= 10% over plain ``dcp.load`` of the same checkpoint on the same ranks (issue "trust"). 3 and 4 ranks on a 2-core machine are
oversubscribed (the ranks share the cores): both sides of each comparison run on the same ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB, MiB, add_run_args, best_of, cache_states, can_drop_caches, drop_caches, f, failed_row, json_path, md_header,
    now, parser, pick_smallest, plot_file, print_results, proc_status, raw_read, remove, reset_peak_rss, run_header,
    start_run, table, verdict_md, wait_for_convert, write_json, write_markdown,
)
from _dist import (  # noqa: E402
    add_rank_args, checkpoint, dcp_dir_of, dcp_files, finish_rank, gen_mode, init_rank, measure_ranks, mesh_label,
    mesh_world, model_dims, rank_results, remove_checkpoint,
)

SCRIPT = os.path.abspath(__file__)


def proc_io(field_name: str) -> int:
    """A counter of ``/proc/self/io`` (``rchar``: bytes this process's read calls returned)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field_name + ":"))
SAVED_ON = "2"


def rank_case(args) -> None:
    """One rank of a case: build the model on the target mesh, then per cache state time the load
    and verify_loaded, each barrier to barrier with its own peak RSS."""
    init_rank(args)
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckpttool import Checkpointer, verify_loaded
    from ckpttool.trainer.model import ModelConfig, build_fsdp_model
    from _dist import make_mesh, state_nbytes

    cfg = ModelConfig(**json.loads(args._cfg))
    mesh = make_mesh(args._mesh)
    t = time.perf_counter()
    model = build_fsdp_model(cfg, mesh, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    msd, osd = get_state_dict(model, optimizer)  # creates the AdamW state: not part of the load
    rank_bytes = state_nbytes({"model": msd, "optim": osd})
    del msd, osd
    build_s = time.perf_counter() - t
    ck = Checkpointer(args._root)
    step_dir = os.path.join(args._root, f"step-{ck.steps()[-1]}")
    phases: dict[str, Any] = {}
    ok = True

    def recool(phase: str) -> bool:
        """Cold phase: the previous load read every byte, so drop the page cache again."""
        dropped = False
        if phase == "cold":
            if dist.get_rank() == 0 and can_drop_caches():
                dropped = drop_caches()
            dist.barrier()
        return dropped

    def plain_dcp_load() -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=step_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def timed_barrier(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    for phase in args._phases.split(","):  # cold (cache dropped by the parent) first, then warm: the same loads again
        dcp_s = timed_barrier(plain_dcp_load)
        recool(phase)
        nocheck_s = timed_barrier(lambda: ck.load(model, optimizer, verify=False))
        recool(phase)
        dist.barrier()
        rss0 = reset_peak_rss()
        read0 = proc_io("rchar")
        t0 = time.perf_counter()
        res = ck.load(model, optimizer)
        dist.barrier()
        load_s = time.perf_counter() - t0
        load_read = proc_io("rchar") - read0
        load_hwm = proc_status("VmHWM") or 0

        verify_dropped = recool(phase)  # the load just read every byte: drop it again, so verify reads cold too
        dist.barrier()
        rss1 = reset_peak_rss()
        t1 = time.perf_counter()
        report = verify_loaded(model, optimizer, res.path)
        dist.barrier()
        verify_s = time.perf_counter() - t1
        verify_hwm = proc_status("VmHWM") or 0
        ok = ok and bool(report.ok)
        phases[phase] = {
            "ok": bool(report.ok), "mismatches": len(report.mismatches), "tensors_checked": report.tensors_checked,
            "load_s": load_s, "dcp_s": dcp_s, "nocheck_s": nocheck_s,
            "verify_s": verify_s, "verify_cache_dropped": verify_dropped, "rss_before_load_kib": rss0, "load_hwm_kib": load_hwm,
            "rss_before_verify_kib": rss1, "verify_hwm_kib": verify_hwm, "step": res.step, "load_read_bytes": load_read,
        }
    finish_rank(args, {"ok": ok, "phases": phases, "build_s": build_s, "rank_state_bytes": rank_bytes, "torch": torch.__version__})


# --- the parent ----------------------------------------------------------------------------------


def measure(name: str, mesh: str, root: str, cfg: dict[str, int], caches: list[str], args, work: str) -> dict[str, dict[str, Any]]:
    """One fresh set of ranks per (layout, checkpoint): the cold load first (cache dropped before the
    processes start), then the same load again, warm (every byte was just read)."""
    files = dcp_files(dcp_dir_of(root))
    dropped = False
    if caches[0] == "cold":
        dropped = drop_caches()
    else:
        raw_read(files)  # every byte of the checkpoint in the page cache
    run = measure_ranks(SCRIPT, mesh_world(mesh), ["--_case", "load", "--_root", root, "--_mesh", mesh, "--_cfg", json.dumps(cfg),
                                                   "--_phases", ",".join(caches)], work, name, timeout_s=args.case_timeout)
    ranks = rank_results(name, run)
    if ranks is None:
        return {c: {"ok": False, "rc": run.rc} for c in caches}
    out = {}
    for cache in caches:
        ph = [r["phases"][cache] for r in ranks]
        mx = lambda k: max(x[k] for x in ph)  # noqa: E731
        out[cache] = {
            "ok": True, "cache_dropped": dropped and cache == "cold", "load_s": mx("load_s"), "verify_s": mx("verify_s"),
            "dcp_s": mx("dcp_s"), "nocheck_s": mx("nocheck_s"),
            "verify_cache_dropped": any(x.get("verify_cache_dropped") for x in ph),
            "build_s": max(r["build_s"] for r in ranks), "rank_state_bytes": max(r["rank_state_bytes"] for r in ranks),
            "rank_load_peak_kib": mx("load_hwm_kib"),
            "rank_load_added_kib": max(x["load_hwm_kib"] - x["rss_before_load_kib"] for x in ph),
            "rank_verify_added_kib": max(x["verify_hwm_kib"] - x["rss_before_verify_kib"] for x in ph),
            "rank_peak_kib": max(max(x["load_hwm_kib"], x["verify_hwm_kib"]) for x in ph),
            "tree_peak_kib": run.peak_kib, "process_wall_s": run.wall_s, "tensors_checked": ph[0]["tensors_checked"],
            # every byte the ranks' read calls returned during the checked load (rchar: page cache or disk),
            # against the bytes of state they hold: what a rank needs
            "read_bytes": sum(x["load_read_bytes"] for x in ph), "needed_bytes": sum(r["rank_state_bytes"] for r in ranks),
        }
    return out


def derive(results: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of the table (cold cases first; ratios to the load on the same layout and to the
    load on the source's ranks) and the verdict on each target."""
    nbytes = results["checkpoint"]["state_bytes"]
    cases = results["cases"]
    rows, checks = [], []
    order = sorted(cases, key=lambda k: (k.split("|")[2] != "cold", list(cases).index(k)))
    for key in order:
        c = cases[key]
        mesh, src, cache = key.split("|")
        if not c.get("ok"):
            rows.append({"key": key, "mesh": mesh, "src": src, "cache": cache, "failed": True})
            continue
        matched = cases.get(f"{mesh}|{mesh}|{cache}", {})
        same = cases.get(f"{SAVED_ON}|{SAVED_ON}|{cache}", {})
        row = {"key": key, "mesh": mesh, "src": src, "cache": cache, "load_s": c["load_s"], "gbps": nbytes / c["load_s"] / GB,
               "x_matched": c["load_s"] / matched["load_s"] if matched.get("ok") and src != mesh else None,
               "x_same2": c["load_s"] / same["load_s"] if same.get("ok") else None,
               "verify_s": c["verify_s"], "verify_x_load": c["verify_s"] / c["load_s"],
               "dcp_s": c["dcp_s"], "nocheck_s": c["nocheck_s"], "x_dcp": c["load_s"] / c["dcp_s"],
               "x_nocheck": c["load_s"] / c["nocheck_s"],
               "rank_peak_mib": c["rank_peak_kib"] / 1024, "load_added_mib": c["rank_load_added_kib"] / 1024,
               "verify_added_mib": c["rank_verify_added_kib"] / 1024, "rank_state_mib": c["rank_state_bytes"] / MiB,
               "tree_peak_mib": c["tree_peak_kib"] / 1024, "ranks": mesh_world(mesh),
               "read_x_needed": c["read_bytes"] / c["needed_bytes"] if c.get("read_bytes") is not None else None}
        rows.append(row)
        tag = f"{mesh_label(mesh)} from {mesh_label(src)}, {cache}"
        if row["x_matched"] is not None:
            checks.append({"target": "resharding load <= 1.1x the same-size load", "case": tag,
                           "value": f"{c['load_s']:.2f} s vs {matched['load_s']:.2f} s = {row['x_matched']:.2f}x",
                           "pass": row["x_matched"] <= 1.1})
        if row["read_x_needed"] is not None:
            checks.append({"target": "bytes a load reads <= 1.1x the bytes its ranks need", "case": tag,
                           "value": f"{c['read_bytes'] / MiB:.0f} MiB for {c['needed_bytes'] / MiB:.0f} MiB = {row['read_x_needed']:.2f}x",
                           "pass": row["read_x_needed"] <= 1.1})
        checks.append({"target": "load with its checks <= 1.1x plain dcp.load", "case": tag,
                       "value": f"{c['load_s']:.2f} s vs {c['dcp_s']:.2f} s = {row['x_dcp']:.2f}x "
                                f"(unchecked {c['nocheck_s']:.2f} s)", "pass": row["x_dcp"] <= 1.1})
        checks.append({"target": "verify_loaded <= 1x the load time", "case": tag,
                       "value": f"{c['verify_s']:.2f} s vs {c['load_s']:.2f} s = {row['verify_x_load']:.2f}x",
                       "pass": row["verify_x_load"] <= 1.0})
    return rows, checks


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    """The results table."""
    head = ["load on", "saved on", "cache", "load s", "GB/s", "dcp.load s", "× dcp.load", "unchecked s", "× unchecked",
            "× same layout", f"× load on {SAVED_ON}", "verify_loaded s",
            "verify / load", "read / needed", "peak RSS/rank MiB", "added by load MiB/rank (rank state)", "added by verify MiB", "tree peak anon+shmem MiB"]
    lines = []
    for r in rows:
        if r.get("failed"):
            lines.append(failed_row(head, mesh_label(r["mesh"]), mesh_label(r["src"]), r["cache"]))
            continue
        lines.append([mesh_label(r["mesh"]), mesh_label(r["src"]), r["cache"], f(r["load_s"]), f(r["gbps"]), f(r["dcp_s"]),
                      f(r["x_dcp"]), f(r["nocheck_s"]), f(r["x_nocheck"]), f(r["x_matched"]),
                      f(r["x_same2"]), f(r["verify_s"]), f(r["verify_x_load"]), f(r["read_x_needed"]), f(r["rank_peak_mib"], ".0f"),
                      f"+{r['load_added_mib']:.0f} ({r['rank_state_mib']:.0f})", f"+{r['verify_added_mib']:.0f}", f(r["tree_peak_mib"], ".0f")])
    return table(head, lines, markdown, left=(0, 1, 2))


def draw(plt, results: dict[str, Any], rows: list[dict[str, Any]]):
    """Load and verify_loaded times of each layout, cold (left) and warm (right)."""
    ok = [r for r in rows if not r.get("failed")]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=False)
    for ax, cache in zip(axes, ("cold", "warm")):
        rs = [r for r in ok if r["cache"] == cache]
        labels = [f"{mesh_label(r['mesh'])}\nfrom {mesh_label(r['src'])}" for r in rs]
        x = range(len(rs))
        colors = ["#1f77b4" if r["src"] == r["mesh"] else "#ff7f0e" for r in rs]
        ax.bar([i - 0.2 for i in x], [r["load_s"] for r in rs], width=0.4, color=colors, label="load (blue: same layout, orange: resharding)")
        ax.bar([i + 0.2 for i in x], [r["verify_s"] for r in rs], width=0.4, color="#2ca02c", label="verify_loaded")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("seconds (slowest rank)")
        ax.set_title(f"page cache {cache}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    m = results["machine"]
    return fig, (f"ckpttool load of {results['checkpoint']['state_bytes'] / GB:.2f} GB (saved on {SAVED_ON} ranks): {m.get('cpus')} cores "
                 f"(3-4 ranks oversubscribe them), {m.get('mem_total_gib')} GiB RAM, torch {results.get('torch')}")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--size", type=float, default=1.0, help="state size in GB (default 1)")
    p.add_argument("--meshes", default="1,3,4,2x2", help="target layouts besides the source's 2 ranks (default 1,3,4,2x2)")
    p.add_argument("--no-matched", action="store_true", help="skip the checkpoints saved natively on each target layout")
    p.add_argument("--caches", default="cold,warm", help="cache states to load in, in the same processes (default cold,warm)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each case; the one with the smallest load time is reported (default 2)")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the generated checkpoints")
    p.add_argument("--no-wait", action="store_true", help="do not wait for a running bench/convert.py")
    add_run_args(p, "load", "/tmp/ckpttool-bench-load")
    add_rank_args(p, "--_case", "--_root", "--_mesh", "--_cfg", "--_phases", gen=True)
    args = p.parse_args(argv)

    if gen_mode(args):
        return 0
    if args._rank is not None:
        rank_case(args)
        return 0

    out_dir, work, machine = start_run(args.out_dir)
    caches = sorted(cache_states(args.caches), key=lambda c: c != "cold")  # cold first
    out_json = json_path(args, out_dir, "load")
    cfg = model_dims(args.size)
    wait_for_convert(args.size, args.no_wait)
    targets = [m for m in args.meshes.split(",") if m]
    layouts = [SAVED_ON] + ([] if args.no_matched else targets)
    roots: dict[str, str] = {}
    infos: dict[str, Any] = {}
    for mesh in layouts:
        roots[mesh], infos[mesh] = checkpoint(SCRIPT, out_dir, args.size, mesh, args.keep, work)
    info = infos[SAVED_ON]
    print(f"   {info['params'] / 1e6:.1f}M params, {info['state_bytes'] / GB:.2f} GB of state; ckpttool save on {SAVED_ON} ranks: "
          f"{info['save_s']:.1f} s", flush=True)
    results: dict[str, Any] = {
        **run_header(SCRIPT, argv, machine), "repeat": args.repeat, "checkpoint": info,
        "cfg": cfg, "torch": info.get("torch"), "cases": {},
    }
    plan = [(SAVED_ON, SAVED_ON)] + [(m, SAVED_ON) for m in targets]
    if not args.no_matched:
        plan += [(m, m) for m in targets]
    runs: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(args.repeat):  # one set of ranks measures every cache state: not one case per run
        for mesh, src in plan:
            out = measure(f"{mesh}_from_{src}", mesh, roots[src], cfg, caches, args, work)
            for cache, r in out.items():
                runs.setdefault(f"{mesh}|{src}|{cache}", []).append(r)
                if r.get("ok"):
                    print(f"   [{rnd + 1}/{args.repeat}] {cache} load on {mesh_label(mesh):<13} from {mesh_label(src):<13} "
                          f"load {r['load_s']:6.2f} s (dcp.load {r['dcp_s']:6.2f}, unchecked {r['nocheck_s']:6.2f})  "
                          f"verify_loaded {r['verify_s']:6.2f} s  peak/rank {r['rank_peak_kib'] / 1024:5.0f} MiB "
                          f"(build {r['build_s']:.1f} s)", flush=True)
    results["cases"] = {k: best_of(rs, ["load_s", "verify_s", "build_s", "dcp_s", "nocheck_s"],
                                   ["rank_peak_kib", "rank_load_added_kib", "rank_verify_added_kib", "tree_peak_kib"],
                                   pick=pick_smallest("load_s")) for k, rs in runs.items()}
    results["all_runs"] = runs
    rows, checks = derive(results)
    results["rows"], results["checks"] = rows, checks
    results["finished"] = now()
    write_json(out_json, results)
    print_results(render(rows, markdown=False), checks)
    print(f"\nresults: {out_json}")
    write_markdown(args.md, md_header("Benchmark: loading on the same and on other layouts", results)
                   + render(rows, markdown=True) + "\n\n" + verdict_md(checks) + "\n")
    if args.plot:
        print(plot_file(args.plot, draw, results, rows))
    if not args.keep:
        for root in roots.values():
            remove_checkpoint(root)
    remove(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
