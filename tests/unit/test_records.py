"""A DCP tensor record written from its template (small tensors) is byte for byte the record
ArchiveWriter streams for the same tensor, and torch reads it."""

from __future__ import annotations

import io

import pytest
import torch

from ckpttool.buffers import tensor_buffer
from ckpttool.formats.dcp.records import TEMPLATE_BYTES, Appending, write_tensor
from ckpttool.formats.torchzip import ArchiveWriter

CASES = [
    (torch.float32, ()), (torch.float32, (0,)), (torch.float32, (1366,)), (torch.bfloat16, (3, 5)),
    (torch.int64, (7,)), (torch.uint8, (13, 1, 2)), (torch.bool, (9,)), (torch.float8_e4m3fn, (33,)),
    (torch.complex64, (4,)), (torch.uint16, (5,)),
    (torch.float32, (TEMPLATE_BYTES // 4,)),  # the largest from a template
    (torch.float32, (TEMPLATE_BYTES // 4 + 1,)),  # streamed
]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    return raw[: torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()].view(dtype).reshape(shape)


def _streamed(t: torch.Tensor) -> bytes:
    """The record as ArchiveWriter streams it, front to back (as into a DCP file)."""
    buf = io.BytesIO()
    with ArchiveWriter(Appending(buf)) as writer:
        placeholder, stream = writer.new_tensor(t.dtype, tuple(t.shape))
        with stream:
            if t.numel():
                stream.write(tensor_buffer(t))
        writer.finish(placeholder)
    return buf.getvalue()


@pytest.mark.parametrize("dtype,shape", CASES, ids=[f"{d}-{s}".replace("torch.", "") for d, s in CASES])
def test_a_record_from_its_template_is_the_streamed_record(dtype, shape):
    buf = io.BytesIO()
    buf.write(b"x" * 3)  # records follow each other in a file: the template does not depend on where
    for seed in range(3):  # the same dtype and shape again: the cached template, other data
        t = _tensor(dtype, shape, seed)
        before = []
        start, length = write_tensor(Appending(buf), dtype, shape, None,
                                     lambda write: write(tensor_buffer(t)) if t.numel() else None,
                                     lambda: before.append(buf.tell()))
        record = buf.getvalue()[start:start + length]
        assert record == _streamed(t)
        data = bytes(tensor_buffer(t)) if t.numel() else b""
        assert record[before[0] - start:before[0] - start + len(data)] == data  # before_data: where the data begins
        back = torch.load(io.BytesIO(record), weights_only=True)
        assert back.dtype == dtype and tuple(back.shape) == shape
        assert (bytes(tensor_buffer(back.contiguous())) if back.numel() else b"") == data


def test_data_of_the_wrong_length_is_refused():
    with pytest.raises(RuntimeError, match="3 bytes of data for 16"):
        write_tensor(Appending(io.BytesIO()), torch.float32, (4,), None, lambda write: write(b"abc"))
