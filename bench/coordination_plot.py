"""The plot of ``bench/coordination.py`` runs: rank 0's commit time, its peak memory, the bytes of
``.metadata`` (ckpttool's and torch's) and one rank's load plan, against the ranks, one line per
run given (an earlier commit's run beside the latest), torch's own planning where it ran, and the
issue's targets. matplotlib is not a project dependency: run it from an environment that has it.

    python bench/coordination_plot.py docs/img/bench-coordination.png before.json:afc1238 after.json:HEAD
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = argv[0], [a.rsplit(":", 1) for a in argv[1:]]
    fig, axes = plt.subplots(1, 4, figsize=(20, 5))
    panels = [("rank 0's commit (s)", lambda r: r.get("commit", {}).get("commit_s"), [(4096, 2.0)]),
              ("rank 0's commit, peak RSS (GB)", lambda r: (r.get("commit", {}).get("peak_mb") or 0) / 1e3 or None, [(16384, 2.0)]),
              (".metadata (MB)", lambda r: (r.get("commit", {}).get("metadata_bytes") or 0) / 1e6 or None, []),
              ("one rank's load plan (s)", lambda r: r.get("load", {}).get("load_s"), [(16384, 0.5)])]
    styles = ["o--", "s-", "^-", "d-"]
    for (path, label), style in zip(runs, styles):
        with open(path) as f:
            rows = json.load(f)["rows"]
        for (title, get, _), ax in zip(panels, axes):
            pts = [(r["n"], get(r)) for r in rows if get(r)]
            if pts:
                ax.plot(*zip(*pts), style, label=f"ckpttool {label}")
    rows = []  # torch's figures: from the latest run that measured them
    for path, _ in reversed(runs):
        with open(path) as f:
            rows = json.load(f)["rows"]
        if any(r.get("torch", {}).get("metadata_bytes") for r in rows):
            break
    torch_md = [(r["n"], r["torch"]["metadata_bytes"] / 1e6) for r in rows if r.get("torch", {}).get("metadata_bytes")]
    torch_plan = [(r["n"], r["torch"]["plan_s"]) for r in rows if r.get("torch", {}).get("plan_s")]
    if torch_md:
        axes[2].plot(*zip(*torch_md), "x:", color="grey", label="torch dcp.save (same state)")
    if torch_plan:
        axes[0].plot(*zip(*torch_plan), "x:", color="grey", label="torch's global save planning")
    for (title, _, targets), ax in zip(panels, axes):
        for n, value in targets:
            ax.plot([n], [value], "r*", markersize=12, label=f"target at {n:,} ranks")
        ax.set(xscale="log", yscale="log", xlabel="ranks", title=title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("Coordination at scale: Llama-3-8B FSDP2 + AdamW (fp32), simulated ranks, 2 cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"plot written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
