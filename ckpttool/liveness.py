"""Which ranks of a job are alive, and where each one is in its save.

Every rank of a job with a process group beats in the job's key-value store (the default group's
TCPStore or FileStore, reached without a collective) about once a second: a counter, the step it
is saving, the phase it is in and the bytes of that step it has written. A rank that waits for
others reads their beats between polls: a counter that has not moved for ``dead_after`` seconds
is a dead rank (killed, or its process stopped), named with the phase it was last seen in; ranks
still at work long after the rest are named as stragglers, in one log line repeated at growing
intervals. A store that cannot be reached at all is rank 0's death: under a plain launch its
process hosts the store (under torchrun, its node's agent).

Why the store and not a collective: a collective with a dead rank waits in C++ until the process
group's timeout (30 minutes by default), where nothing can look at anything; a poll of the store
can. The store is the job's own: nothing is written to the checkpoint's storage to tell who lives.

Rank 0 watches every rank it waits for; the others watch rank 0 alone, which names the dead or
failed to them (through the store at an agreement, through the store and the step's directory at
a commit): the load on the store grows with the ranks, not their square. A rank that stays alive
but never comes (hung in a collective of its own) is waited for until the wait's timeout
(``commit_timeout``), with rank 0 naming it as a straggler at growing intervals meanwhile.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("ckpttool")

#: seconds between two beats of a rank
BEAT_S = 1.0
#: how long a rank's beat may stand still before it is taken for dead (Checkpointer's default)
DEAD_AFTER = 10.0
#: how long ranks still at work may trail the rest before rank 0 names them (Checkpointer's default)
STRAGGLER_AFTER = 10.0


@dataclass
class Beat:
    """What a rank says of itself, once a second."""

    rank: int
    n: int = 0  # counts beats: a dead rank's stands still
    step: int | None = None  # the step it saves (or last saved)
    phase: str = "idle"  # where it is in that save (Checkpointer's phases, or "done")
    written: int = 0  # bytes of this step it has written
    seq: int = 0  # the agreements it has entered
    failed: list[Any] | None = None  # [step, error type, text] of its last save that failed (kept as it moves on)

    def where(self) -> str:
        at = self.phase if self.step is None else f"{self.phase} of step {self.step}"
        return f"{at}, {_size(self.written)} written" if self.written else at


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class Roll:
    """One rank's beats, and its view of the others'. ``key``: a prefix that all ranks of this job
    (and of this Checkpointer) share and no other job or restart does."""

    def __init__(self, store: Any, rank: int, world_size: int, key: str, *, dead_after: float = DEAD_AFTER,
                 straggler_after: float = STRAGGLER_AFTER, beat_s: float = BEAT_S):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.key = key
        self.dead_after = dead_after
        self.straggler_after = straggler_after
        self.beat_s = beat_s
        self.mine = Beat(rank)
        self.seq = 0
        self._lock = threading.Lock()
        self._send = threading.Lock()
        self._seen: dict[int, tuple[int, float, Beat]] = {}  # rank -> (its counter, when it last moved here, its beat)
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, name="ckpttool-beat", daemon=True)
        self._thread.start()

    # --- this rank ---------------------------------------------------------------------------

    def beat_key(self, rank: int) -> str:
        return f"{self.key}/beat/{rank}"

    def at(self, step: int | None, phase: str) -> None:
        """This rank is now in ``phase`` of ``step`` (said at once, not at the next beat)."""
        with self._lock:
            if step != self.mine.step:
                self.mine.written = 0
            self.mine.step, self.mine.phase = step, phase
        self.beat()

    def failed(self, step: int | None, error_type: str, text: str) -> None:
        """This rank's part of ``step`` failed: whoever waits for it learns so from the beat (said
        at once, and kept while the rank moves on or closes), even where the checkpoint's storage
        cannot take the rank's word."""
        with self._lock:
            self.mine.step, self.mine.phase, self.mine.failed = step, "failed", [step, error_type, text[:2000]]
        self.beat()

    def wrote(self, nbytes: int) -> None:
        """This rank has written ``nbytes`` of its step so far (sent with the next beat)."""
        self.mine.written = nbytes

    def beat(self) -> None:
        with self._send:  # (one beat at a time: a later one never lands before an earlier one)
            with self._lock:
                self.mine.n += 1
                payload = json.dumps(asdict(self.mine))
            try:
                self.store.set(self.beat_key(self.rank), payload)
            except Exception:  # noqa: BLE001 - a store that went away: the waits say so, with whom
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            self.beat()

    def close(self) -> None:
        """This rank's Checkpointer is closed: its last beat says so (a rank that closed and exited
        is no dead rank to anyone who looks later), and the beats stop."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.at(self.mine.step, "closed")

    def linger(self, timeout: float = 5.0) -> None:
        """Rank 0 at exit: the job's store may live in this process (a plain launch), and the other
        ranks may be between two polls of the last agreement; wait (at most ``timeout`` seconds)
        until each has seen it complete, so that none takes this rank's exit for its death."""
        if self.rank != 0 or self.seq == 0:
            return
        deadline = time.monotonic() + timeout
        key = f"{self.key}/x/{self.seq}/seen"
        while time.monotonic() < deadline:
            try:
                if self.store.add(key, 0) >= self.world_size:
                    return
            except Exception:  # noqa: BLE001 - the store is gone already: nothing to wait for
                return
            time.sleep(0.002)

    # --- the others --------------------------------------------------------------------------

    def look(self, ranks: list[int]) -> dict[int, Beat]:
        """The beats of ``ranks`` now (one read of the store), each counter's last move noted.
        Raises :class:`RankDeadError` naming rank 0 when the store does not answer."""
        if not ranks:
            return {}
        try:
            raw = self.store.multi_get([self.beat_key(r) for r in ranks])
        except Exception as exc:  # noqa: BLE001 - connection refused or reset: the store's host is gone
            raise self._store_gone(exc) from None
        now = time.monotonic()
        beats = {}
        for r, value in zip(ranks, raw):
            beat = Beat(**json.loads(value))
            last = self._seen.get(r)
            if last is None or last[0] != beat.n:
                self._seen[r] = (beat.n, now, beat)
            else:
                self._seen[r] = (last[0], last[1], beat)
            beats[r] = beat
        return beats

    def dead(self, ranks: list[int]) -> list[int]:
        """Of ``ranks`` (looked at just now, each awaited), those whose beat has stood still for
        ``dead_after``, and those that closed their Checkpointer: neither will come."""
        now = time.monotonic()
        return [r for r in ranks if r in self._seen and (now - self._seen[r][1] >= self.dead_after
                                                          or self._seen[r][2].phase == "closed")]

    def last_seen(self, rank: int) -> str:
        seen = self._seen.get(rank)
        if seen is None:
            return "nowhere yet"
        return f"{time.monotonic() - seen[1]:.0f} s ago, {seen[2].where()}"

    def _store_gone(self, exc: BaseException) -> BaseException:
        from .errors import RankDeadError

        return RankDeadError([0], {0: f"{self.last_seen(0)} (the job's store, which rank 0 or its node hosts, "
                                      f"does not answer: {str(exc).splitlines()[0][:200]})"}, "waiting for it")

    def dead_error(self, ranks: list[int], doing: str, where: str | None = None) -> BaseException:
        from .errors import RankDeadError

        return RankDeadError(ranks, {r: self.last_seen(r) for r in ranks}, doing, where=where)

    # --- waiting -----------------------------------------------------------------------------

    def watch(self, doing: str, step: int | None = None) -> Watch:
        return Watch(self, doing, step)


