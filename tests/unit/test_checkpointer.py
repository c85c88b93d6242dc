"""Checkpointer in one process without a process group: local paths, file:// and memory:// URLs."""

from __future__ import annotations

import os
import uuid

import fsspec
import pytest
import torch

from ckpttool import Checkpointer
from ckpttool.errors import MismatchError, NotFoundError, OutputExistsError, UsageError


def make(seed=0, out=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, out))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def train_step(model, opt):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def same_optim(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


@pytest.fixture(params=["path", "file", "memory"])
def root(request, tmp_path):
    if request.param == "path":
        yield str(tmp_path / "run")
    elif request.param == "file":
        yield f"file://{tmp_path}/run"
    else:
        name = f"memory://ckpt-{uuid.uuid4().hex}"
        yield name
        fsspec.filesystem("memory").rm(name.removeprefix("memory://"), recursive=True)


def test_save_load_round_trip_bitwise(root):
    model, opt = make()
    train_step(model, opt)
    ck = Checkpointer(root)
    assert ck.steps() == [] and ck.load(*make(1)) is None
    ck.save(1, model, opt, extra={"epoch": 3, "name": "x", "betas": (0.9, 0.95)})
    assert ck.steps() == [1]
    m2, o2 = make(seed=7)
    res = Checkpointer(root).load(m2, o2)  # optimizer without state yet
    assert res.step == 1 and res.extra == {"epoch": 3, "name": "x", "betas": (0.9, 0.95)}
    assert same(model, m2) and same_optim(opt, o2)
    assert o2.param_groups[0]["lr"] == 0.01


def test_newest_and_named_step_and_retention(tmp_path):
    model, opt = make()
    ck = Checkpointer(tmp_path / "run", keep_last=2)
    snapshots = {}
    for step in (1, 2, 3):
        train_step(model, opt)
        ck.save(step, model, opt)
        snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert ck.steps() == [2, 3]
    m2, o2 = make(seed=3)
    assert ck.load(m2, o2).step == 3
    assert ck.load(m2, o2, step=2).step == 2
    assert all(torch.equal(m2.state_dict()[k], v) for k, v in snapshots[2].items())


def test_errors_are_typed_and_name_what_is_wrong(tmp_path):
    model, opt = make()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        Checkpointer(tmp_path / "file").steps()
    ck = Checkpointer(tmp_path / "run")
    ck.save(5, model, opt)
    with pytest.raises(NotFoundError, match=r"step 6 .*committed steps: \[5\]"):
        ck.load(model, opt, step=6)
    with pytest.raises(OutputExistsError, match="step-5"):
        ck.save(5, model, opt)
    wrong, wopt = make(out=4)
    with pytest.raises(MismatchError) as info:
        ck.load(wrong, wopt)
    assert "1.weight" in str(info.value) and "(3, 5)" in str(info.value) and "(4, 5)" in str(info.value)
    bigger = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    with pytest.raises(MismatchError, match="2.weight.*not in the checkpoint"):
        ck.load(bigger)
    with pytest.raises(UsageError):
        Checkpointer(tmp_path / "x", keep_last=0)
    for nice in (-1, 20, 1.5):
        with pytest.raises(UsageError, match="writer_nice"):
            Checkpointer(tmp_path / "x", writer_nice=nice)


def test_a_save_another_rank_refuses_leaves_no_step_directory(tmp_path, monkeypatch):
    """Rank 0 makes the step's directory before the ranks agree; when another rank reports a
    failure (its last background save failed), every rank raises and the directory is removed."""
    from ckpttool import rendezvous as dist
    from ckpttool.errors import RankFailedError

    model, opt = make()
    monkeypatch.setattr(dist, "all_gather", lambda obj, group=None: [obj, (("StorageError", "disk full"), None)])
    ck = Checkpointer(tmp_path / "run")
    with pytest.raises(RankFailedError, match="rank 1 failed: StorageError: disk full"):
        ck.save(1, model, opt)
    assert ck.incomplete() == [] and ck.steps() == []


def test_uncommitted_step_is_ignored_and_listed(tmp_path):
    model, opt = make()
    ck = Checkpointer(tmp_path / "run")
    ck.save(1, model, opt)
    # what a crash leaves: a temp dir mid-write and a step dir without its commit record
    (tmp_path / "run" / ".step-2.tmp-0123abcd").mkdir()
    (tmp_path / "run" / "step-3").mkdir()
    (tmp_path / "run" / "step-3" / "__0_0.distcp").write_bytes(b"partial")
    assert ck.steps() == [1]
    assert ck.incomplete() == [".step-2.tmp-0123abcd", "step-3"]
    assert ck.load(*make(2)).step == 1


def _save_step_2_denied(root: str, how: str, queue) -> None:
    """In a spawned child: lose write permission (as root: become nobody) or the disk (a file size
    limit: writes fail with EFBIG, as on a full disk), then save step 2 synchronously."""
    import os
    import resource
    import signal

    from ckpttool.errors import CkptError

    model, opt = make(seed=1)
    try:
        if how == "permission":
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            # denied for the right reason: the root can be read, just not written
            if not (os.access(root, os.R_OK | os.X_OK) and not os.access(root, os.W_OK)):
                queue.put(("bad set-up", f"root readable={os.access(root, os.R_OK)} writable={os.access(root, os.W_OK)}"))
                return
        else:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (256, resource.RLIM_INFINITY))
        Checkpointer(root).save(2, model, opt)
        queue.put(("no error", ""))
    except CkptError as exc:
        queue.put((type(exc).__name__, exc.message()))
    except BaseException as exc:  # noqa: BLE001 - anything untyped fails the test below
        queue.put((f"untyped {type(exc).__name__}", repr(exc)))


