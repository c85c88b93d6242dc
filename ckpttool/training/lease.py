"""One writer per training root: a lease that rank 0 takes at the first save and refreshes while the
job runs, so a second job started on the same root (a re-submitted job while the first still
runs) fails at once instead of interleaving its steps with the first's.

``ROOT/.ckpttool-lease.json`` names its holder: host, pid (and the process' start time, so a
reused pid is not mistaken for the holder), job id, a random token and the time of the last
refresh. A lease whose holder is gone is taken over with a warning, so resuming after ``kill -9``
needs no manual step: on the same host the holder is gone when its process is; on another host,
when the lease has not been refreshed for ``stale_after`` seconds (clocks are assumed to agree to
well within that). Creation is exclusive where the storage offers it (``O_EXCL`` locally, a
conditional put on S3); what each backend guarantees is in docs/format.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import CkptError, LeaseError
from ..storage import Location

log = logging.getLogger("ckpttool")

LEASE_FILE = ".ckpttool-lease.json"


def _start_time(pid: int) -> int | None:
    """A process' start time in clock ticks since boot (Linux), to tell it from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _job_id() -> str | None:
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return None


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: int | None
    job: str | None
    token: str
    time: float

    def describe(self) -> str:
        job = f", {self.job}" if self.job else ""
        return f"pid {self.pid} on {self.host}{job}, refreshed {max(0.0, time.time() - self.time):.0f} s ago"

    def gone(self, stale_after: float) -> bool:
        """Whether the holder has stopped: its process is gone (same host), or it has not
        refreshed the lease for ``stale_after`` seconds (another host)."""
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
            return self.started is not None and _start_time(self.pid) not in (None, self.started)
        return time.time() - self.time > stale_after

    def same_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()


class Lease:
    """The lease of one training root, held by this process once :meth:`acquire` succeeded."""

    def __init__(self, root: Location, stale_after: float = 600.0, refresh_every: float = 60.0):
        self.loc = root.child(LEASE_FILE)
        self.root = root
        self.stale_after = stale_after
        self.refresh_every = refresh_every
        self.token = uuid.uuid4().hex
        self.held = False
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mine(self) -> Holder:
        return Holder(socket.gethostname(), os.getpid(), _start_time(os.getpid()), _job_id(), self.token, time.time())

    def read(self) -> Holder | None:
        """The current holder, or None when there is no lease (a damaged lease file counts as none)."""
        if not self.loc.exists():
            return None
        try:
            doc = json.loads(self.loc.read_bytes())
            return Holder(str(doc["host"]), int(doc["pid"]), doc.get("started"), doc.get("job"), str(doc["token"]), float(doc["time"]))
        except (ValueError, KeyError, TypeError):
            return None

    def acquire(self) -> None:
        """Hold the lease, or raise :class:`LeaseError` naming the root and the live holder."""
        if self.held:
            self.check()
            return
        mine = self._mine()
        data = json.dumps(asdict(mine)).encode()
        if not self.loc.create_exclusive(data):
            holder = self.read()
            if holder is not None and not holder.same_process() and not holder.gone(self.stale_after):
                raise LeaseError(
                    f"another job holds this training root ({holder.describe()})",
                    where=self.root.url,
                    hint="wait for it to finish or stop it; a lease whose holder is gone is taken over automatically",
                )
            if holder is not None and not holder.same_process():
                log.warning("taking over the lease of %s from %s (its holder is gone)", self.root.url, holder.describe())
            self.loc.replace_bytes(data)
            if (self.read() or mine).token != self.token:  # another job took it over at the same moment
                raise LeaseError(f"another job took over this training root ({self.read().describe()})", where=self.root.url)
        self.held = True
        self._thread = threading.Thread(target=self._refresh, name="ckpttool-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise :class:`LeaseError` when the lease was lost (taken over by another job)."""
        if self.lost:
            raise LeaseError(self.lost, where=self.root.url, hint="stop one of the two jobs")
        holder = self.read()
        if holder is None or holder.token != self.token:
            self.lost = f"this job lost its lease to {holder.describe() if holder else 'nobody (the lease file was removed)'}"
            raise LeaseError(self.lost, where=self.root.url, hint="stop one of the two jobs")

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_every):
            try:
                holder = self.read()
                if holder is None or holder.token != self.token:
                    self.lost = f"this job lost its lease to {holder.describe() if holder else 'nobody'}"
                    return
                self.loc.replace_bytes(json.dumps(asdict(self._mine())).encode())
            except CkptError as exc:  # the next save reports a storage that refuses writes
                log.warning("could not refresh the lease of %s: %s", self.root.url, exc)

    def release(self) -> None:
        """Give the lease up (only if it is still ours)."""
        self._stop.set()
        if not self.held:
            return
        self.held = False
        try:
            holder = self.read()
            if holder is not None and holder.token == self.token:
                self.loc.remove()
        except CkptError as exc:
            log.warning("could not release the lease of %s: %s", self.root.url, exc)

    def state(self) -> dict[str, Any] | None:
        holder = self.read()
        return asdict(holder) if holder else None
