"""Benchmark: offline commands on N = 1 and 2 workers (``--nproc``), on the local disk and on S3.

Each case is the real command line (``python -m ckpttool ... --nproc N``) in a fresh process tree, timed from spawn to
exit (interpreter, imports and the workers' start-up included: what a user waits for), with the peak memory of the
whole tree (``_common.run_child``). The page cache is dropped before each local case (as root). Every output of N = 2
is compared byte for byte with N = 1's (verify: its printed report). ``--nproc N`` starts only the workers that pay for
their start (``ckpttool.parallel.plan_workers``): the rows "N" are what a user gets (the row says how many workers ran,
and the check is that it ran the faster of one process and N workers, by the median of the runs), the rows "N!" start N
whatever the work (``CKPTTOOL_SPLIT=always``). The S3 cases run against ``moto_server`` on
loopback (warm: the server is the bottleneck), reading a DCP checkpoint uploaded first; they are opt-in (``--s3``):
moto serves ranged GETs of large objects so slowly that a 1 GB reshard did not finish in 6.5 minutes.

    .venv/bin/python bench/parallel.py --size 1 --md docs/bench/parallel.md

On this machine (2 cores, one virtio disk) little gain is expected: the figures are the measured points of
docs/scaling.md's model (per-worker throughput), not a claim of speed-up here.
"""

import contextlib
import hashlib
import os
import sys
from importlib.metadata import version
from typing import Any

from _common import GB, drop_caches, remove, report_failure, run_child
from harness import Column, Set, Spec, check, main


def digest_tree(path: str) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of the file), by relative name."""
    out = {}
    for full in sorted([path] if os.path.isfile(path) else [os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns]):
        h = hashlib.sha256()
        with open(full, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
        out[os.path.relpath(full, path) if full != path else "."] = h.hexdigest()
    return out


def measure(run, key: str, argv: list[str], dst: str | None, env: dict[str, str] | None, s3) -> dict[str, Any]:
    """One command line on N workers (S3: ``s3`` is the bucket's filesystem): the local cases cold (unless
    --warm); the digest of its output, or of what it printed where it writes none. N with a ``!``: the N workers start
    whatever the work (``CKPTTOOL_SPLIT=always``); without, ``--nproc`` chooses, and the row says how many ran."""
    name, asked = key.rsplit(" N=", 1)
    n = asked.rstrip("!")
    env = {**(env or os.environ), "CKPTTOOL_SPLIT": "always" if asked.endswith("!") else "auto"}
    if s3 is None and dst:
        remove(dst)
    elif dst and s3.exists(dst):
        s3.rm(dst, recursive=True)
    if s3 is None and run.cold:
        drop_caches()
    tag = f"{'s3-' if s3 else ''}{argv[0]}-n{n}{'-always' if asked.endswith('!') else ''}"
    proc = run_child([sys.executable, "-m", "ckpttool", *argv, "--nproc", n], os.path.join(run.work, f"{tag}.result.json"),
                     os.path.join(run.work, f"{tag}.log"), env=env, timeout_s=run.args.case_timeout)
    with open(os.path.join(run.work, f"{tag}.log")) as f:
        said = [line for line in f if line.startswith("ckpttool: --nproc")]  # how many it ran, and why, if not N
    ran = 1 if any("running in one process" in line for line in said) else int(n)
    for line in said:
        if " workers: " in line:
            ran = int(line.split("running ", 1)[1].split(" ", 1)[0])
    r = {"ok": proc.rc in (0, 1), "name": name, "nproc": asked, "ran": ran, "said": "".join(said).strip(), "rc": proc.rc, "seconds": proc.wall_s, "peak_kib": proc.peak_kib,
         "user_s": proc.user_s, "sys_s": proc.sys_s}
    if not r["ok"]:
        report_failure(key, proc)
        r["log_tail"] = proc.log_tail[-2000:]
    elif not dst:
        with open(os.path.join(run.work, f"{tag}.log"), "rb") as f:  # what it printed, less the line on the workers it ran
            r["stdout_digest"] = hashlib.sha256(b"".join(line for line in f if not line.startswith(b"ckpttool: --nproc"))).hexdigest()
    elif proc.rc == 0 and s3 is not None:
        r["digest"] = {os.path.relpath(p, dst): s3.info(p).get("ETag", "") for p in sorted(s3.find(dst)) if not p.endswith("/")}
    elif proc.rc == 0:
        r["digest"] = digest_tree(dst)
        remove(dst)
    return r


def sets(run):
    """The checkpoint (or --src); the commands on it for each N, then (--s3) on its copy on S3."""
    args, reshard, hf = run.args, os.path.join(run.work, "outputs", "reshard"), os.path.join(run.work, "outputs", "hf")
    src, info = run.checkpoint(args.size, "2")
    info.setdefault("torch", version("torch"))
    nprocs = args.nprocs.split(",")
    local = {  # name: (command line without --nproc, output)
        f"reshard 2 -> {args.worlds} ranks": (["reshard", src, reshard, "--world-size", str(args.worlds)], reshard),
        "convert -> HF-sharded safetensors (500MB shards)": (["convert", src, hf, "--to", "safetensors", "--max-shard-size", "500MB"], hf),
        "verify (integrity)": (["verify", src, "--json"], None)}
    cases = {f"{name} N={n}": (argv, dst, None, None) for name, (argv, dst) in local.items() for n in nprocs}
    with contextlib.ExitStack() as stack:  # the S3 server, if any, stopped when the set is done
        if args.s3:
            import fsspec

            from s3 import CREDENTIALS, moto

            endpoint = stack.enter_context(moto(os.path.join(run.work, "moto.log")))
            env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
            s3 = fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=endpoint, key="bench", secret="bench")
            s3.mkdir("bench")
            s3.put(src.rstrip("/") + "/", "bench/src/", recursive=True)
            for n in nprocs:
                cases[f"s3: reshard 2 -> 4 ranks (S3 -> S3) N={n}"] = (["reshard", "s3://bench/src", f"s3://bench/reshard-n{n}",
                                                                       "--world-size", "4"], f"bench/reshard-n{n}", env, s3)
                cases[f"s3: verify N={n}"] = (["verify", "s3://bench/src", "--json"], None, env, s3)
        yield Set(list(cases), lambda k: measure(run, k, *cases[k]),
                  lambda k, r: f"{r['name']:<48} N={r['nproc']}  {r['seconds']:6.1f} s  peak {r['peak_kib'] / 1024:6.0f} MiB  rc {r['rc']}",
                  heading=f"{info['file_bytes'] / GB:.2f} GB DCP checkpoint saved on 2 ranks; {'cold' if run.cold else 'warm'} page cache "
                          f"for the local cases; S3 = moto_server on loopback, warm", info=info)


def derive(res: dict[str, Any], run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per command, each N's row: the workers that ran, its time against N = 1's, and whether its output is N = 1's;
    and the check that ``--nproc`` as it chooses (N without ``!``) is not slower than one process."""
    by_name: dict[str, dict[str, dict[str, Any]]] = {}
    for key, c in res["cases"].items():
        name, asked = key.rsplit(" N=", 1)
        by_name.setdefault(name, {})[asked] = c
    rows, checks = [], []
    for name, by_n in by_name.items():
        base = by_n.get("1")
        for asked, c in sorted(by_n.items(), key=lambda kv: (int(kv[0].rstrip("!")), kv[0])):
            if not c.get("ok"):
                rows.append({"case": name, "nproc": asked, "failed": True})
                continue
            kind = next((k for k in ("digest", "stdout_digest") if k in c), None)
            same = "–" if asked == "1" or not base or not kind else "yes" if c[kind] == base.get(kind) else "NO"
            ratio = 1.0 if base is None else c["seconds"] / base["seconds"] if base.get("ok") else None  # (no N = 1 run: 1.0)
            rows.append({"case": name, "nproc": asked, "ran": str(c.get("ran", asked.rstrip("!"))), "seconds": c["seconds"],
                         "cpu_s": c["user_s"] + c["sys_s"], "peak_mib": c["peak_kib"] / 1024, "same": same, "ratio": ratio})
            forced = by_n.get(asked + "!")
            if asked != "1" and not asked.endswith("!") and base is not None and forced is not None and forced.get("ok"):
                # what --nproc chose against the faster of its two choices (one process, N workers), medians of the runs
                one, many = median_s(res, f"{name} N=1"), median_s(res, f"{name} N={asked}!")
                split = int(c.get("ran", 1)) > 1
                checks.append(check(f"--nproc {asked} runs the faster of 1 process and {asked} workers (medians)", name,
                                    f"ran {c.get('ran')}: 1 process {one:.1f} s, {asked} workers {many:.1f} s",
                                    (many <= one) if split else (one <= many)))
    return rows, checks


