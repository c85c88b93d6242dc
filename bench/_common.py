"""How the benchmarks measure: child processes and their process tree's peak memory, timing, the page
cache, raw disk bandwidth (the limits), the machine's facts. Standard library only, no torch at import
time: a benchmark's parent and its raw-disk cases stay small; each measured case runs in a fresh child.
"""

import contextlib
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


def read_text(path: str) -> str:
    """A file's text (undecodable bytes replaced); empty if it cannot be read (a process gone)."""
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()
    return ""


def _proc_numbers(path: str) -> dict[str, int]:
    """The numeric fields of a ``/proc`` file of ``Name: value [kB]`` lines (``status``, ``io``, ``meminfo``)."""
    fields = [(key, value.split()[:1]) for key, _, value in (line.partition(":") for line in read_text(path).splitlines())]
    return {key: int(v[0]) for key, v in fields if v and v[0].isdigit()}


def proc_status(field_name: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``) in KiB; None if gone."""
    return _proc_numbers(f"/proc/{pid}/status").get(field_name)


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """``/proc/PID/io`` (``rchar``: bytes read calls returned; ``read_bytes``, ``write_bytes``: the disk's)."""
    return _proc_numbers(f"/proc/{pid}/io")


def reset_peak_rss() -> int:
    """Reset this process's ``VmHWM`` to its current RSS (``/proc/self/clear_refs``); returns RSS in KiB.
    Importing torch peaks higher than some work that follows: a peak across it would hide the work's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS") or 0


#: whether this kernel has ``/proc/PID/task/TID/children`` (CONFIG_PROC_CHILDREN); else /proc is scanned
_PROC_CHILDREN = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def tree_rss_kib(pid: int) -> int:
    """Memory of ``pid`` and its descendants in KiB: the sum of their ``RssAnon + RssShmem`` (``/proc/PID/status``:
    what they allocated, not the file pages of the libraries every rank maps), VmRSS where those are missing. Not
    PSS: ``smaps_rollup`` walks every mapping and page table: at a 50 ms poll of multi-GB ranks, a 2-core machine slows."""
    if not _PROC_CHILDREN:  # no children files: every process's parent, read once
        stats = {int(name): read_text(f"/proc/{name}/stat") for name in os.listdir("/proc") if name.isdigit()}
        parents = {p: text.rsplit(")", 1)[-1].split()[1:2] for p, text in stats.items()}
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        s = _proc_numbers(f"/proc/{p}/status")
        total += s["RssAnon"] + s.get("RssShmem", 0) if "RssAnon" in s else s.get("VmRSS", 0)
        if _PROC_CHILDREN:  # its children: those of each of its threads
            tids = os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []
            todo += [int(x) for tid in tids for x in read_text(f"/proc/{p}/task/{tid}/children").split()]
        else:
            todo += [q for q, ppid in parents.items() if ppid == [str(p)]]
    return total


@dataclass
class ChildRun:
    """What one child process did: exit status, wall time, peak memory, its JSON result."""
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
    def peak_kib(self) -> int:  # the process tree's peak memory: the larger of the two measurements
        return max(self.maxrss_kib, self.tree_peak_kib)


def run_child(argv: list[str], result_file: str, log_file: str, env: dict[str, str] | None = None, poll_s: float = 0.05,
              timeout_s: float | None = None, on_poll: Callable[[float, int, int], None] | None = None) -> ChildRun:
    """Run ``argv`` as a fresh process, which writes a JSON object to ``result_file``; measure its wall time and its
    process tree's peak memory, two ways: ``wait4``'s ``ru_maxrss`` (exact, but of the largest *single* process) and a
    poll every ``poll_s`` of the tree's summed RssAnon + RssShmem (:func:`tree_rss_kib`: concurrent children; a spike
    shorter than the interval may be missed). The child leads a session of its own: past ``timeout_s`` (seen by the
    poll), and whenever members of its group outlive it or this function (an exception, a launcher's ranks left behind),
    the whole group gets SIGKILL. ``on_poll(seconds, tree_kib, pid)``: called after each poll (large.py)."""
    remove(result_file)
    peak, timed_out, done = [0], [False], threading.Event()
    with open(log_file, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def kill_group() -> None:  # start_new_session: the child's pid is its group's id
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

        def poll() -> None:  # until the child is reaped: the tree's memory, and the timeout
            while not done.is_set():
                try:
                    kib = tree_rss_kib(proc.pid)
                    peak[0] = max(peak[0], kib)
                    if on_poll is not None:
                        on_poll(time.perf_counter() - t0, kib, proc.pid)
                except Exception:  # noqa: BLE001 - a process vanishing mid-walk: keep polling
                    pass
                if timeout_s and not timed_out[0] and time.perf_counter() - t0 > timeout_s:
                    timed_out[0] = True
                    kill_group()
                done.wait(poll_s)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        status, usage = None, None
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            done.set()
            poller.join()
            if status is None:  # interrupted before the child was reaped: it is still alive
                kill_group()
                with contextlib.suppress(ChildProcessError):
                    os.wait4(proc.pid, 0)
            # members left behind by the child (ranks of a launcher that died): the group id cannot
            # be reused while any of them lives, so this reaches only them
            kill_group()
        wall = time.perf_counter() - t0
    result = read_json(result_file, {})
    remove(result_file)
    tail = read_text(log_file)[-4000:]
    if timed_out[0]:
        tail += f"\n[run_child: killed the process group after the {timeout_s:g} s timeout]"
    return ChildRun(os.waitstatus_to_exitcode(status), wall, int(usage.ru_maxrss), peak[0], result, tail,
                    user_s=usage.ru_utime, sys_s=usage.ru_stime, timed_out=timed_out[0])


def child_argv(script: str, *args: str) -> list[str]:
    """The command line that runs ``script`` with this interpreter, unbuffered."""
    return [sys.executable, "-u", script, *args]


def report_failure(name: str, run: ChildRun) -> None:
    """Print a failed case's exit status and the end of its log: the benchmark goes on with the next case."""
    print(f"  !! {name} failed (exit {run.rc}):\n{run.log_tail[-6000:]}", file=sys.stderr)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds that ``fn()`` takes (``perf_counter``), for work timed inside one process."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def drop_caches() -> bool:
    """``sync`` then drop the page cache (needs root); True when the cache was dropped."""
    os.sync()
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
        return True
    return False


def cache_states(spec: str, instead: str = "cold cases skipped") -> list[str]:
    """The cache states of ``--caches`` (``cold,warm``) that can run here: ``cold`` needs root."""
    caches = [c for c in spec.split(",") if c]
    if "cold" in caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print(f"cannot drop the page cache (needs root): {instead}", file=sys.stderr)
        caches = [c for c in caches if c != "cold"]
    return caches


def fsync_tree(path: str) -> int:
    """fsync every file under ``path`` (or the file itself) and the directories; returns bytes seen."""
    paths = ([p for root, _, files in os.walk(path) for p in [*(os.path.join(root, n) for n in files), root]] if os.path.isdir(path)
             else [path, os.path.dirname(os.path.abspath(path))] if os.path.exists(path) else [])
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            total += 0 if os.path.isdir(p) else os.fstat(fd).st_size
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


def pattern_buffer(size: int = RAW_BUFFER) -> memoryview:
    """:func:`raw_write`'s buffer, of incompressible bytes (nothing can shortcut zeros): build it before the clock."""
    block = os.urandom(1 << 20)
    return memoryview((block * (size // len(block) + 1))[:size])


def raw_write(path: str, nbytes: int, buf: memoryview, start: threading.Barrier | None = None) -> dict[str, float]:
    """Write ``nbytes`` to a new file with ``os.write`` of one large buffer (``buf``: :func:`pattern_buffer`'s, built
    before the clock), then fsync; ``start``: a barrier to wait on just before the clock (parallel streams start
    together). The writes' and the fsync's time, their sum, and the ``perf_counter`` at the start and end (``t_start``,
    ``t_end``: the span of parallel streams)."""
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(left, len(buf))])
        t1 = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    t2 = time.perf_counter()
    return {"write_s": t1 - t0, "fsync_s": t2 - t1, "seconds": t2 - t0, "bytes": nbytes, "t_start": t0, "t_end": t2}


def read_chunks(path: str, buf: bytearray) -> Iterator[int]:
    """Read ``path`` with ``os.readv`` into ``buf``, yielding each call's bytes: every raw reference's loop."""
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [buf]):
            yield n
    finally:
        os.close(fd)


def raw_read(paths: list[str]) -> dict[str, float]:
    """Read files start to end with ``os.readv`` into one buffer (cold when the cache was dropped)."""
    buf, t0 = bytearray(RAW_BUFFER), time.perf_counter()
    total = sum(n for p in paths for n in read_chunks(p, buf))
    return {"seconds": time.perf_counter() - t0, "bytes": total}


def raw_copy(paths: list[str], dst: str) -> dict[str, float]:
    """Read files and append them to one output, then fsync: what an ideal one-disk converter does."""
    buf = bytearray(RAW_BUFFER)
    view, total, t0 = memoryview(buf), 0, time.perf_counter()
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for n in (n for p in paths for n in read_chunks(p, buf)):
            done = 0
            while done < n:
                done += os.write(out, view[done:n])
            total += n
        os.fsync(out)
    finally:
        os.close(out)
    return {"seconds": time.perf_counter() - t0, "bytes": total}


def machine_facts(path: str) -> dict[str, Any]:
    """Cores, memory, CPU, kernel and the disk behind ``path``: what a reader needs to compare runs."""
    mem, cpuinfo = _proc_numbers("/proc/meminfo"), read_text("/proc/cpuinfo").splitlines()  # (Linux, as all of bench/)
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                             "cpus_usable": len(os.sched_getaffinity(0)), "mem_total_gib": round(mem.get("MemTotal", 0) / MiB, 1),
                             "swap_gib": round(mem.get("SwapTotal", 0) / MiB, 1),
                             "cpu_model": next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")}
    usage = shutil.disk_usage(path)
    facts["disk_total_gb"], facts["disk_free_gb"] = round(usage.total / GB, 1), round(usage.free / GB, 1)
    real, mount = os.path.realpath(path), ("", "", "")  # the longest mount point above path
    for dev, mnt, fstype in (line.split()[:3] for line in read_text("/proc/mounts").splitlines()):
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(mount[1]):
            mount = (dev, mnt, fstype)
    facts["disk_device"], facts["disk_fs"] = mount[0], mount[2]
    rot = f"/sys/block/{os.path.basename(mount[0])}/queue/rotational"
    if os.path.exists(rot):
        facts["disk_rotational"] = read_text(rot).strip() == "1"
    return facts


def code_version(repo: str, paths: tuple[str, ...] = ("ckpttool",)) -> dict[str, Any]:
    """The commit and a digest of uncommitted changes under ``paths``: the code a run measured (at its start and end)."""
    import hashlib

    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True).stdout
        return ""

    diff = git("diff", "HEAD", "--", *paths)
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or None,
            "dirty": bool(diff), "diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None}


def read_json(path: str, default: Any = None) -> Any:
    """The JSON document in ``path``, or ``default`` when there is no such file."""
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        return json.load(f)
    return default


def write_json(path: str, doc: Any) -> None:
    """Write ``doc`` as indented JSON through a temporary file: a results file is never half-written."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    os.replace(tmp, path)
