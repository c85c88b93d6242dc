"""Bytes a load reads, summed over its ranks: rchar (``/proc/self/io``) around one ``Checkpointer.load``
(or, with ``--plain``, plain ``dcp.load`` + ``set_state_dict``) of a checkpoint ``bench/load.py --keep``
generated (CKPT: its root; ``CKPT.json`` holds the model configuration). Not a timing: exact whatever else runs.

    torchrun --standalone --nproc-per-node 3 bench/load_bytes.py /tmp/ckpttool-bench-all/load/ckpt-1GB-on-2
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from _common import proc_io
from ckpttool import Checkpointer
from ckpttool.training.trainer.model import ModelConfig, build_fsdp_model

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("ckpt", help="a checkpoint root written by bench/load.py --keep")
p.add_argument("--plain", action="store_true", help="plain dcp.load + set_state_dict instead of Checkpointer.load")
args = p.parse_args()
dist.init_process_group("gloo")
with open(args.ckpt + ".json") as f:
    model = build_fsdp_model(ModelConfig(**json.load(f)["cfg"]), init_device_mesh("cpu", (dist.get_world_size(),)), seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
get_state_dict(model, optimizer)  # creates the AdamW state: not part of the load
ck = Checkpointer(args.ckpt)
dist.barrier()
before = proc_io()["rchar"]
if args.plain:
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    dcp.load(state, checkpoint_id=os.path.join(args.ckpt, f"step-{ck.steps()[-1]}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
else:
    ck.load(model, optimizer)
total = torch.tensor([proc_io()["rchar"] - before])
dist.all_reduce(total)
if dist.get_rank() == 0:
    print(json.dumps({"ckpt": args.ckpt, "ranks": dist.get_world_size(), "plain": args.plain,
                      "read_mib_all_ranks": round(total.item() / 2**20)}))
dist.destroy_process_group()