def median_s(res: dict[str, Any], key: str) -> float:
    """The median wall time of a case's good runs."""
    times = sorted(r["seconds"] for r in res["all_runs"][key] if r.get("ok"))
    return times[len(times) // 2] if len(times) % 2 else (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2


SPEC = Spec("parallel", "Benchmark: offline commands on N workers", __doc__, os.path.abspath(__file__), sets, derive,
            options={"--size": dict(type=float, default=1.0, help="checkpoint size in GB (default 1)"),
                     "--nprocs": dict(default="1,2,2!", help="worker counts; N! starts N whatever the work (default 1,2,2!)"),
                     "--worlds": dict(type=int, default=4, help="reshard's target world size (default 4)"),
                     "--src": dict(help="use this existing DCP checkpoint instead of writing one"),
                     "--s3": dict(action="store_true",
                                  help="also reshard and verify on S3 (moto_server on loopback: slow, see docs/scaling.md)")},
            columns=[Column("case", "case", None), Column("--nproc", "nproc", None), Column("workers ran", "ran", None),
                     Column("wall s", "seconds", ".1f"),
                     Column("× N=1", "ratio"), Column("CPU s (user+sys)", "cpu_s", ".1f"), Column("peak MiB (tree)", "peak_mib", ".0f"),
                     Column("same bytes as N=1", "same", "")],
            flags=("keep", "warm"), repeat=3,  # exit 1: an output of N > 1 is not N = 1's, or a command failed
            exit=lambda results: int(any(r.get("failed") or r["same"] == "NO" for s in results["sets"] for r in s["rows"])
                                     or any(not c["pass"] for s in results["sets"] for c in s.get("checks", ()))))

main(SPEC, __name__)
