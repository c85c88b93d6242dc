"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A one-rank gloo process group in this process (a FileStore under tmp_path) and its 1-D CPU
    mesh; the group is destroyed after the test."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    tdist.init_process_group("gloo", store=tdist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        tdist.destroy_process_group()