@pytest.mark.parametrize("how,words", [("permission", "permission denied"), ("disk-full", "no space left")])
def test_sync_save_that_cannot_write_fails_clearly_and_keeps_earlier_steps(how, words):
    import multiprocessing
    import os
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="ckpttool-denied-")  # under /tmp, so that nobody can reach it
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "run")
        model, opt = make()
        with Checkpointer(root) as ckpt:  # released: the child is the next job on this root
            ckpt.save(1, model, opt)
        os.chmod(root, 0o555 if how == "permission" else 0o755)
        ctx = multiprocessing.get_context("spawn")  # a fork after torch's thread pool ran can deadlock
        queue = ctx.Queue()
        child = ctx.Process(target=_save_step_2_denied, args=(root, how, queue))
        child.start()
        child.join(120)
        assert child.exitcode == 0
        kind, message = queue.get(timeout=5)
        os.chmod(root, 0o755)
        assert kind == "StorageError" and words in message and root in message, (kind, message)
        ckpt = Checkpointer(root)
        assert ckpt.steps() == [1]
        loaded, lopt = make(seed=2)
        assert ckpt.load(loaded, lopt).step == 1 and same(loaded, model) and same_optim(lopt, opt)
        ckpt.clean()
        assert ckpt.incomplete() == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_rank_0_never_reads_a_half_written_rank_index(tmp_path, monkeypatch):
    """Rank 0 reads a rank's index as soon as its name appears. The index is written slowly here
    (a flushed first half, a pause, the rest) while rank 0 polls: it must wait for the whole file,
    never read an empty or half one (seen once in CI as 'a rank's index is damaged')."""
    import threading
    import time
    from contextlib import contextmanager

    from ckpttool.training import step_writer as save_mod
    from ckpttool.storage import LocalDisk, resolve

    real_open_write = LocalDisk.open_write

    class _Slow:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            view = memoryview(data).cast("B")
            half = view.nbytes // 2
            self._f.write(view[:half])
            self._f.flush()
            time.sleep(0.3)
            self._f.write(view[half:])
            return view.nbytes

    @contextmanager
    def slow_open_write(self, path):
        with real_open_write(self, path) as f:
            yield _Slow(f)

    monkeypatch.setattr(LocalDisk, "open_write", slow_open_write)
    step = resolve(str(tmp_path / "step"))
    step.makedirs()
    index = save_mod.RankIndex(rank=0, file="__0_0.distcp", objects={"step": [0, 10]}, records=[[0, 10, "x"]])
    writer = threading.Thread(target=save_mod.publish_index, args=(step, index))
    writer.start()
    try:
        got = save_mod.read_rank_indexes(step, 1, timeout=10)
    finally:
        writer.join()
    assert got[0].objects == {"step": [0, 10]} and got[0].records == [[0, 10, "x"]]


def test_on_commit_is_told_each_committed_step_and_cannot_undo_one(tmp_path, caplog):
    import logging

    told = []
    model = torch.nn.Linear(3, 2)
    ckpt = Checkpointer(tmp_path / "run", on_commit=lambda step, url: told.append((step, url)))
    ckpt.save(1, model)
    ckpt.save(2, model, blocking=False)
    ckpt.wait()
    assert told == [(1, f"{tmp_path}/run/step-1"), (2, f"{tmp_path}/run/step-2")]

    def fails(step, url):
        raise RuntimeError("a caller's bug")

    ckpt.on_commit = fails
    with caplog.at_level(logging.ERROR, logger="ckpttool"):
        ckpt.save(3, model)
    assert ckpt.steps() == [1, 2, 3] and "on_commit callback failed for step 3" in caplog.text


