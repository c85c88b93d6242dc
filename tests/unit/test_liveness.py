"""The ranks' beats (ckpttool/liveness.py) on a real store, in one process: two Rolls stand for
two ranks. What the multi-process tests show end to end (tests/dist/test_dead_ranks.py), here
with short times and each rule on its own."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckpttool.errors import RankDeadError, RankFailedError
from ckpttool.liveness import Roll, wait_until


@pytest.fixture
def rolls(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 2)
    made = [Roll(store, r, 2, "job", dead_after=0.4, straggler_after=0.2, beat_s=0.05) for r in range(2)]
    yield made
    for roll in made:
        roll._stop.set()


def _stop_beating(roll: Roll) -> None:
    """A rank killed: its beat thread stops and nothing else is said."""
    roll._stop.set()
    roll._thread.join()


def test_a_rank_whose_beat_stands_still_is_named_with_its_phase(rolls):
    zero, one = rolls
    one.at(4, "write")
    one.wrote(3 << 20)
    time.sleep(0.1)
    watch = zero.watch("writing its part of step 4", 4)
    watch.check([1])  # alive
    _stop_beating(one)
    start = time.monotonic()
    with pytest.raises(RankDeadError) as got:
        wait_until(lambda: False, watch, [1])
    assert 0.3 < time.monotonic() - start < 2.0
    assert got.value.ranks == [1]
    assert "write of step 4, 3.0 MiB written" in got.value.phases[1]
    assert "rank 1 stopped answering" in str(got.value) and "while writing its part of step 4" in str(got.value)


def test_a_live_rank_is_never_named_dead_however_long_it_takes(rolls):
    zero, one = rolls
    one.at(4, "write")
    watch = zero.watch("writing its part of step 4", 4)
    end = time.monotonic() + 1.5  # almost 4x dead_after
    wait_until(lambda: time.monotonic() > end, watch, [1])


def test_a_rank_that_closed_while_awaited_is_named_at_once(rolls):
    """(One that closed and is not awaited is no one's concern: only awaited ranks are looked at.)"""
    zero, one = rolls
    one.at(4, "write")
    one.close()
    start = time.monotonic()
    with pytest.raises(RankDeadError) as got:
        wait_until(lambda: False, zero.watch("writing its part of step 4", 4), [1])
    assert time.monotonic() - start < 0.3 and "closed of step 4" in got.value.phases[1]


def test_a_rank_whose_beat_says_its_part_failed_ends_the_wait_at_once(rolls):
    zero, one = rolls
    one.failed(4, "StorageError", "disk full")
    one.at(6, "prepare")  # it moves on (or closes): its failure of step 4 stays in its beat
    with pytest.raises(RankFailedError, match="rank 1 failed: StorageError: disk full"):
        wait_until(lambda: False, zero.watch("writing its part of step 4", 4), [1])
    # an old step's failure does not fail the wait for another step
    end = time.monotonic() + 0.6
    wait_until(lambda: time.monotonic() > end, zero.watch("writing its part of step 6", 6), [1])


def test_stragglers_are_logged_by_rank_0_at_growing_intervals(rolls, caplog):
    zero, one = rolls
    one.at(4, "write")
    one.wrote(1 << 20)
    caplog.set_level(logging.WARNING, logger="ckpttool")
    end = time.monotonic() + 1.0
    wait_until(lambda: time.monotonic() > end, zero.watch("writing its part of step 4", 4), [1])
    said = [r.getMessage() for r in caplog.records if "still at work" in r.getMessage()]
    assert len(said) == 3, said  # after 0.2, 0.4 and 0.8 s
    assert all("rank 1: write of step 4, 1.0 MiB written" in line for line in said), said
    caplog.clear()
    end = time.monotonic() + 0.5
    wait_until(lambda: time.monotonic() > end, one.watch("waiting for rank 0", 4), [0])
    assert not [r for r in caplog.records if "still at work" in r.getMessage()]  # only rank 0 says it


def test_a_store_that_does_not_answer_is_rank_0s_death():
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=timedelta(seconds=2))
    zero = Roll(server, 0, 2, "job", dead_after=5, beat_s=0.05)
    one = Roll(client, 1, 2, "job", dead_after=5, beat_s=0.05)
    zero.at(4, "commit")
    one.watch("waiting for rank 0 to commit step 4", 4).check([0])
    zero._stop.set()
    del zero, server  # the store's host is gone
    import gc

    gc.collect()
    with pytest.raises(RankDeadError) as got:
        wait_until(lambda: False, one.watch("waiting for rank 0 to commit step 4", 4), [0])
    assert got.value.ranks == [0] and "commit of step 4" in got.value.phases[0] and "does not answer" in got.value.phases[0]
    one._stop.set()