class Watch:
    """One wait of this rank for others: call :meth:`check` between polls with the ranks still
    awaited; it looks at their beats at most every ``beat_s / 2`` seconds, raises
    :class:`RankDeadError` for the dead (and those that closed), :class:`RankFailedError` for those
    whose part of ``step`` failed, and (rank 0) logs the ranks that trail the rest by
    ``straggler_after`` seconds. A rank other than 0 watches rank 0 alone, which watches the others
    and tells it."""

    def __init__(self, roll: Roll, doing: str, step: int | None):
        self.roll = roll
        self.doing = doing
        self.step = step
        self.start = time.monotonic()
        self._looked = 0.0
        self._missing: set[int] | None = None
        self._rest_done = self.start  # when the last awaited rank that is done got done
        self._next_say = roll.straggler_after
        self.where: str | None = None

    def check(self, missing: Callable[[], list[int]] | list[int]) -> None:
        """``missing``: the ranks not done yet (rank 0's view), or [0] for a rank that waits for rank 0."""
        now = time.monotonic()
        if now - self._looked < self.roll.beat_s / 2:
            return
        self._looked = now
        waiting = list(missing() if callable(missing) else missing)
        if self._missing is not None and set(waiting) < self._missing:
            self._rest_done = now
        self._missing = set(waiting)
        roll = self.roll
        waiting = [r for r in waiting if r != roll.rank]
        beats = roll.look(waiting)
        failed = [r for r in waiting if beats[r].failed and self.step is not None and beats[r].failed[0] == self.step]
        if failed:  # (before the dead: a rank whose part failed may have closed and gone since)
            from .errors import RankFailedError

            raise RankFailedError(failed, self.doing, *beats[failed[0]].failed[1:], where=self.where)
        dead = roll.dead(waiting)
        if dead:
            raise roll.dead_error(dead, self.doing, self.where)
        behind = now - self._rest_done
        if roll.rank == 0 and self._missing and behind >= self._next_say:
            self._next_say *= 2
            at = "; ".join(f"rank {r}: {beats[r].where()}" for r in sorted(self._missing) if r in beats)
            log.warning("ckpttool: %s: rank(s) %s still at work %.0f s after the rest (%s)", self.doing,
                        ", ".join(map(str, sorted(self._missing))), behind, at)


def wait_until(done: Callable[[], bool], watch: Watch | None, missing: Callable[[], list[int]] | list[int],
               timeout: float | None = None, on_timeout: Callable[[], BaseException] | None = None,
               longest: float = 0.2) -> None:
    """Poll ``done()`` (1 ms, growing to ``longest``) until it holds, with ``watch`` checking on
    ``missing`` between polls; after ``timeout`` seconds, ``on_timeout()`` is raised."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.001
    while not done():
        if watch is not None:
            watch.check(missing)
        if deadline is not None and time.monotonic() > deadline:
            if on_timeout is None:
                from .errors import RendezvousError

                raise RendezvousError(f"still waiting after {timeout:.0f} s")
            raise on_timeout()
        time.sleep(pause)
        pause = min(pause * 2, longest)
