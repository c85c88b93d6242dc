"""Benchmark: ``ckpttool convert`` to and from ``s3://`` on ``moto_server`` (``moto[server]``, the test extra) on
127.0.0.1, against plain s3fs moving the same bytes and against the same conversions on the local disk.

A state of ``--tensors`` fp32 tensors of ``--tensor-mib`` MiB each, written with ``torch.save``; timed in this one process
(warm page cache: the server is the bottleneck, not the disk): plain s3fs uploading the .pt whole and downloading it whole
(the transport), ckpttool.convert from the .pt to a DCP checkpoint on s3 (write) and from there to local safetensors
(ranged reads), ckpttool.offline.verify.verify_path of the s3 checkpoint (reads every byte); once, in the last round: s3fs ranged
gets of ``--tensor-mib`` and of 64 KiB, ckpttool.convert .pt -> DCP -> safetensors on the local disk. The safetensors
from s3 must equal the local ones bitwise.

The s3 cases run in ``--repeat`` rounds, each ckpttool case right after its plain reference, after a warm-up of the server
and of each case. A ratio is taken within a round and the verdicts use the median of the rounds' ratios: on a shared
machine the load changes from second to second, and a case and its reference minutes apart compare the load. Loopback
traffic only; the server is stopped (by PID) when the script ends.

    .venv/bin/python bench/s3.py --tensors 64 --tensor-mib 4
"""

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from statistics import median

from _common import GB, MiB, timed
from harness import Column, Set, Spec, check, main

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
PLAIN = {"put": ("s3fs put of the .pt (plain upload)", "s3 write <= 1.0x a plain upload", 1.0),  # a reference, its target, the limit
         "get": ("s3fs get of the object (plain download)", "s3 read <= 1.5x a plain whole download", 1.5)}


