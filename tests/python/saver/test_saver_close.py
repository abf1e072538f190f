"""AsyncSaver.close(): the pending saves are finished, the writer thread is joined (nothing of the saver is
left running), a later save is refused clearly, and a failure nobody looked at is raised once the thread is
gone."""
import errno
import threading

import pytest
import torch

from fastckpt import _C
from fastckpt import saver as saver_mod
from fastckpt.saver import AsyncSaver

from leaks import temp_files


def _new_save_threads(before):
    return [t for t in threading.enumerate() if t not in before and t.name.startswith("fastckpt-save")]


def test_close_finishes_pending_saves_and_leaves_no_thread(tmp_path):
    before = set(threading.enumerate())
    saver = AsyncSaver(max_in_flight=2)
    futs = [saver.save({"w": torch.full((1 << 16,), float(i))}, tmp_path / f"{i}.pt") for i in range(3)]
    assert _new_save_threads(before), "the saver's writer thread runs while saves are pending"
    saver.close()
    assert saver.closed and all(f.done() for f in futs)
    for i in range(3):
        assert torch.equal(torch.load(tmp_path / f"{i}.pt")["w"], torch.full((1 << 16,), float(i)))
    assert _new_save_threads(before) == []
    assert saver not in saver_mod._savers  # not waited for at exit, not renewed in a forked child
    assert saver.stager.free_bytes == 0
    saver.close()  # idempotent
    assert _new_save_threads(before) == []
    with pytest.raises(RuntimeError, match=r"closed.*new AsyncSaver"):
        saver.save({"w": torch.ones(1)}, tmp_path / "late.pt")
    assert not (tmp_path / "late.pt").exists() and saver.pending() == []
    assert _new_save_threads(before) == []


def test_close_raises_an_unobserved_failure_once_with_the_thread_gone(tmp_path):
    before = set(threading.enumerate())
    saver = AsyncSaver()
    _C.fault_inject("write", errno=errno.EIO, times=0, path_contains="bad")
    try:
        saver.save({"w": torch.ones(1 << 12)}, tmp_path / "bad.pt")
        good = saver.save({"w": torch.ones(1 << 12)}, tmp_path / "good.pt")
        with pytest.raises(OSError, match="bad.pt") as ei:
            saver.close()
    finally:
        _C.fault_clear()
    assert ei.value.errno == errno.EIO
    assert good.result().path == str(tmp_path / "good.pt")
    assert _new_save_threads(before) == []
    saver.close()  # raised once
    assert temp_files(tmp_path) == []


def test_close_as_context_manager_and_refused_from_the_writer_thread(tmp_path):
    before = set(threading.enumerate())
    seen = {}
    with AsyncSaver() as saver:
        def after():
            with pytest.raises(RuntimeError, match="its own save thread"):
                saver.close()
            seen["refused"] = True
        saver.save({"w": torch.ones(4)}, tmp_path / "a.pt", after=after).result()
    assert seen == {"refused": True} and saver.closed
    assert _new_save_threads(before) == []


def test_a_closed_default_saver_is_replaced():
    d = saver_mod.default_saver()
    d.close()
    assert saver_mod.default_saver() is not d and not saver_mod.default_saver().closed


def test_an_idle_saver_holds_no_thread_and_a_later_save_starts_one(tmp_path):
    """The writer thread lives while saves are pending, not for the saver's lifetime: Lightning's
    Trainer.save_checkpoint() after fit() (no teardown follows) left an idle "fastckpt-save_0"
    thread behind for good, which upstream's per-test thread check reports."""
    before = set(threading.enumerate())
    saver = AsyncSaver(max_in_flight=2)
    try:
        for round_ in range(3):
            futs = [saver.save({"w": torch.full((1 << 16,), float(10 * round_ + i))}, tmp_path / f"{i}.pt")
                    for i in range(2)]
            threads = _new_save_threads(before)
            for t in threads:
                assert t.daemon and callable(t.stop)  # upstream's convention for threads it may stop
            saver.wait()
            for t in threads:
                t.join(timeout=10)
            assert _new_save_threads(before) == [], "idle, the saver holds no thread"
            for i, f in enumerate(futs):
                assert f.result().path == str(tmp_path / f"{i}.pt")
                assert torch.equal(torch.load(tmp_path / f"{i}.pt")["w"], torch.full((1 << 16,), float(10 * round_ + i)))
    finally:
        saver.close()


def test_stopping_the_writer_thread_finishes_its_saves(tmp_path):
    """stop() (what Lightning's thread check calls on a daemon thread left running) waits for the pending
    saves: nothing is cut short, and the saver goes on saving afterwards."""
    gate = threading.Event()
    saver = AsyncSaver(max_in_flight=2)
    try:
        before = set(threading.enumerate())
        fut = saver.save({"w": torch.ones(1 << 16)}, tmp_path / "a.pt", after=gate.wait)
        (thread,) = _new_save_threads(before)
        threading.Timer(0.2, gate.set).start()
        thread.stop()
        assert not thread.is_alive() and fut.done() and fut.exception() is None
        assert torch.equal(torch.load(tmp_path / "a.pt")["w"], torch.ones(1 << 16))
        saver.save({"w": torch.zeros(4)}, tmp_path / "b.pt").result(timeout=60)
        assert torch.equal(torch.load(tmp_path / "b.pt")["w"], torch.zeros(4))
    finally:
        saver.close()
