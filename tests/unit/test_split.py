"""``--nproc N`` starts only the workers that pay for their start (issue 50, part 5): where each
has the cores it keeps busy and the input is large enough; otherwise one process, with a line on
stderr saying why, and the same output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpttool import parallel
from ckpttool.parallel import CORES_PER_WORKER, RATE, START_S, plan_workers, workers_for
from ckpttool.storage import resolve

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "plain-dcp-w2"
CKPTTOOL = [sys.executable, "-m", "ckpttool"]


def sized(n: int):
    asked = []

    def input_bytes(enough: int) -> int:
        asked.append(enough)
        return n

    return input_bytes, asked


def test_cores_decide_first_on_local_files():
    size, asked = sized(10**12)
    n, why = plan_workers(2, size, cores=2 * CORES_PER_WORKER - 1, remote=False)
    assert n == 1 and "3 cores" in why
    assert asked == []  # not sized: the cores already said no
    n, why = plan_workers(8, size, cores=16, remote=False)
    assert (n, why) == (8, None)
    n, why = plan_workers(8, size, cores=4 * CORES_PER_WORKER, remote=False)
    assert n == 4 and "8 cores" in why


def test_size_decides_where_the_cores_allow():
    pays_from = START_S * RATE["local"] * 2  # two workers: the one process's time saved is half
    n, why = plan_workers(2, sized(int(pays_from) - 1)[0], cores=16, remote=False)
    assert n == 1 and "does not pay" in why and f"{pays_from / 1e9:.2f} GB" in why
    size, asked = sized(int(pays_from))
    assert plan_workers(2, size, cores=16, remote=False) == (2, None)
    assert asked == [int(pays_from)]  # counting may stop there
    # more workers save more of the time, so they pay from less
    assert plan_workers(4, sized(int(pays_from * 3 / 4))[0], cores=16, remote=False) == (4, None)


def test_object_stores_split_whatever_the_cores():
    pays_from = START_S * RATE["object store"] * 2
    assert pays_from < START_S * RATE["local"] * 2
    assert plan_workers(2, sized(int(pays_from))[0], cores=1, remote=True) == (2, None)
    n, why = plan_workers(2, sized(int(pays_from) - 1)[0], cores=1, remote=True)
    assert n == 1 and "from an object store" in why


def test_bytes_under_counts_below_and_stops(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").mkdir()
    (tmp_path / "x").write_bytes(b"1" * 10)
    (tmp_path / "a" / "b" / "y").write_bytes(b"2" * 20)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"3" * 1000)
    (tmp_path / "link").symlink_to(outside, target_is_directory=True)  # not followed
    loc = resolve(str(tmp_path))
    assert loc.bytes_under(10**9) == 30
    assert loc.child("x").bytes_under(10**9) == 10
    assert loc.bytes_under(5) == 10  # the top directory's files were enough: the walk stopped there
    (tmp_path / "a" / "z").symlink_to(outside / "big")  # a link to a file counts as the file, once
    (tmp_path / "a" / "z2").symlink_to(outside / "big")
    assert loc.bytes_under(10**9) == 1030
    mem = resolve("memory://split-test/dir")
    mem.child("f").write_bytes(b"4" * 7)
    mem.child("g").write_bytes(b"5" * 5)
    assert mem.bytes_under(10**9) == 12


def test_an_input_that_cannot_be_sized_runs_alone_and_silent(tmp_path, monkeypatch):
    monkeypatch.delenv(parallel.ENV_SPLIT, raising=False)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "loop").symlink_to(tmp_path / "d" / "loop")  # stat fails (ELOOP): the command will say what is wrong
    assert workers_for(2, str(tmp_path / "d"), "memory://split-test/out2") == (1, None)  # (to an object store: sized)


def test_workers_for(tmp_path, monkeypatch):
    monkeypatch.delenv(parallel.ENV_SPLIT, raising=False)
    n, why = workers_for(2, str(FIXTURE), "memory://split-test/out")  # writing to an object store
    assert n == 1 and f"at {RATE['object store'] / 1e6:.0f} MB/s from an object store" in why
    src = resolve("memory://split-test/src")
    src.child("__0_0.distcp").write_bytes(b"6" * 3000)
    n, why = workers_for(2, src.url, None)  # reading an object store
    assert n == 1 and "from an object store" in why
    assert workers_for(2, str(tmp_path / "missing"), None) == (1, None)  # the command's own error follows
    assert workers_for(1, str(FIXTURE), None) == (1, None)
    monkeypatch.setenv(parallel.ENV_SPLIT, "always")
    assert workers_for(3, str(FIXTURE), None) == (3, None)


@pytest.mark.parametrize("command", ["reshard", "convert", "verify"])
def test_nproc_runs_alone_and_says_so(tmp_path, command):
    env = {k: v for k, v in os.environ.items() if k != parallel.ENV_SPLIT}
    outs = {}
    for n in ("1", "2"):
        dst = tmp_path / f"out{n}"
        argv = {"reshard": ["reshard", str(FIXTURE), str(dst), "--world-size", "3"],
                "convert": ["convert", str(FIXTURE), str(dst) + ".safetensors"],
                "verify": ["verify", str(FIXTURE), "--json"]}[command]
        proc = subprocess.run([*CKPTTOOL, *argv, "--nproc", n], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        said = "--nproc 2: running in one process" in proc.stderr
        assert said == (n == "2"), proc.stderr
        outs[n] = proc.stdout.replace(f"out{n}", "outN")
        if command != "verify":
            path = Path(str(dst) + (".safetensors" if command == "convert" else ""))
            outs[n] += repr(sorted((p.relative_to(path).as_posix(), p.read_bytes()) for p in path.rglob("*")) if path.is_dir() else path.read_bytes())
    assert outs["1"] == outs["2"]
