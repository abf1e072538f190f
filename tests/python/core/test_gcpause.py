"""fastckpt._core.gcpause: the collector is paused inside, restored after (also after an error),
left off for a program that keeps it off, and with concurrent callers switched back on only when
the last one leaves (FastReader's use: tests/python/dcp/test_dcp.py)."""
import gc
import os
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


def _another_caller():
    """A thread that enters gc_paused() once started, and stays inside until `leave` is set."""
    inside, leave = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            inside.set()
            leave.wait(10)
    return threading.Thread(target=other), inside, leave


def test_concurrent_callers_restore_it_when_the_last_leaves(gc_state):
    gc.enable()
    t, inside, leave = _another_caller()
    with gc_paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other caller is still inside
    leave.set()
    t.join(10)
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_a_child_forked_while_another_thread_is_inside_gets_the_collector_back(gc_state):
    """The thread that would switch the collector back on does not exist in a forked child: the
    child has it on again (as before the pause), and the pause works there (a new lock)."""
    gc.enable()
    t, inside, leave = _another_caller()
    t.start()
    assert inside.wait(10) and not gc.isenabled()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = gc.isenabled()
            with gc_paused():
                ok = ok and not gc.isenabled()
            code = 0 if ok and gc.isenabled() else 3
        finally:
            os._exit(code)
    leave.set()
    t.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
