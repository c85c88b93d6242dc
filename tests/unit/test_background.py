"""The background threads of async saves: one long-lived thread per role, jobs in order, the
interpreter waits for a pending job and not for an idle thread, a lower priority where asked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ckpttool.training.background import Worker


def test_jobs_run_in_order_on_one_thread_which_close_ends():
    worker = Worker("ckpttool-test")
    seen = []
    jobs = [worker.submit(lambda i=i: seen.append((i, threading.get_ident())), name=f"job-{i}") for i in range(5)]
    for job in jobs:
        assert job.wait(10)
    assert [i for i, _ in seen] == list(range(5))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
    worker.close()
    assert not any(t.name == "ckpttool-test" for t in threading.enumerate())
    job = worker.submit(lambda: seen.append(("again", threading.get_ident())))  # a new thread after close()
    assert job.wait(10) and seen[-1][0] == "again"
    worker.close()


def test_a_job_that_raises_does_not_stop_the_worker():
    worker = Worker("ckpttool-test")
    boom = worker.submit(lambda: 1 / 0)
    after = worker.submit(lambda: None)
    assert boom.wait(10) and after.wait(10)
    worker.close()


def test_the_thread_is_named_after_the_job_while_it_runs():
    worker = Worker("ckpttool-test")
    names = []
    worker.submit(lambda: names.append(threading.current_thread().name), name="ckpttool-save-7").wait(10)
    worker.submit(lambda: names.append(threading.current_thread().name)).wait(10)
    worker.close()
    assert names == ["ckpttool-save-7", "ckpttool-test"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")
def test_a_worker_runs_at_its_nice_value_and_the_caller_keeps_its_own():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = Worker("ckpttool-test", nice=19)
    seen = []
    worker.submit(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))).wait(10)
    worker.close()
    assert seen == [19] and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_the_interpreter_waits_for_a_pending_job_but_not_for_an_idle_worker(tmp_path):
    """A process whose main thread ends while a job runs exits once the job is done (the file is
    written); an idle worker delays the exit by at most its idle check."""
    done = tmp_path / "done"
    script = textwrap.dedent(f"""
        import time
        from ckpttool.training.background import Worker
        idle = Worker("idle")
        idle.submit(lambda: None).wait()
        busy = Worker("busy")
        busy.submit(lambda: (time.sleep(1.0), open({str(done)!r}, "w").write("ok")))
    """)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, cwd=os.getcwd())
    took = time.perf_counter() - t
    assert done.read_text() == "ok"
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import ckpttool.training.background"], check=True, timeout=60, cwd=os.getcwd())
    bare = time.perf_counter() - t
    assert took < bare + 1.0 + 1.5  # the job's second and some slack; never the 60 s timeout


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info() or torch.get_num_threads() < 2,
                    reason="torch's threads of this build are not OpenMP's, or there is one already")
def test_a_worker_runs_torch_operators_on_its_own_thread_and_leaves_the_others_alone():
    """A worker's torch operators run on its thread alone (an OpenMP team would spin on training's
    cores after each one: background.py), set for that thread only: the caller's and threads
    started afterwards keep torch's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(before)  # (as a training script may: torch then sets each new thread's count to it)
    seen = []
    worker = Worker("ckpttool-test")
    worker.submit(lambda: seen.append(torch.get_num_threads())).wait()
    worker.close()
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen == [1] and torch.get_num_threads() == before and later == [before]
