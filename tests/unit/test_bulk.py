"""bulk.no_gc: the cyclic collector is off inside, back as it was after the last block ends."""

from __future__ import annotations

import gc
import threading

from ckpttool.bulk import no_gc


def test_the_collector_is_off_inside_and_back_after_the_last_block_on_any_thread():
    assert gc.isenabled()
    with no_gc():
        assert not gc.isenabled()
        inside, leave = threading.Event(), threading.Event()

        def other() -> None:
            with no_gc():
                inside.set()
                leave.wait(10)

        t = threading.Thread(target=other)
        t.start()
        inside.wait(10)
        with no_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's block still runs
    leave.set()
    t.join(10)
    assert gc.isenabled()
    try:  # an error inside still brings it back
        with no_gc():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    try:
        with no_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