def test_a_rank_told_of_a_death_another_rank_found_raises_the_same_rank_dead_error(rolls):
    """Rank 0 found rank 5 dead before rank 1 did: the agreement hands rank 1 that RankDeadError
    (the dead rank and its phase), not a RankFailedError of rank 0's."""
    import threading

    from ckpttool import rendezvous

    zero, one = rolls
    found = RankDeadError([5], {5: "write of step 4, 1.0 MiB written"}, "writing its part of step 4")
    got: dict[int, BaseException | None] = {}

    def agree(roll, error):
        got[roll.rank] = rendezvous.agreed_failure("the commit of step 4", error, roll=roll, step=4, timeout=10)

    threads = [threading.Thread(target=agree, args=(zero, found)), threading.Thread(target=agree, args=(one, None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got[0] is found
    assert type(got[1]) is RankDeadError and got[1].ranks == [5]
    assert got[1].phases == {5: "write of step 4, 1.0 MiB written"} and got[1].doing == "writing its part of step 4"


def test_a_refusal_seen_mid_write_is_read_once_whole_and_names_the_dead_rank(tmp_path):
    """Rank 0 refuses a step because rank 1 died; rank 2, waiting for the commit, sees the refusal
    file appear before its bytes are in (a torn write: an older writer, or a storage that cannot
    replace a file in one step). It reads it again until it is whole, and names rank 1."""
    import threading

    from ckpttool import rendezvous
    from ckpttool.storage import resolve

    step_dir = resolve(str(tmp_path / "step-4.tmp"))
    step_dir.makedirs()
    marker = step_dir.child(rendezvous.REFUSED_FILE)
    marker.write_bytes(b"")  # seen, not yet written
    dead = RankDeadError([1], {1: "write"}, "writing its part of step 4")

    def finish() -> None:
        time.sleep(0.3)
        refused = resolve(str(tmp_path / "whole"))
        refused.makedirs()
        rendezvous.refuse_step(refused, dead)
        marker.write_bytes(refused.child(rendezvous.REFUSED_FILE).read_bytes())

    threading.Thread(target=finish).start()
    with pytest.raises(RankDeadError) as raised:
        rendezvous.await_commit(step_dir, step_dir.child("commit.json"), 4, timeout=10)
    assert raised.value.ranks == [1] and "write" in str(raised.value)


def test_refuse_step_replaces_the_file_in_one_step(tmp_path):
    from ckpttool import rendezvous
    from ckpttool.storage import resolve

    step_dir = resolve(str(tmp_path / "step-4.tmp"))
    step_dir.makedirs()
    rendezvous.refuse_step(step_dir, OSError("disk full"))
    marker = os.path.join(str(tmp_path / "step-4.tmp"), rendezvous.REFUSED_FILE)
    inode = os.stat(marker).st_ino
    rendezvous.refuse_step(step_dir, OSError("disk still full"))
    assert os.stat(marker).st_ino != inode  # a new file renamed over the old: never seen half written
    assert sorted(os.listdir(str(tmp_path / "step-4.tmp"))) == [rendezvous.REFUSED_FILE]