@contextlib.contextmanager
def moto(log_path: str):
    """``moto_server`` on 127.0.0.1 and a free port: its endpoint URL once it accepts connections; killed (by PID) at the end."""
    exe = shutil.which("moto_server", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if not exe:
        raise SystemExit("moto_server is not installed: pip install 'moto[server]' (it is in ckpttool's test extra)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break  # it accepts connections
            time.sleep(0.2)
        else:
            raise SystemExit(f"moto_server did not start; see {log_path}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def sets(run):
    """The server, the state and the warm-up; one set of cases; the bitwise check; the server stopped."""
    args, work, rnd, reports = run.args, run.work, [0], []
    with moto(os.path.join(work, "moto.log")) as endpoint:
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
        import fsspec
        import torch
        from safetensors.torch import load_file

        from ckpttool import convert
        from ckpttool.offline.verify import verify_path

        torch.manual_seed(0)
        rng, pt, obj = args.tensor_mib * MiB, os.path.join(work, "state.pt"), "bench/state.pt"
        nbytes = args.tensors * rng
        torch.save({"model": {f"w{i}": torch.randn(rng // 4) for i in range(args.tensors)}, "extra": {"step": 1}}, pt)
        s3 = fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=endpoint)
        s3.mkdir("bench")
        # the first requests of a kind are slower (the server's imports and first allocations, ckpttool's and s3fs's first calls):
        # both directions, the multipart path and each ckpttool case are warmed up on a small state before anything is timed
        s3.put_file(pt, "bench/warm.pt", chunksize=8 * MiB)
        s3.get_file("bench/warm.pt", os.path.join(work, "warm-back.pt"))
        s3.rm("bench/warm.pt")
        torch.save({"model": {"w": torch.randn(6 * MiB)}, "extra": {"step": 1}}, os.path.join(work, "warm.pt"))  # 24 MiB: two parts
        convert(os.path.join(work, "warm.pt"), "s3://bench/warm")
        convert("s3://bench/warm", os.path.join(work, "warm.safetensors"), only="model")
        verify_path("s3://bench/warm")
        s3.rm("bench/warm", recursive=True)
        url, back = (lambda: f"s3://bench/dcp-{rnd[0]}"), (lambda: os.path.join(work, f"from-s3-{rnd[0]}.safetensors"))
        local = os.path.join(work, "local.safetensors")
        cases = {  # name: (the work timed, bytes moved, its plain reference): each ckpttool case right after its reference
            PLAIN["put"][0]: (lambda: s3.put_file(pt, obj), nbytes, None),
            "ckpttool .pt -> s3 DCP (write)": (lambda: convert(pt, url()), nbytes, "put"),
            PLAIN["get"][0]: (lambda: s3.get_file(obj, os.path.join(work, "state-back.pt")), nbytes, None),
            "ckpttool s3 DCP -> local safetensors (read)": (lambda: convert(url(), back(), only="model"), nbytes, "get"),
            "ckpttool verify of the s3 DCP": (lambda: reports.append(verify_path(url())), nbytes, "get"),
            # from here on: once, in the last round
            f"s3fs ranged get of {args.tensor_mib} MiB": (lambda: s3.cat_file(obj, start=rng, end=2 * rng), rng, None),
            # what one request costs the server whatever its size (the floor of any ranged read)
            "s3fs ranged get of 64 KiB": (lambda: s3.cat_file(obj, start=rng, end=rng + 65536), 65536, None),
            "ckpttool local .pt -> DCP": (lambda: convert(pt, os.path.join(work, "dcp")), nbytes, None),
            "ckpttool local DCP -> safetensors": (lambda: convert(os.path.join(work, "dcp"), local, only="model"), nbytes, None),
        }

        def measure(name: str) -> dict:
            if list(cases).index(name) >= 5 and rnd[0] < args.repeat - 1:
                return {"ok": False, "skipped": "measured in the last round only"}
            return {"ok": True, "seconds": timed(cases[name][0]), "bytes": cases[name][1], "plain": cases[name][2]}

        def after_round() -> None:  # a round's outputs are removed before the next; round 0's safetensors kept for the bitwise check
            if rnd[0]:
                os.remove(back())
            s3.rm(url(), recursive=True)
            s3.rm(obj)
            rnd[0] += 1

        yield Set(list(cases), measure, lambda n, r: f"{n:<44} {r['seconds']:7.2f} s", after_round=after_round, time_keys=["seconds"],
                  heading=f"moto_server on {endpoint}; {args.tensors} x {args.tensor_mib} MiB fp32 = {nbytes / MiB:.0f} MiB; {args.repeat} "
                          f"round(s); torch {torch.__version__}, fsspec {fsspec.__version__}", info={"torch": torch.__version__})
        a, b = load_file(local), load_file(os.path.join(work, "from-s3-0.safetensors"))
        run.extra.update(bitwise=a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), verify_ok=all(r.ok for r in reports))


def derive(res: dict, run) -> tuple[list[dict], list[dict]]:
    """Each case's median time over the rounds; a ckpttool case's ratio to the plain transfer of the *same* round
    (median and range; the verdicts use the median): a round's case and reference ran back to back."""
    times = {n: [r["seconds"] for r in rs if r.get("ok")] for n, rs in res["all_runs"].items()}
    rows, checks = [], []
    for name, ts in times.items():
        c, cell = res["cases"][name], None
        if c["plain"]:
            (plain, target, limit), rs = PLAIN[c["plain"]], [t / p for t, p in zip(ts, times[PLAIN[c["plain"]][0]])]
            spread = f"{min(rs):.2f}–{max(rs):.2f}" if len(rs) > 1 else ""
            cell = f"{median(rs):.2f}" + (f" ({spread})" if spread else "")
            checks.append(check(target, name, f"{median(ts):.2f} s vs {median(times[plain]):.2f} s: {median(rs):.2f}x (median of {len(rs)} "
                                f"rounds' ratios" + (f", {spread}x)" if spread else ")"), median(rs) <= limit))
        rows.append({"case": name, "median": median(ts), "each": ", ".join(f"{t:.2f}" for t in ts) if len(ts) > 1 else "",
                     "gbps": c["bytes"] / median(ts) / GB, "ratio": cell})
    return rows, checks


SPEC = Spec("s3", "Benchmark: s3 on loopback", __doc__, os.path.abspath(__file__), sets, derive,
            options={"--tensors": dict(type=int, default=64), "--tensor-mib": dict(type=int, default=4),
                     # no cache to drop: the server is what is measured
                     "--warm": dict(action="store_true", default=True, help=argparse.SUPPRESS)},
            columns=[Column("case", "case", None), Column("time s (median)", "median"), Column("each round s", "each", ""),
                     Column("GB/s", "gbps", ".3f"), Column("× plain s3fs, same direction and round (median, range)", "ratio", "")],
            epilogue=lambda res: f"safetensors from s3 equal the local ones bitwise: {res.get('bitwise')}; verify of the s3 checkpoint ok: "
                                 f"{res.get('verify_ok')}", repeat=3,
            exit=lambda res: 0 if res["bitwise"] and res["verify_ok"] else 1)  # 1: the bytes from s3 differ, or verify failed

main(SPEC, __name__)
