"""Benchmark: ``ckpttool convert`` to and from ``s3://`` on an S3-API server on loopback, against
the same conversions on the local disk and against plain s3fs moving the same bytes.

It starts ``moto_server`` (from ``moto[server]``, the test extra) on 127.0.0.1 and a free port,
writes a state of ``--tensors`` fp32 tensors of ``--tensor-mib`` MiB each with ``torch.save``, then
times, in this one process (warm page cache; the server is the bottleneck, not the disk):

  s3fs put / get       plain s3fs: upload the .pt file whole, download the object whole (the transport)
  s3fs ranged get      plain s3fs: one ``cat_file`` of a ``--tensor-mib`` range of that object
  local .pt -> DCP     ckpttool.convert on the local disk
  local DCP -> st      ckpttool.convert DCP -> safetensors on the local disk
  .pt -> s3 DCP        ckpttool.convert from the local .pt to a DCP checkpoint on s3 (write)
  s3 DCP -> local st   ckpttool.convert from that s3 checkpoint to local safetensors (ranged reads)
  verify s3 DCP        ckpttool.verify.verify_path of the s3 checkpoint (reads every byte)

and checks that the safetensors written from s3 equal the local ones bitwise.

The s3 cases run in ``--repeat`` rounds, each ckpttool case right after its plain reference (put,
write, get, read, verify), after a warm-up of the server and of each case; a ratio is taken within
a round and the verdicts use the median of the rounds' ratios. On a shared machine the load changes
from second to second; a case and its reference measured minutes apart compare the load, not the code.

    .venv/bin/python bench/s3.py --tensors 64 --tensor-mib 4

Loopback traffic only; the server is stopped (by PID) when the script ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from statistics import median

from _common import GB, MiB, md_table, parser, timed, verdict_lines, verdict_md, write_json, write_markdown

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(log_path: str) -> tuple[subprocess.Popen, str]:
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(exe):
        exe = shutil.which("moto_server") or ""
    if not exe:
        raise SystemExit("moto_server is not installed: pip install 'moto[server]' (it is in ckpttool's test extra)")
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"moto_server did not start; see {log_path}")
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--tensor-mib", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds of the s3 cases, each ckpttool case beside its plain reference (default 3)")
    p.add_argument("--out-dir", default=None, help="local working directory (default: a new temp dir, removed at the end)")
    p.add_argument("--json", help="write the results JSON here")
    p.add_argument("--md", help="write the Markdown results here")
    args = p.parse_args(argv)

    work = args.out_dir or tempfile.mkdtemp(prefix="ckpttool-bench-s3-")
    os.makedirs(work, exist_ok=True)
    proc, endpoint = start_moto(os.path.join(work, "moto.log"))
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
    try:
        import fsspec
        import torch
        from safetensors.torch import load_file

        from ckpttool import convert
        from ckpttool.verify import verify_path

        numel = args.tensor_mib * MiB // 4
        torch.manual_seed(0)
        state = {"model": {f"w{i}": torch.randn(numel) for i in range(args.tensors)}, "extra": {"step": 1}}
        nbytes = args.tensors * numel * 4
        pt = os.path.join(work, "state.pt")
        torch.save(state, pt)
        del state
        s3 = fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=endpoint)
        bucket = "bench"
        s3.mkdir(bucket)
        # the first requests of a kind are slower (the server's imports and first allocations, and
        # in this process ckpttool's and s3fs's first calls): warm both directions, the multipart
        # path and each ckpttool case up on a small state before anything is timed
        s3.put_file(pt, f"{bucket}/warm.pt", chunksize=8 * MiB)
        s3.get_file(f"{bucket}/warm.pt", os.path.join(work, "warm-back.pt"))
        s3.rm(f"{bucket}/warm.pt")
        small = os.path.join(work, "warm.pt")
        torch.save({"model": {"w": torch.randn(6 * MiB)}, "extra": {"step": 1}}, small)  # 24 MiB: two parts
        convert(small, f"s3://{bucket}/warm")
        convert(f"s3://{bucket}/warm", os.path.join(work, "warm.safetensors"), only="model")
        verify_path(f"s3://{bucket}/warm")
        s3.rm(f"{bucket}/warm", recursive=True)
        for name in ("warm.pt", "warm-back.pt", "warm.safetensors"):
            os.remove(os.path.join(work, name))

        rows: list[tuple[str, float, int, str | None]] = []  # name, seconds, bytes, plain reference (one per round)
        reports = []
        for r in range(args.repeat):
            # each ckpttool case right after its plain reference, so that both see the same load
            # on a shared machine; a round's outputs are removed before the next
            url, back = f"s3://{bucket}/dcp-{r}", os.path.join(work, f"from-s3-{r}.safetensors")
            rows.append(("s3fs put of the .pt (plain upload)", timed(lambda: s3.put_file(pt, f"{bucket}/state.pt")), nbytes, None))
            rows.append(("ckpttool .pt -> s3 DCP (write)", timed(lambda: convert(pt, url)), nbytes, "put"))
            rows.append(("s3fs get of the object (plain download)",
                         timed(lambda: s3.get_file(f"{bucket}/state.pt", os.path.join(work, "state-back.pt"))), nbytes, None))
            rows.append(("ckpttool s3 DCP -> local safetensors (read)", timed(lambda: convert(url, back, only="model")), nbytes, "get"))
            rows.append(("ckpttool verify of the s3 DCP", timed(lambda: reports.append(verify_path(url))), nbytes, "get"))
            if r:
                os.remove(back)  # round 0's is kept for the bitwise check
            s3.rm(url, recursive=True)
            s3.rm(f"{bucket}/state.pt")
        s3.put_file(pt, f"{bucket}/state.pt")
        rng = args.tensor_mib * MiB
        rows.append((f"s3fs ranged get of {args.tensor_mib} MiB", timed(lambda: s3.cat_file(f"{bucket}/state.pt", start=rng, end=2 * rng)), rng, None))
        # what one request costs the server whatever its size (the floor of any ranged read)
        rows.append(("s3fs ranged get of 64 KiB", timed(lambda: s3.cat_file(f"{bucket}/state.pt", start=rng, end=rng + 65536)), 65536, None))
        rows.append(("ckpttool local .pt -> DCP", timed(lambda: convert(pt, os.path.join(work, "dcp"))), nbytes, None))
        rows.append(("ckpttool local DCP -> safetensors",
                     timed(lambda: convert(os.path.join(work, "dcp"), os.path.join(work, "local.safetensors"), only="model")), nbytes, None))

        a, b = load_file(os.path.join(work, "local.safetensors")), load_file(os.path.join(work, "from-s3-0.safetensors"))
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        verified = all(rep.ok for rep in reports)
        table, checks = summarize(rows)
        head = (f"moto_server on {endpoint}; {args.tensors} x {args.tensor_mib} MiB fp32 = {nbytes / MiB:.0f} MiB; "
                f"{args.repeat} round(s); torch {torch.__version__}, fsspec {fsspec.__version__}")
        tail = f"safetensors from s3 equal the local ones bitwise: {same}; verify of the s3 checkpoint ok: {verified}"
        print(head + "\n" + table + "\n" + tail + "\n\n" + "\n".join(verdict_lines(checks)))
        write_markdown(args.md, f"# Benchmark: s3 on loopback\n\n{head}\n\n{table}\n\n{tail}\n\n{verdict_md(checks)}\n")
        if args.json:
            write_json(args.json, {"rows": [{"case": n, "seconds": t, "bytes": b, "plain": r} for n, t, b, r in rows],
                                   "checks": checks, "bitwise": same, "verify_ok": verified})
        return 0 if same and verified else 1
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        if args.out_dir is None:
            shutil.rmtree(work, ignore_errors=True)


def summarize(rows: list[tuple[str, float, int, str | None]]) -> tuple[str, list[dict]]:
    """The table (each case's median time over the rounds; a ckpttool case's ratio to the plain
    transfer of the *same* round, median and range) and the verdicts, which use those medians:
    a round's case and reference ran back to back, so the machine's load shifts both alike."""
    plain_name = {"put": "s3fs put of the .pt (plain upload)", "get": "s3fs get of the object (plain download)"}
    times: dict[str, list[float]] = {}
    info: dict[str, tuple[int, str | None]] = {}
    for name, secs, n, ref in rows:
        times.setdefault(name, []).append(secs)
        info[name] = (n, ref)
    ratios = {name: [t / p for t, p in zip(times[name], times[plain_name[ref]])] for name, (_n, ref) in info.items() if ref}
    lines, checks = [], []
    for name, ts in times.items():
        n, ref = info[name]
        cell = "–"
        if ref:
            rs = ratios[name]
            cell = f"{median(rs):.2f}" + (f" ({min(rs):.2f}–{max(rs):.2f})" if len(rs) > 1 else "")
            limit = 1.0 if ref == "put" else 1.5
            checks.append({"target": "s3 write <= 1.0x a plain upload" if ref == "put" else "s3 read <= 1.5x a plain whole download",
                           "case": name, "pass": median(rs) <= limit,
                           "value": f"{median(ts):.2f} s vs {median(times[plain_name[ref]]):.2f} s: {median(rs):.2f}x "
                                    f"(median of {len(rs)} rounds' ratios" + (f", {min(rs):.2f}–{max(rs):.2f}x)" if len(rs) > 1 else ")")})
        runs = ", ".join(f"{t:.2f}" for t in ts) if len(ts) > 1 else ""
        lines.append([name, f"{median(ts):.2f}", runs, f"{n / median(ts) / GB:.3f}", cell])
    table = md_table(["case", "time s (median)", "each round s", "GB/s", "× plain s3fs, same direction and round (median, range)"],
                     lines)
    return table, checks


if __name__ == "__main__":
    sys.exit(main())
