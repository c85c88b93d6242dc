"""Benchmark: a ``save_pretrained`` folder loaded into FSDP2 on 2 ranks (issue 37).

A Llama-shaped model of about ``--size`` GB of fp32 weights (transformers' LlamaForCausalLM, random values) is written
by ``save_pretrained`` (1 GB shards and the index) and as one ``torch.save`` file (FOLDER.pt), or ``--src`` names a
folder. Then each case on 2 gloo CPU ranks, in fresh processes, the page cache dropped before it (unless ``--warm``):

  ckpttool.load        meta device, ``fully_shard`` per decoder layer and the root, ``to_empty``, then
                       ``ckpttool.load(folder, model)``: each rank reads its own rows of each tensor
  ... of the .pt       the same from FOLDER.pt (where it exists), the records' CRC-32s checked from every rank's pieces
  from_pretrained      what fine-tuning scripts do: ``from_pretrained`` on every rank (the whole model
                       in each rank's memory), then ``fully_shard``
  dcp + HF reader      meta + ``fully_shard`` + ``to_empty``, then torch's ``HuggingFaceStorageReader``
                       with ``dcp.load`` and ``set_model_state_dict`` (where the torch has it: 2.8 and later)

Per rank: the seconds of the load (barrier to barrier, after the model is built; from_pretrained: the load and the
sharding), the bytes its read calls returned during the load (``/proc/self/io`` rchar; ckpttool.load's only: the others
map the files, which rchar does not count) against its shard's bytes, and its peak RSS (VmHWM, imports included) against
its shard + 0.5 GB. The slowest rank and the largest figures are reported; one run per case, the fastest.

    .venv/bin/python bench/pretrained.py --size 2 --md docs/bench/pretrained.md --plot docs/img/bench-pretrained.png

Targets (issue 37): bytes each rank reads <= 1.1x its shard's bytes; peak RSS per rank <= its
shard + 0.5 GB; time against from_pretrained + fully_shard and against the HF reader + dcp.load.
"""

import json
import os
import time
from importlib.metadata import version
from typing import Any

from _common import GB, MiB, drop_caches, path_bytes, proc_io, proc_status, reset_peak_rss
from _dist import finish_rank, init_rank  # importing _dist puts this repository first on sys.path: its ckpttool is the one measured
from harness import Chart, Column, Panel, Set, Spec, check, main

CASES = {"ckpt_load": "ckpttool.load into FSDP2", "ckpt_load_pt": "ckpttool.load of the same weights as one .pt",
         "hf_every_rank": "from_pretrained on every rank + fully_shard", "dcp_hf_reader": "dcp.load + HuggingFaceStorageReader"}
OURS = ("ckpt_load", "ckpt_load_pt")  # read() calls only: the others map the files (safe_open), which rchar does not count


def llama_config(size_gb: float) -> dict[str, int]:
    """A Llama shape of about ``size_gb`` GB of fp32 weights: dim 1024, vocab 32000, as many layers as fit."""
    dim, vocab, hidden = 1024, 32000, 2816
    per_layer = 3 * dim * dim + 3 * dim * hidden + 2 * dim  # q, o; k, v at half (4 of 8 heads); the MLP; two norms
    return dict(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_attention_heads=8, num_key_value_heads=4,
                max_position_embeddings=512, num_hidden_layers=max(1, round((size_gb * GB / 4 - 2 * vocab * dim) / per_layer)))


