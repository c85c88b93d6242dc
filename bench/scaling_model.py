"""The model behind docs/scaling.md: a reshard (or sharded convert, or verify) of a 1 TB or 5 TB DCP
checkpoint by K nodes x n workers reading from and writing to an object store.

It is arithmetic, not a measurement: every input is a flag, printed with the table, and the defaults are the assumptions
docs/scaling.md states (with the per-worker figures measured by bench/parallel.py where this machine can measure them).

    .venv/bin/python bench/scaling_model.py --md
"""

import argparse
import math

from _common import GB, MiB


def model(size_tb: float, nodes: int, per_node: int, a: argparse.Namespace) -> dict[str, float]:
    s, workers = size_tb * 1e12, nodes * per_node
    # records: one per (key, source rank) in SRC, one per (key, target rank) in DST
    src_records, dst_records = a.keys * a.src_ranks, a.keys * a.dst_ranks
    bytes_per_worker = s / workers
    rec = s / src_records  # the mean source record
    if rec <= 16 * MiB:
        # small records are fetched in spans of consecutive records up to 32 MiB (REMOTE_SPAN);
        # a worker's target ranks are contiguous, so it reads runs of whole source files
        gets = bytes_per_worker / (32 * MiB)
    else:
        # one ranged GET per (target box, source chunk) overlap, and per slab (budget / 2) of it
        parts = dst_records * max(1, math.ceil(a.src_ranks / a.dst_ranks)) / workers
        gets = parts * math.ceil(bytes_per_worker / parts / (a.budget_gib * (1 << 30) / 2))
    puts = s / workers / (a.part_mib * MiB) + a.dst_ranks / workers  # multipart parts, one upload per file
    t_stream = bytes_per_worker / (a.worker_gbps * GB)  # read and write overlap in the pipeline
    t_nic = 2 * s / nodes / (a.nic_gbps * GB)  # every byte crosses the node's NIC twice (in, out)
    t_requests = (gets + puts) * a.latency_ms / 1e3 / a.streams
    metadata_mb = dst_records * a.metadata_bytes_per_record / 1e6
    t_metadata = metadata_mb * 1e6 / (a.worker_gbps * GB) + dst_records * a.gather_us_per_record / 1e6
    total = a.startup_s + max(t_stream + t_requests, t_nic) + t_metadata
    return {"workers": workers, "read_gb": bytes_per_worker / GB, "written_gb": bytes_per_worker / GB, "gets": gets, "puts": puts,
            "peak_gib": a.budget_gib + a.overhead_gib, "metadata_mb": metadata_mb, "t_stream": t_stream, "t_nic": t_nic,
            "t_requests": t_requests, "t_metadata": t_metadata, "total_s": total}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,5", help="checkpoint sizes in TB")
    p.add_argument("--nodes", default="1,4,16,64")
    p.add_argument("--per-node", type=int, default=8, help="workers per node")
    p.add_argument("--keys", type=int, default=2200, help="tensor keys (a 70B-class model: ~730 parameters x 3 with AdamW)")
    p.add_argument("--src-ranks", type=int, default=512)
    p.add_argument("--dst-ranks", type=int, default=1024)
    p.add_argument("--worker-gbps", type=float, default=0.2,
                   help="GB/s one worker streams (read + write overlapped); 0.2 is this machine's local-disk figure")
    p.add_argument("--nic-gbps", type=float, default=12.5, help="a node's network bandwidth, GB/s (100 Gb/s)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="first-byte latency of one object-store request")
    p.add_argument("--streams", type=int, default=1, help="requests a worker has in flight at once (ckpttool: 1)")
    p.add_argument("--part-mib", type=int, default=50, help="multipart upload part size (s3fs's default block)")
    p.add_argument("--budget-gib", type=float, default=1.0)
    p.add_argument("--overhead-gib", type=float, default=0.3, help="measured: peak RSS <= budget + 0.3 GB")
    p.add_argument("--metadata-bytes-per-record", type=float, default=211, help="measured: .metadata bytes per record")
    p.add_argument("--gather-us-per-record", type=float, default=5.0, help="worker 0 gathering and pickling one record")
    p.add_argument("--startup-s", type=float, default=5.0, help="interpreter, torch import, group rendezvous")
    p.add_argument("--md", action="store_true")
    a = p.parse_args()
    head = ["size", "nodes x workers", "read = written GB / worker", "GETs / worker", "PUTs / worker", "peak GiB / worker",
            ".metadata MB", "stream s", "NIC s", "requests s", "worker 0 metadata s", "total"]
    rows = []
    for size in [float(x) for x in a.sizes.split(",")]:
        for k in [int(x) for x in a.nodes.split(",")]:
            m = model(size, k, a.per_node, a)
            rows.append([f"{size:g} TB", f"{k} x {a.per_node}", f"{m['read_gb']:.1f}", f"{m['gets']:.0f}", f"{m['puts']:.0f}",
                         f"{m['peak_gib']:.1f}", f"{m['metadata_mb']:.0f}", f"{m['t_stream']:.0f}", f"{m['t_nic']:.0f}",
                         f"{m['t_requests']:.0f}", f"{m['t_metadata']:.0f}",
                         f"{m['total_s'] / 3600:.1f} h" if m["total_s"] >= 5400 else f"{m['total_s'] / 60:.0f} min"])
    print("inputs: " + ", ".join(f"{k}={v}" for k, v in vars(a).items() if k != "md"))
    if a.md:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head, *rows]:
            print("  ".join(f"{c:>12}" for c in r))
