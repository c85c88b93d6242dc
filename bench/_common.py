"""How the benchmarks in ``bench/`` measure: child processes with the peak memory of their process
tree, timing, page-cache control, raw disk bandwidth (the limits), the machine's facts. The
pipeline, tables, verdicts and the chart are harness.py's.

Standard library only, and no torch at import time: a benchmark's parent process and its raw-disk
cases stay small, and each measured case runs in a fresh child whose memory is its own.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

GB = 1000**3  # bandwidths and checkpoint sizes are in GB (10^9 bytes)
MiB = 1 << 20
GiB = 1 << 30
RAW_BUFFER = 64 * MiB  # one os.write / os.readv call moves this much


# --- memory -------------------------------------------------------------------------------------


def proc_status(field_name: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``) in KiB; None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """The counters of ``/proc/PID/io`` (``rchar``: bytes read calls returned, ``read_bytes`` and
    ``write_bytes``: what went to and from the disk); empty if unreadable."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return {line.split(":")[0]: int(line.split()[1]) for line in f}
    except (OSError, ValueError, IndexError):
        return {}


def reset_peak_rss() -> int:
    """Reset this process's RSS high-water mark (``VmHWM``) to its current RSS; returns RSS in KiB.

    Linux only (``/proc/self/clear_refs``); importing torch peaks higher than some work that follows,
    so a peak measured across the imports would hide the work's own growth.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS") or 0


#: whether this kernel has ``/proc/PID/task/TID/children`` (CONFIG_PROC_CHILDREN); else /proc is scanned
_PROC_CHILDREN = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``: from every thread's ``children`` file, or the processes whose
    parent it is. A thread or process gone while it is read is skipped: the poll goes on."""
    out: list[int] = []
    if _PROC_CHILDREN:
        files = [f"/proc/{pid}/task/{tid}/children" for tid in (os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else [])]
    else:
        files = [f"/proc/{name}/stat" for name in os.listdir("/proc") if name.isdigit()]
    for path in files:
        try:
            with open(path) as f:
                text = f.read()
            if _PROC_CHILDREN:
                out.extend(int(x) for x in text.split())
            elif int(text.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(path.split("/")[2]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def proc_private_kib(pid: int | str) -> int | None:
    """Anonymous plus shared-memory resident pages of ``pid`` in KiB (``RssAnon + RssShmem`` of
    ``/proc/PID/status``): what the process itself allocated, without the file-backed pages of the
    libraries it maps (libtorch's, shared by every rank). None if unreadable.

    Not PSS: ``smaps_rollup`` walks every mapping and page table, which for a multi-GB rank costs
    enough CPU at a 50 ms poll to slow the ranks being measured on a 2-core machine."""
    anon, shmem = proc_status("RssAnon", pid), proc_status("RssShmem", pid)
    if anon is None:
        return None
    return anon + (shmem or 0)


def tree_rss_kib(pid: int) -> int:
    """Memory of ``pid`` and all its descendants in KiB: the sum of their anonymous and shmem
    resident pages (file-backed library pages, mapped by every rank, are not counted), each
    process's VmRSS where those fields are missing."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        kib = proc_private_kib(p)
        if kib is None:
            kib = proc_status("VmRSS", p)
        total += kib or 0
        todo.extend(_children(p))
    return total


@dataclass
class ChildRun:
    """What one child process did: exit status, wall time, peak memory, its JSON result."""

    argv: list[str]
    rc: int
    wall_s: float  # from spawn to exit, interpreter start and imports included
    maxrss_kib: int  # getrusage-style peak RSS of the child and its waited-for descendants (wait4): the largest single process
    tree_peak_kib: int  # highest sum of RssAnon+RssShmem over the process tree seen by polling
    result: dict[str, Any] = field(default_factory=dict)  # what the child wrote to its result file
    log_tail: str = ""
    user_s: float = 0.0  # CPU time of the child and its waited-for descendants (wait4)
    sys_s: float = 0.0
    timed_out: bool = False  # killed (with its whole process group) after timeout_s

    @property
    def peak_kib(self) -> int:
        """The peak memory of the process tree: the larger of the two measurements (the largest
        single process's peak RSS, the polled peak of the tree's summed anonymous+shmem pages)."""
        return max(self.maxrss_kib, self.tree_peak_kib)


def run_child(argv: list[str], result_file: str, log_file: str, env: dict[str, str] | None = None,
              poll_s: float = 0.05, timeout_s: float | None = None,
              on_poll: Callable[[float, int, int], None] | None = None) -> ChildRun:
    """Run ``argv`` as a fresh process; measure its wall time and the peak memory of its process tree.

    Two measurements of the peak: ``wait4``'s ``ru_maxrss`` (exact, but the peak RSS of the largest
    *single* process in the tree) and a poll, every ``poll_s``, of the tree's summed RssAnon + RssShmem
    (``/proc/PID/status``, :func:`tree_rss_kib`: the file pages of the torch libraries every rank
    maps do not count; VmRSS for a process without those fields). The poll catches concurrent
    children and may miss a spike shorter than the interval.

    The child runs in a session (and process group) of its own: on ``timeout_s``, and whenever this
    function leaves while members of that group are still alive (an exception, a launcher that
    left ranks behind), the whole group is killed with SIGKILL, not only the direct child. The
    child is expected to write a JSON object to ``result_file``. ``on_poll(seconds, tree_kib, pid)``,
    when given, is called from the polling thread after each poll (an RSS timeline: bench/large.py).
    """
    if os.path.exists(result_file):
        os.remove(result_file)
    peak = [0]
    timed_out = [False]
    reaped = threading.Event()
    with open(log_file, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        pgid = proc.pid  # start_new_session: the child leads its own process group
        done = threading.Event()

        def kill_group() -> None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

        def on_timeout() -> None:
            if not reaped.is_set():
                timed_out[0] = True
                kill_group()

        def poll() -> None:
            while not done.is_set():
                try:
                    kib = tree_rss_kib(proc.pid)
                    peak[0] = max(peak[0], kib)
                    if on_poll is not None:
                        on_poll(time.perf_counter() - t0, kib, proc.pid)
                except Exception:  # noqa: BLE001 - a process vanishing mid-walk: keep polling
                    pass
                done.wait(poll_s)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        timer = None
        if timeout_s:
            timer = threading.Timer(timeout_s, on_timeout)
            timer.daemon = True
            timer.start()
        status, usage = None, None
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            if timer:
                timer.cancel()
            done.set()
            poller.join()
            if status is None:  # interrupted before the child was reaped: it is still alive
                kill_group()
                try:
                    os.wait4(proc.pid, 0)
                except ChildProcessError:
                    pass
            reaped.set()
            # members of the group left behind by the child (ranks of a launcher that died): the
            # group id cannot be reused while any of them lives, so this reaches only them
            kill_group()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
    result: dict[str, Any] = {}
    if os.path.exists(result_file):
        with open(result_file) as f:
            result = json.load(f)
        os.remove(result_file)
    with open(log_file, errors="replace") as f:
        tail = f.read()[-4000:]
    if timed_out[0]:
        tail += f"\n[run_child: killed the process group after the {timeout_s:g} s timeout]"
    return ChildRun(list(argv), proc.returncode, wall, int(usage.ru_maxrss), peak[0], result, tail,
                    user_s=usage.ru_utime, sys_s=usage.ru_stime, timed_out=timed_out[0])


def child_argv(script: str, *args: str) -> list[str]:
    """The command line that runs ``script`` with this interpreter, unbuffered."""
    return [sys.executable, "-u", script, *args]


def measure_child(script: str, args: list[str], work: str, name: str, timeout_s: float | None = None) -> ChildRun:
    """Run one single-process case: ``script ARGS --_result FILE`` in a fresh child (:func:`run_child`),
    its log in ``work/NAME.log``; the child writes its JSON result to FILE."""
    result = os.path.join(work, f"{name}.result.json")
    return run_child(child_argv(script, *args, "--_result", result), result, os.path.join(work, f"{name}.log"),
                     timeout_s=timeout_s)


def report_failure(name: str, run: ChildRun) -> None:
    """Print a failed case's exit status and the end of its log: the benchmark goes on with the next case."""
    print(f"  !! {name} failed (exit {run.rc}):\n{run.log_tail[-6000:]}", file=sys.stderr)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds that ``fn()`` takes (``perf_counter``), for work timed inside one process."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# --- page cache and fsync -----------------------------------------------------------------------


def drop_caches() -> bool:
    """``sync`` then drop the page cache (needs root); True when the cache was dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cold_cache(warm: bool) -> bool:
    """Whether to drop the page cache before each case: unless ``--warm``, where it can be (root;
    said when it cannot: the results are then warm-cache ones)."""
    return not warm and "cold" in cache_states("cold", "running warm")


def cache_states(spec: str, instead: str = "cold cases skipped") -> list[str]:
    """The cache states of ``--caches`` (``cold,warm``) that can run here: ``cold`` needs root."""
    caches = [c for c in spec.split(",") if c]
    if "cold" in caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print(f"cannot drop the page cache (needs root): {instead}", file=sys.stderr)
        caches = [c for c in caches if c != "cold"]
    return caches


def fsync_tree(path: str) -> int:
    """fsync every file under ``path`` (or the file itself) and the directories; returns bytes seen."""
    total = 0
    paths = []
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            paths.extend(os.path.join(root, n) for n in files)
            paths.append(root)
    elif os.path.exists(path):
        paths.append(path)
        paths.append(os.path.dirname(os.path.abspath(path)))
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            if not os.path.isdir(p):
                total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def path_bytes(path: str) -> int:
    """Bytes of a file, or of every file under a directory."""
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(path) for n in fs)
    return os.path.getsize(path) if os.path.exists(path) else 0


def remove(path: str) -> None:
    """Remove a file or a directory tree, if there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


# --- raw disk bandwidth -------------------------------------------------------------------------


def pattern_buffer(size: int = RAW_BUFFER) -> memoryview:
    """The buffer :func:`raw_write` writes, of incompressible bytes (no layer below can shortcut
    zeros): build it before the clock starts."""
    block = os.urandom(1 << 20)
    return memoryview((block * (size // len(block) + 1))[:size])


def raw_write(path: str, nbytes: int, buf_size: int = RAW_BUFFER, buf: memoryview | None = None,
              start: threading.Barrier | None = None) -> dict[str, float]:
    """Write ``nbytes`` to a new file with ``os.write`` of one large buffer, then fsync.

    The physical limit of any writer on that filesystem: no serialisation, no copies. ``buf``: the
    buffer to write (from :func:`pattern_buffer`, built by the caller before its clock starts; built
    here, before this function's clock, when not given). ``start``: a barrier to wait on just before
    the clock starts (parallel streams start together). Returns the time of the writes and of the
    fsync separately, their sum, and the ``perf_counter`` at the start and the end (``t_start``,
    ``t_end``: the span of parallel streams).
    """
    if buf is None:
        buf = pattern_buffer(buf_size)
    buf_size = len(buf)
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            n = os.write(fd, buf[: min(left, buf_size)])
            left -= n
        t1 = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    t2 = time.perf_counter()
    return {"write_s": t1 - t0, "fsync_s": t2 - t1, "seconds": t2 - t0, "bytes": nbytes, "t_start": t0, "t_end": t2}


def read_chunks(path: str, buf: bytearray) -> Iterator[int]:
    """Read ``path`` start to end with ``os.readv`` into ``buf``; yields the bytes each call read.

    The read loop of every raw reference (read, copy, read + CRC-32): one large buffer, no copies."""
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            n = os.readv(fd, [buf])
            if not n:
                return
            yield n
    finally:
        os.close(fd)


def raw_read(paths: list[str], buf_size: int = RAW_BUFFER) -> dict[str, float]:
    """Read files start to end with ``os.readv`` into one buffer (cold when the cache was dropped)."""
    buf = bytearray(buf_size)
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        for n in read_chunks(p, buf):
            total += n
    return {"seconds": time.perf_counter() - t0, "bytes": total}


def raw_copy(paths: list[str], dst: str, buf_size: int = RAW_BUFFER) -> dict[str, float]:
    """Read files and append them to one output, then fsync: what an ideal one-disk converter does."""
    buf = bytearray(buf_size)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for p in paths:
            for n in read_chunks(p, buf):
                done = 0
                while done < n:
                    done += os.write(out, view[done:n])
                total += n
        os.fsync(out)
    finally:
        os.close(out)
    return {"seconds": time.perf_counter() - t0, "bytes": total}


# --- the machine --------------------------------------------------------------------------------


def machine_facts(path: str) -> dict[str, Any]:
    """Cores, memory, CPU, kernel and the disk behind ``path``: what a reader needs to compare runs."""
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    try:
        facts["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        with open("/proc/meminfo") as f:
            mem = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split(":")[0] in ("MemTotal", "SwapTotal")}
        facts["mem_total_gib"] = round(mem.get("MemTotal", 0) / MiB, 1)
        facts["swap_gib"] = round(mem.get("SwapTotal", 0) / MiB, 1)
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            facts["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    facts["disk_total_gb"] = round(usage.total / GB, 1)
    facts["disk_free_gb"] = round(usage.free / GB, 1)
    try:
        dev, fstype = _mount_of(path)
        facts["disk_device"], facts["disk_fs"] = dev, fstype
        name = os.path.basename(dev)
        rot = f"/sys/block/{name}/queue/rotational"
        if os.path.exists(rot):
            with open(rot) as f:
                facts["disk_rotational"] = f.read().strip() == "1"
    except OSError:
        pass
    return facts


def _mount_of(path: str) -> tuple[str, str]:
    path = os.path.realpath(path)
    best = ("", "", "")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[1]):
                best = (dev, mnt, fstype)
    return best[0], best[2]


def code_version(repo: str, paths: tuple[str, ...] = ("ckpttool",)) -> dict[str, Any]:
    """The commit and a digest of uncommitted changes under ``paths``: what code a run measured.

    Take it at the start and at the end of a run; if they differ, the code changed under it.
    """
    import hashlib

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    diff = git("diff", "HEAD", "--", *paths)
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or None,
            "dirty": bool(diff), "diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None}


def write_json(path: str, doc: Any) -> None:
    """Write ``doc`` as indented JSON through a temporary file: a results file is never half-written."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    os.replace(tmp, path)
