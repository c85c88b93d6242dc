"""Benchmark: offline commands on N = 1 and 2 workers (``--nproc``), on the local disk and on S3.

Each case is the real command line (``python -m ckpttool ... --nproc N``) in a fresh process
tree, timed from spawn to exit (interpreter, imports and the workers' start-up included: that is
what a user waits for), with the peak memory of the whole tree (``_common.run_child``). The page
cache is dropped before each local case (as root). Every output of N = 2 is compared byte for
byte with N = 1's. The S3 cases run against ``moto_server`` on loopback (warm: the server is the
bottleneck), reading a DCP checkpoint uploaded first; they are opt-in (``--s3``): moto serves
ranged GETs of large objects so slowly that a 1 GB reshard did not finish in 6.5 minutes.

    .venv/bin/python bench/parallel.py --size 1 --md docs/bench/parallel.md

On this machine (2 cores, one virtio disk) little gain is expected: the figures are the measured
points of docs/scaling.md's model (per-worker throughput), not a claim of speed-up here.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB, add_run_args, cold_cache, drop_caches, md_header, now, parser, remove, run_child, run_header,
    start_run, table, write_json, write_markdown,
)
from _dist import checkpoint, dcp_bytes, dcp_dir_of  # noqa: E402

SCRIPT = os.path.abspath(__file__)
CKPTTOOL = [sys.executable, "-m", "ckpttool"]


def digest_tree(path: str) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of the file), by relative name."""
    out = {}
    files = [path] if os.path.isfile(path) else [os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns]
    for full in sorted(files):
        h = hashlib.sha256()
        with open(full, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
        out[os.path.relpath(full, path) if full != path else "."] = h.hexdigest()
    return out


def cases(src: str, out: str, worlds: int) -> list[tuple[str, list[str], str | None]]:
    """(name, command line without --nproc, output path or None) of every command measured."""
    return [
        (f"reshard 2 -> {worlds} ranks", ["reshard", src, os.path.join(out, "reshard"), "--world-size", str(worlds)], os.path.join(out, "reshard")),
        ("convert -> HF-sharded safetensors (500MB shards)",
         ["convert", src, os.path.join(out, "hf"), "--to", "safetensors", "--max-shard-size", "500MB"], os.path.join(out, "hf")),
        ("verify (integrity)", ["verify", src, "--json"], None),
    ]


def run_case(name: str, argv: list[str], dst: str | None, nproc: int, work: str, cold: bool, env: dict[str, str] | None = None,
             keep: bool = False) -> dict[str, Any]:
    if dst:
        remove(dst)
    if cold:
        drop_caches()
    tag = f"{name.split()[0]}-n{nproc}"
    run = run_child([*CKPTTOOL, *argv, "--nproc", str(nproc)], os.path.join(work, f"{tag}.result.json"),
                    os.path.join(work, f"{tag}.log"), env=env)
    res = {"rc": run.rc, "wall_s": run.wall_s, "peak_mib": run.peak_kib / 1024, "user_s": run.user_s, "sys_s": run.sys_s}
    if run.rc not in (0, 1):
        res["log_tail"] = run.log_tail[-2000:]
    if dst and run.rc == 0 and not dst.startswith("s3://"):
        res["digest"] = digest_tree(dst)
        if not keep:
            remove(dst)
    elif not dst:
        res["stdout_digest"] = hashlib.sha256(open(os.path.join(work, f"{tag}.log"), "rb").read()).hexdigest()
    return res


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = ["case", "workers", "wall s", "× N=1", "CPU s (user+sys)", "peak MiB (tree)", "same bytes as N=1"]
    body = [[r["case"], str(r["nproc"]), f"{r['wall_s']:.1f}", f"{r['ratio']:.2f}", f"{r['cpu_s']:.1f}", f"{r['peak_mib']:.0f}",
             r["same"]] for r in rows]
    return table(head, body, markdown)


def rows_of(results: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for name, by_n in results.items():
        base = by_n.get(1)
        for n, r in sorted(by_n.items()):
            same = "–"
            if n > 1 and base:
                key = "digest" if "digest" in r else "stdout_digest" if "stdout_digest" in r else None
                same = "yes" if key and r.get(key) == base.get(key) else "NO" if key else "–"
            rows.append({"case": name, "nproc": n, "wall_s": r["wall_s"], "ratio": r["wall_s"] / base["wall_s"] if base else 1.0,
                         "cpu_s": r["user_s"] + r["sys_s"], "peak_mib": r["peak_mib"], "same": same, "rc": r["rc"]})
    return rows


def s3_cases(src: str, work: str, nprocs: list[int]) -> dict[str, dict[int, dict[str, Any]]]:
    """Reshard and verify of a DCP checkpoint on S3 (moto_server on loopback), N = 1, 2."""
    from s3 import CREDENTIALS, start_moto

    proc, endpoint = start_moto(os.path.join(work, "moto.log"))
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    out: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        import fsspec

        s3 = fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=endpoint, key="bench", secret="bench")
        s3.mkdir("bench")
        s3.put(src.rstrip("/") + "/", "bench/src/", recursive=True)
        for n in nprocs:
            name = "s3: reshard 2 -> 4 ranks (S3 -> S3)"
            dst = f"s3://bench/reshard-n{n}"
            r = run_case(name, ["reshard", "s3://bench/src", dst, "--world-size", "4"], None, n, work, False, env)
            r.pop("stdout_digest", None)
            if r["rc"] == 0:
                r["digest"] = {p: s3.info(p).get("ETag", "") for p in sorted(s3.find(dst.removeprefix("s3://")))
                               if not p.endswith("/")}
                r["digest"] = {os.path.relpath(k, dst.removeprefix("s3://")): v for k, v in r["digest"].items()}
            out.setdefault(name, {})[n] = r
            out.setdefault("s3: verify", {})[n] = run_case("s3: verify", ["verify", "s3://bench/src", "--json"], None, n, work, False, env)
    finally:
        proc.kill()
        proc.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--size", type=float, default=1.0, help="checkpoint size in GB (default 1)")
    p.add_argument("--nprocs", default="1,2", help="worker counts (default 1,2)")
    p.add_argument("--worlds", type=int, default=4, help="reshard's target world size (default 4)")
    p.add_argument("--src", help="use this existing DCP checkpoint instead of writing one")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the generated checkpoint")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before each local case")
    p.add_argument("--s3", action="store_true",
                   help="also run reshard and verify on S3 (moto_server on loopback; slow: moto serves each ranged GET of a "
                        "large object at a fraction of a core, see docs/scaling.md)")
    add_run_args(p, "parallel", "/tmp/ckpttool-bench-parallel")
    args = p.parse_args(argv)

    out_dir, work, machine = start_run(args.out_dir)
    cold = cold_cache(args.warm)
    made = None
    if args.src:
        src = dcp_dir_of(os.path.abspath(args.src))
    else:
        root, _ = checkpoint(os.path.join(os.path.dirname(SCRIPT), "reshard.py"), out_dir, args.size, "2", args.keep, work)
        made = None if args.keep else root
        src = dcp_dir_of(root)
    nbytes = dcp_bytes(src)
    print(f"{src}: {nbytes / GB:.2f} GB of DCP files", flush=True)
    nprocs = [int(n) for n in args.nprocs.split(",")]
    import torch

    results_all: dict[str, Any] = {**run_header(SCRIPT, argv, machine), "cold": cold, "bytes": nbytes, "cases": {},
                                   "torch": torch.__version__}
    try:
        outputs = os.path.join(out_dir, "outputs")
        os.makedirs(outputs, exist_ok=True)
        for name, cmd, dst in cases(src, outputs, args.worlds):
            for n in nprocs:
                r = run_case(name, cmd, dst, n, work, cold)
                print(f"  {name:<48} N={n}  {r['wall_s']:6.1f} s  peak {r['peak_mib']:6.0f} MiB  rc {r['rc']}", flush=True)
                results_all["cases"].setdefault(name, {})[n] = r
        if args.s3:
            for name, by_n in s3_cases(src, work, nprocs).items():
                results_all["cases"][name] = by_n
                for n, r in by_n.items():
                    print(f"  {name:<48} N={n}  {r['wall_s']:6.1f} s  peak {r['peak_mib']:6.0f} MiB  rc {r['rc']}", flush=True)
    finally:
        if made:
            remove(made)
            remove(made + ".json")
    results_all["finished"] = now()
    rows = rows_of(results_all["cases"])
    results_all["rows"] = rows
    write_json(args.json or os.path.join(out_dir, "parallel.json"), results_all)
    print("\n" + render(rows, markdown=False))
    head = (f"{nbytes / GB:.2f} GB DCP checkpoint saved on 2 ranks; {'cold' if cold else 'warm'} page cache for the local cases; "
            f"S3 = moto_server on loopback, warm")
    write_markdown(args.md, md_header("Benchmark: offline commands on N workers", results_all) + f"\n{head}\n\n" + render(rows, markdown=True) + "\n")
    bad = [r for r in rows if r["same"] == "NO" or r["rc"] not in (0, 1)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
