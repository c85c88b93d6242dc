"""Helpers shared by the tests: the reference state, bitwise comparisons, byte damage, output names."""

from __future__ import annotations

import contextlib
import io
import os
import signal

import torch

from ckpttool import formats
from ckpttool.formats import open_source

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


class FrontToBack(io.RawIOBase):
    """A write-only stream that cannot seek (a DCP file written front to back, an upload): ``buf``."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.buf += bytes(b)
        return len(b)

    def tell(self) -> int:
        return len(self.buf)


def reference_state() -> dict:
    """A state dict with the shapes and dtypes that break converters."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(7, 3, generator=g),
            "wt": torch.randn(3, 4, generator=g).t(),  # saved from a transposed view: strided storage
            "b16": torch.randn(5, generator=g).to(torch.bfloat16),
            "h": torch.randn(4, 2, generator=g).to(torch.float16),
            "f64": torch.randn(2, 2, generator=g).double(),
            "ids": torch.arange(6, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "u8": torch.arange(5, dtype=torch.uint8),
            "empty": torch.zeros(0, 4),
            "scalar": torch.tensor(2.5),
            "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        },
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(7, 3, generator=g)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None, "params": ["w"]}],
        },
        "extra": {"step": 10, "name": "run-1", "tags": ["a", "b"], "inf": float("inf"), "nested": {"k": (1, 2)}},
    }


def cli(*args, code: int = 0) -> str:
    """Run the command line in this process; its exit code must be ``code``; returns what it printed."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (args, result.output)
    return result.output


def golden_of(path: str, optimizer_order: str | None = None) -> dict:
    """What ckpttool reads from a checkpoint, in the terms of the golden files (fixtures/*/expected.json):
    per key, a tensor's dtype, shape and sha256 of its bytes, or the canonical form of a value
    (``optimizer_order``: as the commands' option, for a per-rank folder)."""
    import hashlib
    import sys

    from ckpttool.index import TensorEntry

    sys.path.insert(0, FIXTURES)
    from make_realworld import canon

    out = {}
    with open_source(path, reading=formats.Reading(optimizer_order=optimizer_order)) as src:
        index = src.index()
        for key in index:
            if isinstance(index[key], TensorEntry):
                t = src.read_tensor(key)
                data = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
                out[key] = {"dtype": str(t.dtype), "shape": list(t.shape), "sha256": hashlib.sha256(data.numpy().tobytes()).hexdigest()}
            else:
                out[key] = {"value": canon(src.read_object(key))}
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, key: str = "") -> None:
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), f"{key}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    assert torch.equal(bits(a), bits(b)), key


def assert_same_value(a, b, where: str = "value") -> None:
    """Equal and of the same type; NaN equals NaN (a checkpoint must keep it, not 'fix' it)."""
    if isinstance(b, float) and b != b:
        assert isinstance(a, float) and a != a, f"{where}: {a!r} vs {b!r}"
        return
    if type(b).__module__.startswith("numpy") or isinstance(b, tuple):  # numpy values: dtype, shape and bytes
        from ckpttool.safe_pickle import same_value

        assert same_value(a, b), f"{where}: {a!r} vs {b!r}"
        return
    assert a == b and type(a) is type(b), f"{where}: {a!r} ({type(a).__name__}) vs {b!r} ({type(b).__name__})"


def assert_same_nested(a, b, where: str = "state") -> None:
    if isinstance(b, torch.Tensor):
        assert_bitwise(a, b, where)
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), f"{where}: {list(a)} vs {list(b)}"
        for k in b:
            assert_same_nested(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_nested(x, y, f"{where}[{i}]")
    else:
        assert_same_value(a, b, where)


def assert_same_checkpoint(a_path, b_path, what: str = "", dropped=()) -> None:
    """Same keys in the same order, every tensor bitwise, every object equal and of the same type
    (``dropped``: keys of ``a`` the writer of ``b`` said it could not hold)."""
    with open_source(str(a_path)) as a, open_source(str(b_path)) as b:
        keys = [k for k in a.index() if k not in dropped]
        assert keys == list(b.index()), f"{what}: {keys} vs {list(b.index())}"
        for key in keys:
            if hasattr(a.index()[key], "shape"):
                assert_bitwise(a.read_tensor(key), b.read_tensor(key), f"{what}: {key}")
            else:
                assert_same_value(b.read_object(key), a.read_object(key), f"{what}: {key}")


def output_name(fmt: str, stem: str = "out") -> str:
    """A file or directory name that makes ``convert`` write format ``fmt``."""
    reg = next(r for r in formats.registrations() if r.name == fmt)
    return stem + (reg.suffixes[0] if reg.suffixes else "_" + fmt)


def tensor_data_spans(path) -> list[tuple[str, int, int, str]]:
    """(file path, start, end, key) of every non-empty chunk's raw tensor bytes, in any format."""
    spans = []
    with open_source(str(path)) as src:
        for e in src.index().tensors():
            for loc, start, end in src.data_spans(e.key):
                if end > start:
                    spans.append((loc.path, start, end, e.key))
    return spans


def flip_bit(path, byte: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(byte)
        b = f.read(1)[0]
        f.seek(byte)
        f.write(bytes([b ^ (1 << bit)]))


def data_files(path) -> list[str]:
    """Every regular file of a checkpoint (the file itself, or the files in its directory)."""
    path = str(path)
    if os.path.isdir(path):
        return sorted(os.path.join(path, n) for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
    return [path]


class Hang(BaseException):
    """A call that did not return within its time limit (a BaseException: no `except Exception` in the
    code under test can turn it into an ordinary error)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`Hang` in the block after ``seconds`` (SIGALRM: the main thread only), so a
    hang fails its test instead of stalling the suite."""

    def on_alarm(signum, frame):
        raise Hang(f"no result within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
