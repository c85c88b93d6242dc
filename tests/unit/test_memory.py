"""Peak RSS of a real convert stays under the memory budget plus a constant, whatever the size."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

# Importing torch peaks higher than a streamed convert, so ru_maxrss would hide the convert: reset the
# kernel's high-water mark (VmHWM) after the imports and read it after the work.
PROBE = r"""
import json, sys
import torch, ckpttool
import ckpttool.formats.dcp, ckpttool.formats.torch_save, ckpttool.formats.safetensors  # imports are not the convert
import ckpttool.formats.dcp.sink, ckpttool.formats.dcp.source  # (formats.dcp imports its writer on first use)
from ckpttool import convert

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
convert(sys.argv[1], sys.argv[2], memory_budget=sys.argv[3])
print(json.dumps({"base_kib": base, "peak_kib": status("VmHWM")}))
"""


def convert_rss_growth_mib(*args: str) -> float:
    """Peak RSS during the convert minus RSS before it, in MiB, measured in a fresh process."""
    out = subprocess.run([sys.executable, "-c", PROBE, *args], check=True, capture_output=True, text=True).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    return (doc["peak_kib"] - doc["base_kib"]) / 1024


def test_convert_peak_rss_is_bounded_by_the_budget(tmp_path):
    # 6 tensors of 16 MiB (96 MiB) through an 8 MiB budget; the same with a 64 MiB budget grows more,
    # which shows the measurement sees the slabs at all.
    state = {"model": {f"w{i}": torch.full((4 * 1024, 1024), float(i)) for i in range(6)}}
    src = tmp_path / "big.pt"
    torch.save(state, src)
    del state
    for a, b in (("big.pt", "out_dcp"), ("big.pt", "out.safetensors"), ("out_dcp", "from_dcp.pt")):
        growth = convert_rss_growth_mib(str(tmp_path / a), str(tmp_path / b), "8MiB")
        assert growth < 8 + 24, (a, b, growth)  # the budget plus a small constant, not the 96 MiB
    roomy = convert_rss_growth_mib(str(tmp_path / "big.pt"), str(tmp_path / "roomy.safetensors"), "64MiB")
    assert roomy > 12, roomy