def generate(args) -> dict[str, Any]:
    """The folder: random weights filled in slabs (no init kernels), saved in 1 GB shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**json.loads(args._cfg)))
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05, generator=gen)
    model.save_pretrained(args._dst, max_shard_size="1GB")
    torch.save(model.state_dict(), args._dst + ".pt")  # the same weights as one torch.save file (CRC-32 per record)
    return {"ok": True, "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__}


def rank_case(args) -> None:
    """One rank of a case: build, then load barrier to barrier with its read bytes and peak RSS."""
    init_rank(args)
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import ckpttool

    def shard(model):
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    case, folder, build_s = args._case, args._src, 0.0
    if case != "hf_every_rank":
        t = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
        shard(model).to_empty(device="cpu")
        build_s = time.perf_counter() - t
    dist.barrier()
    reset_peak_rss()
    read0, t0 = proc_io().get("rchar", 0), time.perf_counter()
    if case in OURS:
        ckpttool.load(folder + (".pt" if case == "ckpt_load_pt" else ""), model)
    elif case == "hf_every_rank":
        model = shard(LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32))
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        state = get_model_state_dict(model)
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(folder))
        set_model_state_dict(model, state)
    dist.barrier()
    seconds, read = time.perf_counter() - t0, proc_io().get("rchar", 0) - read0
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    finish_rank(args, {"ok": True, "seconds": seconds, "build_s": build_s, "read_bytes": read, "shard_bytes": shard_bytes,
                       "hwm_kib": proc_status("VmHWM") or 0, "torch": torch.__version__})


def measure(run, name: str, folder: str) -> dict[str, Any]:
    dropped = drop_caches() if run.cold else False
    ranks, proc = run.ranks(name, 2, ["--_case", name, "--_src", folder])
    r: dict[str, Any] = {"ok": ranks is not None, "rc": proc.rc, "cache_dropped": dropped}
    if ranks is not None:
        r.update(seconds=max(x["seconds"] for x in ranks), build_s=max(x["build_s"] for x in ranks),
                 read_x=max(x["read_bytes"] / x["shard_bytes"] for x in ranks), shard_bytes=max(x["shard_bytes"] for x in ranks),
                 read_bytes=max(x["read_bytes"] for x in ranks), hwm_kib=max(x["hwm_kib"] for x in ranks),
                 process_wall_s=proc.wall_s, peak_kib=proc.peak_kib, ranks=ranks, torch=ranks[0]["torch"])
    return r


def sets(run):
    args = run.args
    folder = os.path.abspath(args.src) if args.src else os.path.join(run.out_dir, f"llama-{args.size:g}GB")
    run.made += [] if args.src or args.keep else [folder, folder + ".pt"]  # removed at the end (also if writing it fails)
    if not args.src and not (args.keep and os.path.exists(os.path.join(folder, "config.json"))):
        print(f"writing a {args.size:g} GB save_pretrained folder ...", flush=True)
        made, _ = run.child("generate", ["--_case", "generate", "--_dst", folder, "--_cfg", json.dumps(llama_config(args.size))])
        if not made["ok"]:
            raise SystemExit("writing the save_pretrained folder failed")
    has_reader = tuple(int(x) for x in version("torch").split(".")[:2]) >= (2, 8)  # (without importing torch here)
    names = ["ckpt_load"] + (["ckpt_load_pt"] if os.path.exists(folder + ".pt") else []) + ["hf_every_rank"]
    names += ["dcp_hf_reader"] if has_reader else []
    info = {"path": folder, "file_bytes": path_bytes(folder)}
    yield Set(names, lambda n: measure(run, n, folder),
              lambda n, r: f"{CASES[n]:<46} {r['seconds']:7.2f} s  read {r['read_x']:.2f}x shard  peak {r['hwm_kib'] / 1024:6.0f} MiB",
              heading=f"{info['file_bytes'] / GB:.2f} GB save_pretrained folder on 2 ranks", info=info)


def derive(res: dict[str, Any], run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows (time against ckpttool.load; bytes read and peak RSS per rank against its shard) and the verdicts."""
    cases, rows, checks = res["cases"], [], []
    ours = cases.get("ckpt_load", {})
    for name, c in cases.items():
        rows.append(row := {"case": name, "label": CASES[name]})
        if not c.get("ok"):
            row["failed"] = True
            continue
        mine = name in OURS
        row.update(seconds=c["seconds"], build_s=c["build_s"] or None, x_ours=c["seconds"] / ours["seconds"] if ours.get("ok") else None,
                   read_x=c["read_x"] if mine else None, read_gb=c["read_bytes"] / GB if mine else None, shard_gb=c["shard_bytes"] / GB,
                   peak_mib=c["hwm_kib"] / 1024, limit_mib=(c["shard_bytes"] + 0.5 * GB) / MiB)
    if ours.get("ok"):
        tag, row = f"ckpttool.load, {res['checkpoint']['file_bytes'] / GB:.2f} GB on 2 ranks", rows[0]
        for r in (r for r in rows if r["case"] in OURS and not r.get("failed")):
            checks.append(check("bytes each rank reads <= 1.1x its shard's bytes", tag + (", .pt, CRC-32s checked" if r is not row else ""),
                                f"{r['read_gb']:.2f} GB read for a {r['shard_gb']:.2f} GB shard = {r['read_x']:.2f}x", r["read_x"] <= 1.1))
        checks.append(check("peak RSS per rank <= its shard + 0.5 GB", tag,
                            f"{row['peak_mib']:.0f} MiB (limit {row['limit_mib']:.0f} MiB)", row["peak_mib"] <= row["limit_mib"]))
        for other in (n for n in ("hf_every_rank", "dcp_hf_reader") if cases.get(n, {}).get("ok")):
            t = cases[other]["seconds"]
            checks.append(check(f"time against {CASES[other]}", tag,
                                f"{t:.2f} s vs ckpttool {ours['seconds']:.2f} s = {t / ours['seconds']:.2f}x (> 1: ckpttool faster)", None))
    return rows, checks


SPEC = Spec(
    "pretrained", "Benchmark: a save_pretrained folder into FSDP2", __doc__, os.path.abspath(__file__), sets, derive,
    options={"--size": dict(type=float, default=2.0, help="the model's fp32 weights in GB (default 2)"),
             "--src": dict(help="an existing save_pretrained folder of a Llama model instead of writing one")},
    columns=[Column("case", "label", None), Column("load s (slowest rank)", "seconds"), Column("× ckpttool.load", "x_ours"),
             Column("model build s", "build_s"), Column("read() GB / rank", "read_gb"), Column("shard GB / rank", "shard_gb"),
             Column("read × shard", "read_x"), Column("peak RSS MiB / rank", "peak_mib", ".0f"),
             Column("shard + 0.5 GB, MiB", "limit_mib", ".0f")],
    chart=Chart([Panel("seconds", "seconds of the load (slowest rank)"),
                 Panel("read_x", "bytes read per rank / its shard's bytes", limit=lambda res: 1.1, limit_label="target 1.1x"),
                 Panel("peak_mib", "peak RSS per rank (MiB)", limit=lambda res: res["rows"][0].get("limit_mib"),
                       limit_label="shard + 0.5 GB")],
                title=lambda res: f"a {res['checkpoint']['file_bytes'] / GB:.2f} GB save_pretrained folder into FSDP2 on 2 ranks"),
    child=generate, rank=rank_case, flags=("keep", "warm"), repeat=1)

main(SPEC, __name__)