def test_on_commit_of_an_async_save_cannot_call_back_into_the_checkpointer(tmp_path):
    """on_commit runs in the writer thread: save, wait or close from there would wait for the very
    save that runs it. Each is refused with a UsageError naming on_commit; the step is committed
    and the Checkpointer goes on."""
    import threading

    refused = []
    model, opt = make()
    ckpt = Checkpointer(tmp_path / "run", async_save=True)

    def calls_back(step, url):
        for call in (ckpt.wait, ckpt.close, lambda: ckpt.save(step + 1, model, opt)):
            try:
                call()
            except UsageError as exc:
                refused.append(str(exc))

    ckpt.on_commit = calls_back
    ckpt.save(1, model, opt)
    waiter = threading.Thread(target=ckpt.wait, daemon=True)
    waiter.start()
    waiter.join(timeout=60)
    assert not waiter.is_alive(), "the background save waits for itself"
    assert len(refused) == 3 and all("on_commit" in r for r in refused), refused
    ckpt.on_commit = None
    train_step(model, opt)
    ckpt.save(2, model, opt)
    ckpt.close()
    assert Checkpointer(tmp_path / "run").steps() == [1, 2]


def test_on_phase_reports_where_a_save_goes(tmp_path):
    """The public seam benchmarks time saves through: each phase once per call, in order, with
    its thread; an async save's background phases and its end ("done") in the writer thread."""
    import threading

    from ckpttool.training.checkpointer import PHASES

    seen = []
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(tmp_path / "run", on_phase=lambda name, s, e: seen.append((name, e >= s, threading.current_thread().name)))
    ckpt.save(1, model, optimizer)
    assert [n for n, _, _ in seen] == ["prepare", "state", "write", "commit", "sync save"] and all(ok for _, ok, _ in seen)
    seen.clear()
    ckpt.save(2, model, optimizer, blocking=False)
    ckpt.wait()
    names = [n for n, _, _ in seen]
    assert names[:3] == ["prepare", "state", "stage"] and {"write", "commit", "done", "wait"} <= set(names)
    assert {t for n, _, t in seen if n in ("write", "commit", "done")} == {"ckpttool-save-2"}
    assert set(names) <= set(PHASES) and ckpt.saving is False


def test_every_rank_chooses_the_same_writer_for_a_placement_it_does_not_lay_out():
    """A strided shard beside a Replicate dim: the step writer refuses the placement on every rank,
    whatever the rank's coordinate (a rank whose replica coordinate is not 0 answered "not mine"
    and took ckpttool's writer while rank 0 took DCP's: the ranks then waited for each other)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckpttool import compat
    from ckpttool.training.step_writer import UnsupportedPlacement, stores

    for rank in range(4):
        with compat.fake_rank(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2))
            strided = DTensor.from_local(torch.ones(2, 3), mesh, [Replicate(), _StridedShard(0, split_factor=1)],
                                         run_check=False, shape=(4, 3), stride=(3, 1))
            with pytest.raises(UnsupportedPlacement):
                stores(strided)
            plain = DTensor.from_local(torch.ones(2, 3), mesh, [Replicate(), Shard(0)], run_check=False, shape=(4, 3), stride=(3, 1))
            assert stores(plain) == (rank < 2)  # (the first replica stores each box)


def test_another_ranks_failure_is_typed_names_the_ranks_and_survives_pickling():
    import pickle

    from ckpttool.errors import CkptError, RankFailedError

    error = RankFailedError([1, 3], "writing its part of step 7", "OSError", "[Errno 28] No space left on device", where="/r/s")
    assert isinstance(error, CkptError) and error.ranks == [1, 3]
    assert str(error) == ("/r/s: rank 1 failed: OSError: [Errno 28] No space left on device "
                          "(while writing its part of step 7; rank 3 failed too)")
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) and again.ranks == [1, 3] and again.doing == error.doing


@pytest.mark.parametrize("limit", ["commit record", ".metadata", "manifest"])
def test_a_step_its_own_readers_would_refuse_is_never_committed(tmp_path, monkeypatch, limit):
    """The writer holds every size limit ckpttool's readers hold: a step whose commit record,
    .metadata or manifest file would pass one is refused loudly, never committed, and the step
    before it still loads (a committed step is always one ckpttool can load)."""
    from ckpttool import steps
    from ckpttool.errors import StepTooLargeError
    from ckpttool.training import step_writer

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    ckpt = Checkpointer(str(tmp_path / "run"))
    ckpt.save(1, model)
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1)
    if limit == "commit record":
        monkeypatch.setattr(steps, "MAX_COMMIT_BYTES", 100)
    elif limit == ".metadata":
        monkeypatch.setattr(step_writer, "MAX_METADATA_BYTES", 100)
    else:
        monkeypatch.setattr(steps, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(StepTooLargeError) as caught:
        ckpt.save(2, model)
    assert "more than" in caught.value.what
    monkeypatch.undo()
    assert not os.path.exists(tmp_path / "run" / "step-2") and ckpt.steps() == [1]
    fresh = torch.nn.Linear(64, 32)
    assert Checkpointer(str(tmp_path / "run")).load(fresh).step == 1
    assert torch.equal(fresh.weight, before)
