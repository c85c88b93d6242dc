"""Benchmark: the CPU each small record costs (issue 50, part 4), beside plain torch's state-dict walk.

A ``Checkpointer`` step of N fp32 tensors of 4 KiB (one process), then each command's process CPU,
median of 5 after one untimed run: convert -> safetensors and -> .pt, reshard -> 3, ``ckpttool.load``
(beside torch's own ``get_model_state_dict`` + ``set_model_state_dict`` of the same model, which a
load pays too), verify. Moving 20 MB costs a few ms: the rest is per record. To compare two
commits, run it from each one's worktree in turn (``PYTHONPATH=WORKTREE``), a few rounds.
``--source dcp``: the step written by torch's own ``dcp.save`` instead (its records differ in more
than their data: each its data's CRC-32 and a serialization id):

    .venv/bin/python bench/records.py [--records 5000] [--source ckpttool|dcp] [CASE ...]
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from ckpttool import Checkpointer, convert, load
from ckpttool.offline.reshard import reshard
from ckpttool.offline.verify import verify_path


class Many(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.p = torch.nn.ParameterList([torch.nn.Parameter(torch.full((1024,), float(i))) for i in range(n)])


def torch_walk(model: torch.nn.Module) -> None:
    set_model_state_dict(model, get_model_state_dict(model), options=StateDictOptions(strict=True))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--source", choices=("ckpttool", "dcp"), default="ckpttool")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    n = args.records
    with tempfile.TemporaryDirectory(prefix="ckpttool-records-") as tmp:
        step, model = os.path.join(tmp, "run", "step-1"), Many(n)
        if args.source == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.save(model.state_dict(), checkpoint_id=step, no_dist=True)
        else:
            with Checkpointer(os.path.join(tmp, "run")) as ckpt:
                ckpt.save(1, Many(n))
        cases = {
            "convert_safetensors": lambda: convert(step, os.path.join(tmp, "out.safetensors"), to="safetensors", force=True),
            "convert_pt": lambda: convert(step, os.path.join(tmp, "out.pt"), to="torch", force=True),
            "reshard_3": lambda: reshard(step, os.path.join(tmp, "r3"), world_size=3, force=True),
            "load": lambda: load(step, model),
            "torch_state_dict_walk": lambda: torch_walk(model),
            "verify": lambda: verify_path(step),
        }
        for name in args.cases or list(cases):
            fn = cases[name]
            fn()
            times = []
            for _ in range(5):
                start = time.process_time()
                fn()
                times.append(time.process_time() - start)
            med = statistics.median(times)
            print(f"{name:22s} {med:6.3f} s CPU  {med / n * 1e6:5.0f} us a record  (min {min(times):.3f}, max {max(times):.3f})",
                  flush=True)
