"""fastckpt._core.gcpause: the collector is paused inside, restored after (also after an error),
left off for a program that keeps it off, and with concurrent callers switched back on only when
the last one leaves (FastReader's use: tests/python/dcp/test_dcp.py)."""
import gc
import threading

import pytest

from fastckpt._core.gcpause import gc_paused


@pytest.fixture
def gc_state():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_restored_after(gc_state):
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with gc_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_a_program_that_keeps_it_off_keeps_it_off(gc_state):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_concurrent_callers_restore_it_when_the_last_leaves(gc_state):
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other caller is still inside
    leave.set()
    t.join(10)
    assert gc.isenabled()
