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

        rows: list[tuple[str, float, int, str | None]] = []  # name, seconds, bytes, plain reference
        rows.append(("s3fs put of the .pt (plain upload)", timed(lambda: s3.put_file(pt, f"{bucket}/state.pt")), nbytes, None))
        rows.append(("s3fs get of the object (plain download)",
                     timed(lambda: s3.get_file(f"{bucket}/state.pt", os.path.join(work, "state-back.pt"))), nbytes, None))
        rng = args.tensor_mib * MiB
        rows.append((f"s3fs ranged get of {args.tensor_mib} MiB", timed(lambda: s3.cat_file(f"{bucket}/state.pt", start=rng, end=2 * rng)), rng, None))
        # what one request costs the server whatever its size (the floor of any ranged read)
        rows.append(("s3fs ranged get of 64 KiB", timed(lambda: s3.cat_file(f"{bucket}/state.pt", start=rng, end=rng + 65536)), 65536, None))
        rows.append(("ckpttool local .pt -> DCP", timed(lambda: convert(pt, os.path.join(work, "dcp"))), nbytes, None))
        rows.append(("ckpttool local DCP -> safetensors",
                     timed(lambda: convert(os.path.join(work, "dcp"), os.path.join(work, "local.safetensors"), only="model")), nbytes, None))
        url = f"s3://{bucket}/dcp"
        rows.append(("ckpttool .pt -> s3 DCP (write)", timed(lambda: convert(pt, url)), nbytes, "put"))
        rows.append(("ckpttool s3 DCP -> local safetensors (read)",
                     timed(lambda: convert(url, os.path.join(work, "from-s3.safetensors"), only="model")), nbytes, "get"))
        report = {}
        rows.append(("ckpttool verify of the s3 DCP", timed(lambda: report.setdefault("r", verify_path(url))), nbytes, "get"))

        a, b = load_file(os.path.join(work, "local.safetensors")), load_file(os.path.join(work, "from-s3.safetensors"))
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        put_s, get_s = rows[0][1], rows[1][1]
        plain = {"put": put_s, "get": get_s}
        checks = [{"target": "s3 write <= 1.0x a plain upload" if ref == "put" else "s3 read <= 1.5x a plain whole download",
                   "case": name, "value": f"{secs:.2f} s vs {plain[ref]:.2f} s = {secs / plain[ref]:.2f}x",
                   "pass": secs / plain[ref] <= (1.0 if ref == "put" else 1.5)} for name, secs, _n, ref in rows if ref]
        head = (f"moto_server on {endpoint}; {args.tensors} x {args.tensor_mib} MiB fp32 = {nbytes / MiB:.0f} MiB; "
                f"torch {torch.__version__}, fsspec {fsspec.__version__}")
        text = md_table(["case", "time s", "GB/s", "× plain s3fs same direction"],
                        [[name, f"{secs:.2f}", f"{n / secs / GB:.3f}", f"{secs / plain[ref]:.2f}" if ref else "–"]
                         for name, secs, n, ref in rows])
        tail = f"safetensors from s3 equal the local ones bitwise: {same}; verify of the s3 checkpoint ok: {report['r'].ok}"
        print(head + "\n" + text + "\n" + tail + "\n\n" + "\n".join(verdict_lines(checks)))
        write_markdown(args.md, f"# Benchmark: s3 on loopback\n\n{head}\n\n{text}\n\n{tail}\n\n{verdict_md(checks)}\n")
        if args.json:
            write_json(args.json, {"rows": [{"case": n, "seconds": t, "bytes": b, "plain": r} for n, t, b, r in rows],
                                   "checks": checks, "bitwise": same, "verify_ok": report["r"].ok})
        return 0 if same and report["r"].ok else 1
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        if args.out_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
