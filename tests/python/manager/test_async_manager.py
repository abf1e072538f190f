"""fastckpt.async_save and fastckpt.CheckpointManager, in one process.

async_save: the snapshot is isolated from later changes, the file equals
fastckpt.save's, errors come back through the future / the next call / the
exit log, the in-flight limit holds, staging memory is reused. Manager:
naming, atomic `latest` moved only after a complete save, retention, fallback
from corrupt checkpoints, cleanup of leftovers, injected I/O faults, sharded
(DCP) mode in one process. The multi-process DDP proof is test_ddp_resume.py.
"""
import argparse
import concurrent.futures
import copy
import errno
import os
import pickle
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch
from torch import nn

import fastckpt
from fastckpt import _C
from fastckpt.formats import zip as _zip
from fastckpt.saver import AsyncSaver, SaveResult, default_saver
from fastckpt.manager.manager import CheckpointManager
import fastspawn  # noqa: E402
from leaks import temp_files, temps_of
import states

pytestmark = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")


@pytest.fixture(autouse=True)
def _drain_default_saver():
    """No test leaves a pending save or an unreported failure to the next one."""
    yield
    try:
        default_saver().wait(timeout=60)
    except Exception:  # noqa: BLE001 - a failure the test left unobserved on purpose
        pass


def make_state(seed=0, width=64):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "view": model[0].weight.detach()[2:5],
             "step": 7, "note": "hello", "empty": torch.empty(0)}
    return model, opt, state



def assert_same(a, b, path="state"):
    """Bitwise equality of nested containers of tensors and plain values, dict keys in order."""
    states.assert_same(a, b, path, bitwise=True, ordered=True)


def test_assert_same_can_fail():
    _, _, s = make_state()
    t = copy.deepcopy(s)
    t["model"]["0.weight"][0, 0] += 1
    with pytest.raises(AssertionError):
        assert_same(s, t)


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---------------------------------------------------------------- async_save

def test_snapshot_is_isolated_from_later_changes(tmp_path):
    saver = AsyncSaver()
    model, opt, state = make_state()
    expected = copy.deepcopy(state)
    path = tmp_path / "snap.pt"
    _C.fault_inject("write", nth=1, delay_ms=150, times=0, path_contains="snap.pt")  # keep the write pending
    fut = saver.save(state, path)
    assert not fut.done()
    with torch.no_grad():  # training goes on while the save is in flight
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state["step"] = 8
    state["model"]["extra"] = torch.ones(3)
    res = fut.result(timeout=60)
    assert isinstance(res, SaveResult) and res.path == str(path)
    _, storages = fastckpt.formats.pickler.pickle_with_storages(expected, pickle, 2)
    assert res.nbytes == sum(s.nbytes() for s in storages) > 0
    assert res.snapshot_seconds >= 0 and res.write_seconds >= 0.15
    got = fastckpt.load(path, verify=True)
    assert_same(expected, got)
    assert got["view"].untyped_storage().data_ptr() == got["model"]["0.weight"].untyped_storage().data_ptr()
    assert temp_files(tmp_path) == []


def test_async_file_equals_sync_save(tmp_path):
    _, _, state = make_state()
    fastckpt.save(state, tmp_path / "sync.pt")
    fastckpt.async_save(state, tmp_path / "async.pt").result(timeout=60)

    def records(p):
        with zipfile.ZipFile(p) as z:
            return {i.filename: (i.header_offset, i.CRC, z.read(i)) for i in z.infolist()
                    if not i.filename.endswith("serialization_id")}

    assert records(tmp_path / "sync.pt") == records(tmp_path / "async.pt")
    assert_same(state, torch.load(tmp_path / "async.pt", weights_only=True))  # stock torch reads it


def test_error_comes_back_through_the_future(tmp_path):
    saver = AsyncSaver()
    _, _, state = make_state()
    path = tmp_path / "bad.pt"
    _C.fault_inject("write", nth=1, errno=errno.ENOSPC, path_contains="bad.pt")  # its first data write
    fut = saver.save(state, path)
    exc = fut.exception(timeout=60)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    assert "No space left on device" in str(exc)
    assert not path.exists() and temp_files(tmp_path) == []
    with pytest.raises(OSError):
        fut.result()
    saver.save(state, tmp_path / "ok.pt").result(timeout=60)  # it was looked at: not raised again


def test_a_failed_save_does_not_swallow_the_next_one(tmp_path, caplog):
    """nobody looked at a failed future; the next async_save
    still writes its file; the failure was logged when it happened and is
    raised, once, by wait()."""
    saver = AsyncSaver()
    _, _, state = make_state()
    _C.fault_inject("write", nth=1, errno=errno.EIO, path_contains="first.pt")
    with caplog.at_level("ERROR", logger="fastckpt"):
        fut = saver.save(state, tmp_path / "first.pt")
        concurrent.futures.wait([fut], timeout=60)  # waiting is not looking
        logged = [r for r in caplog.records if r.levelname == "ERROR" and "first.pt" in r.getMessage()]
    assert logged and "Input/output error" in logged[0].getMessage(), caplog.text  # logged at once
    _C.fault_clear()
    ok = saver.save(state, tmp_path / "second.pt")  # does not raise the old failure
    assert ok.result(timeout=60).path == str(tmp_path / "second.pt")
    assert_same(state, fastckpt.load(tmp_path / "second.pt", verify=True))
    assert not (tmp_path / "first.pt").exists() and temp_files(tmp_path) == []
    with pytest.raises(OSError) as ei:
        saver.wait()
    assert ei.value.errno == errno.EIO
    assert any("first.pt" in n and "never checked" in n for n in getattr(ei.value, "__notes__", []))
    assert saver.wait() is True  # raised once, then forgotten


def test_later_saves_go_on_while_failures_pile_up(tmp_path):
    """Two failed saves nobody looked at, several good ones in between and
    after: every good file is written; wait() names both failures."""
    saver = AsyncSaver(max_in_flight=2)
    _C.fault_inject("write", nth=1, errno=errno.ENOSPC, times=0, path_contains="bad")
    futs = [saver.save({"t": torch.full((100,), float(i))}, tmp_path / f"{kind}{i}.pt")
            for i, kind in enumerate(["bad", "good", "bad", "good", "good"])]
    concurrent.futures.wait(futs, timeout=60)
    for i in (1, 3, 4):
        assert torch.equal(fastckpt.load(tmp_path / f"good{i}.pt")["t"], torch.full((100,), float(i)))
    with pytest.raises(OSError) as ei:
        saver.wait()
    assert ei.value.errno == errno.ENOSPC
    notes = " ".join(getattr(ei.value, "__notes__", []))
    assert "bad0.pt" in notes and "bad2.pt" in notes, notes
    assert saver.wait() is True and temp_files(tmp_path) == []


def test_wait_for_saves_raises_what_nobody_looked_at(tmp_path):
    _, _, state = make_state()
    _C.fault_inject("write", nth=1, errno=errno.ENOSPC, path_contains="w.pt")
    fastckpt.async_save(state, tmp_path / "w.pt")
    with pytest.raises(OSError) as ei:
        fastckpt.wait_for_saves()
    assert ei.value.errno == errno.ENOSPC
    assert fastckpt.wait_for_saves() is True


def test_exit_waits_for_pending_saves_and_logs_unobserved_failures(tmp_path):
    script = textwrap.dedent(f"""
        import errno, torch, fastckpt
        from fastckpt import _C
        _C.fault_inject("write", nth=1, errno=errno.ENOSPC, path_contains="bad.pt")
        _C.fault_inject("write", nth=1, delay_ms=300, times=0, path_contains="slow.pt")
        fastckpt.async_save({{"t": torch.arange(1000)}}, {str(tmp_path / "slow.pt")!r})
        fastckpt.async_save({{"t": torch.arange(1000)}}, {str(tmp_path / "bad.pt")!r})
        print("returned", flush=True)
    """)
    r = fastspawn.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "returned"
    assert torch.equal(fastckpt.load(tmp_path / "slow.pt")["t"], torch.arange(1000))  # exit waited for it
    assert "FAILED and nobody checked its future" in r.stderr and "bad.pt" in r.stderr
    assert "No space left on device" in r.stderr
    assert temp_files(tmp_path) == []


def test_in_flight_saves_are_bounded(tmp_path):
    saver = AsyncSaver()
    _, _, state = make_state()
    _C.fault_inject("write", nth=1, delay_ms=100, times=0, path_contains="inflight")
    f1 = saver.save(state, tmp_path / "inflight1.pt")
    assert not f1.done()
    f2 = saver.save(state, tmp_path / "inflight2.pt")  # default limit 1: waits for f1
    assert f1.done() and f1.result().path.endswith("inflight1.pt")
    assert len(saver.pending()) <= 1
    f2.result(timeout=60)
    assert saver.stager.allocations == 1
    with fastckpt.knobs.override(async_max_in_flight=2):
        f3 = saver.save(state, tmp_path / "inflight3.pt")
        f4 = saver.save(state, tmp_path / "inflight4.pt")
        assert not f3.done() and len(saver.pending()) == 2  # two snapshots held at once
        f5 = saver.save(state, tmp_path / "inflight5.pt")    # a third waits for the oldest
        assert f3.done()
        for f in (f4, f5):
            f.result(timeout=60)
        assert saver.stager.allocations == 2
    for i in range(1, 6):
        assert_same(state, fastckpt.load(tmp_path / f"inflight{i}.pt"))


def test_staging_memory_is_reused(tmp_path):
    saver = AsyncSaver()
    model, _, state = make_state()
    saver.save(state, tmp_path / "a.pt").result(timeout=60)
    st = saver.stager
    assert st.allocations == 1 and len(st._free) == 1
    arena, allocated = st._free[0], st.allocated_bytes
    with torch.no_grad():
        model[0].weight.add_(1)
    fut = saver.save(state, tmp_path / "b.pt")
    assert st._free == []  # the same arena is in use by the second save
    fut.result(timeout=60)
    assert st.allocations == 1 and st.allocated_bytes == allocated and st._free == [arena]
    assert_same(state, fastckpt.load(tmp_path / "b.pt"))
    # A bigger state needs a bigger arena; the old one is dropped, not kept beside it.
    state["big"] = torch.zeros(1 << 20)
    saver.save(state, tmp_path / "c.pt").result(timeout=60)
    assert st.allocations == 2 and len(st._free) == 1 and st._free[0] is not arena
    assert st.free_bytes >= (4 << 20)


def test_unpicklable_state_raises_in_the_caller(tmp_path):
    saver = AsyncSaver()
    with pytest.raises(Exception) as ei:
        saver.save({"f": lambda: 1}, tmp_path / "x.pt")
    assert "pickle" in repr(ei.value).lower() or "lambda" in str(ei.value)
    assert saver.pending() == [] and not (tmp_path / "x.pt").exists()
    with pytest.raises(TypeError, match="path"):
        saver.save({}, open(os.devnull, "wb"))
    saver.save({"ok": torch.ones(2)}, tmp_path / "x.pt").result(timeout=60)


def test_a_queued_save_can_be_cancelled(tmp_path):
    saver = AsyncSaver(max_in_flight=2)
    _, _, state = make_state()
    _C.fault_inject("write", nth=1, delay_ms=100, times=0, path_contains="q")
    f1 = saver.save(state, tmp_path / "q1.pt")
    f2 = saver.save(state, tmp_path / "q2.pt")
    assert f2.cancel()
    f1.result(timeout=60)
    assert saver.wait(timeout=60)
    assert not (tmp_path / "q2.pt").exists() and saver.pending() == []


def records_of(p):
    with zipfile.ZipFile(p) as z:
        return {i.filename: (i.header_offset, i.CRC, z.read(i)) for i in z.infolist()
                if not i.filename.endswith("serialization_id")}


def test_stage_then_drop_or_submit(tmp_path):
    """AsyncSaver.stage snapshots and holds an in-flight slot; drop gives the slot
    and the arena back without writing; submit writes (with a writer of the
    caller's, as the manager's collective saves do) and runs `after`."""
    saver = AsyncSaver()
    _, _, state = make_state()
    staged = saver.stage(state, tmp_path / "dropped.pt")
    assert saver.pending() == [staged.fut] and saver.stager.free_bytes == 0
    saver.drop(staged)
    assert saver.pending() == [] and staged.fut.cancelled() and saver.stager.free_bytes > 0
    assert not (tmp_path / "dropped.pt").exists()
    seen = []
    staged = saver.stage(state, tmp_path / "mine.pt")
    fut = saver.submit(staged, write=lambda path, snap: seen.append((path, snap.nbytes)),
                       after=lambda: seen.append("after"))
    assert isinstance(fut.result(timeout=60), SaveResult)
    assert seen == [(str(tmp_path / "mine.pt"), fut.result().nbytes), "after"]
    assert not (tmp_path / "mine.pt").exists() and saver.stager.allocations == 1
    _C.fault_inject("write", nth=1, delay_ms=100, times=0, path_contains="busy")
    two = AsyncSaver(max_in_flight=2)
    busy = two.save(state, tmp_path / "busy.pt")  # keeps the writer thread busy: the next one is queued
    queued = two.submit(two.stage(state, tmp_path / "queued.pt"), cancellable=False)
    assert not busy.done() and not queued.cancel() and queued.running()  # never called off on one rank
    busy.result(timeout=60)
    queued.result(timeout=60)
    assert_same(state, fastckpt.load(tmp_path / "queued.pt"))
    with pytest.raises(ValueError, match="skip_data"):
        with torch.serialization.skip_data():
            saver.stage(state, tmp_path / "x.pt", zip_only=True)
    assert saver.pending() == []


def test_a_snapshot_is_written_as_it_was_pickled(tmp_path):
    """The manager's collective async save hands the snapshot to fastckpt.save
    through _Replay: the file is the one fastckpt.save(state) writes (shared
    storages, views, empty tensors, non-tensors), whatever the state became since."""
    from fastckpt.manager.asyncsave import _Replay
    saver = AsyncSaver()
    model, _, state = make_state()
    expected = copy.deepcopy(state)
    fastckpt.save(state, tmp_path / "direct.pt")
    staged = saver.stage(state, tmp_path / "replayed.pt", zip_only=True)
    with torch.no_grad():
        model[0].weight.mul_(-1)  # after the snapshot
    state["step"] = 8
    fastckpt.save(staged.snap, tmp_path / "replayed.pt", pickle_module=_Replay)
    saver.drop(staged)
    assert records_of(tmp_path / "direct.pt") == records_of(tmp_path / "replayed.pt")
    got = fastckpt.load(tmp_path / "replayed.pt", verify=True)
    assert_same(expected, got)
    assert got["view"].untyped_storage().data_ptr() == got["model"]["0.weight"].untyped_storage().data_ptr()
    with pytest.raises(TypeError, match="snapshot"):
        fastckpt.save({"x": 1}, tmp_path / "y.pt", pickle_module=_Replay)


# ---------------------------------------------------------------- CheckpointManager

def small_state(v):
    return {"w": torch.full((256,), float(v)), "b": torch.arange(v, v + 4), "step": v}


def test_manager_names_latest_and_retention(tmp_path):
    d = tmp_path / "a" / "ckpt"
    mgr = CheckpointManager(d, keep_last=2)
    assert d.is_dir() and mgr.load_latest() is None  # empty directory: fresh start
    for step in (10, 20, 30, 40):
        assert mgr.save(step, small_state(step)) == d / f"step_{step:08d}.pt"
    assert sorted(os.listdir(d)) == ["latest", "step_00000030.pt", "step_00000040.pt"]
    assert (d / "latest").read_text() == "step_00000040.pt\n"
    r = mgr.load_latest()
    assert r.step == 40 and r.path == str(d / "step_00000040.pt")
    assert_same(small_state(40), r.state)
    # A stock torch.load reads the checkpoints too.
    assert_same(small_state(30), torch.load(d / "step_00000030.pt", weights_only=True))
    with pytest.raises(ValueError):
        mgr.save(-1, {})
    with pytest.raises(ValueError):
        CheckpointManager(d, keep_last=0)


def test_retention_spares_latest_target_and_saves_in_flight(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    for step in (30, 40):
        mgr.save(step, small_state(step))
    assert mgr.steps() == [40]
    mgr.save(20, small_state(20))  # e.g. after rolling back: latest names an older step
    assert (tmp_path / "latest").read_text() == "step_00000020.pt\n"
    # step 40 is an abandoned branch now: set aside, not deleted
    assert mgr.steps() == [20] and os.listdir(tmp_path / "abandoned") == ["step_00000040.pt"]
    mgr.save(50, small_state(50))
    assert mgr.steps() == [50]
    fastckpt.save(small_state(5), tmp_path / "step_00000005.pt")
    fastckpt.save(small_state(6), tmp_path / "step_00000006.pt")
    mgr._writing.add("step_00000005.pt")  # as while its async save is being written
    assert mgr._prune() == ["step_00000006.pt"]
    assert mgr.steps() == [5, 50]


def test_latest_moves_only_after_the_checkpoint_is_complete(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(10, small_state(10))
    _C.fault_inject("write", nth=1, delay_ms=150, times=0, path_contains="step_00000020")
    fut = mgr.async_save(20, small_state(20))
    assert not fut.done()
    assert (tmp_path / "latest").read_text() == "step_00000010.pt\n"
    assert mgr.steps() == [10]
    wait_until(lambda: temps_of(tmp_path, "step_00000020.pt"))
    with pytest.raises(RuntimeError, match="in flight"):
        mgr.clean_temporaries()
    assert isinstance(fut.result(timeout=60), SaveResult)
    assert (tmp_path / "latest").read_text() == "step_00000020.pt\n"
    assert mgr.steps() == [10, 20] and temp_files(tmp_path) == []
    mgr.wait()


def test_fault_during_save_keeps_latest_on_the_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(10, small_state(10))
    _C.fault_inject("write", nth=1, errno=errno.ENOSPC, path_contains="step_00000020")
    with pytest.raises(OSError) as ei:
        mgr.save(20, small_state(20))
    assert ei.value.errno == errno.ENOSPC
    assert (tmp_path / "latest").read_text() == "step_00000010.pt\n"
    assert mgr.steps() == [10] and temp_files(tmp_path) == []
    # The same through async_save: the failure is the future's; latest does not move.
    _C.fault_inject("write", nth=1, errno=errno.ENOSPC, path_contains="step_00000030")
    exc = mgr.async_save(30, small_state(30)).exception(timeout=60)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    assert (tmp_path / "latest").read_text() == "step_00000010.pt\n"
    _C.fault_clear()
    r = mgr.load_latest()
    assert r.step == 10
    assert_same(small_state(10), r.state)
    mgr.save(20, small_state(20))
    assert mgr.load_latest().step == 20


def test_failed_pointer_update_keeps_the_old_pointer(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(10, small_state(10))
    _C.fault_inject("rename", nth=1, errno=errno.EIO, path_contains="latest")
    with pytest.raises(OSError):
        mgr.save(20, small_state(20))
    _C.fault_clear()
    assert (tmp_path / "latest").read_text() == "step_00000010.pt\n"
    assert temp_files(tmp_path) == []
    # step 20 was renamed into place before the pointer failed: complete, but the save
    # failed and `latest` is authoritative: resume from 10, say why.
    assert mgr.steps() == [10, 20]
    with pytest.warns(RuntimeWarning, match=r"not loading step_00000020\.pt .*never committed"):
        assert mgr.load_latest().step == 10
    mgr.save(20, small_state(20))  # the step saved again commits
    assert mgr.load_latest().step == 20 and not (tmp_path / "abandoned").exists()


def test_unobserved_async_failure_does_not_stop_the_next_manager_save(tmp_path, caplog):
    """Item 8, manager: the failed async save of step 10 is logged when it
    happens; the saves of steps 20 (sync) and 30 (async) still happen and move
    `latest`; wait() raises the step-10 failure once."""
    mgr = CheckpointManager(tmp_path)
    _C.fault_inject("write", nth=1, errno=errno.EIO, path_contains="step_00000010")
    with caplog.at_level("ERROR", logger="fastckpt"):
        fut = mgr.async_save(10, small_state(10))
        concurrent.futures.wait([fut], timeout=60)
    assert any("step_00000010.pt" in r.getMessage() and "Input/output error" in r.getMessage()
               for r in caplog.records if r.levelname == "ERROR"), caplog.text
    _C.fault_clear()
    assert mgr.save(20, small_state(20)) == tmp_path / "step_00000020.pt"
    assert (tmp_path / "latest").read_text() == "step_00000020.pt\n"
    mgr.async_save(30, small_state(30)).result(timeout=60)
    assert (tmp_path / "latest").read_text() == "step_00000030.pt\n"
    with pytest.raises(OSError) as ei:
        mgr.wait()
    assert ei.value.errno == errno.EIO
    mgr.wait()  # raised once
    assert mgr.steps() == [20, 30] and mgr.load_latest().step == 30


def corrupt_storage(path, record="data/0"):
    e = _zip.Archive.open(str(path)).records[record]
    with open(path, "r+b") as f:
        f.seek(e.data_offset + e.size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupt_or_truncated_newest_falls_back_with_a_warning(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    for step in (10, 20, 30):
        mgr.save(step, small_state(step))
    corrupt_storage(tmp_path / "step_00000030.pt")
    with pytest.warns(RuntimeWarning, match=r"skipping checkpoint .*step_00000030\.pt.*checksum mismatch"):
        r = mgr.load_latest()
    assert r.step == 20
    assert_same(small_state(20), r.state)
    p = tmp_path / "step_00000020.pt"
    os.truncate(p, p.stat().st_size // 2)
    with pytest.warns(RuntimeWarning) as rec:
        r = mgr.load_latest()
    assert r.step == 10 and len([w for w in rec if "skipping checkpoint" in str(w.message)]) == 2
    corrupt_storage(tmp_path / "step_00000010.pt")
    with pytest.warns(RuntimeWarning):
        with pytest.raises(RuntimeError, match="no checkpoint .* could be loaded"):
            mgr.load_latest()


def test_weights_only_refusal_is_not_treated_as_corruption(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(10, small_state(10))
    mgr.save(20, {"x": argparse.Namespace(a=1)})
    with pytest.raises(pickle.UnpicklingError):
        mgr.load_latest()
    assert mgr.load_latest(weights_only=False).step == 20


def test_leftovers_of_crashed_saves_are_cleaned_safely(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(10, small_state(10))
    dead = dead_pid()
    host = _C.temp_host()  # names of this host (another host's are never removed: test_manager_cleanup.py)
    leftovers = [f".step_00000020.pt.fastckpt-tmp.{dead}.{host}.1.0.1a2b", f".latest.fastckpt-tmp.{dead}.{host}.1.3.ff00"]
    for n in leftovers:
        (tmp_path / n).write_bytes(b"partial")
    dcp_tmp = tmp_path / f".step_00000030.fastckpt-tmp.{dead}.{host}.1.0.abcd1234.dcp"
    dcp_tmp.mkdir()
    (dcp_tmp / "__0_0.distcp").write_bytes(b"partial")
    live = f".step_00000040.pt.fastckpt-tmp.{os.getppid()}.{host}.0.0.beef"  # its writer is still running
    (tmp_path / live).write_bytes(b"in progress")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / ".hidden").write_text("mine")
    mgr2 = CheckpointManager(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([".hidden", live, "latest", "notes.txt", "step_00000010.pt"])
    assert mgr2.load_latest().step == 10
    assert mgr2.clean_temporaries() == []


def test_manager_sharded_mode_single_process(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")

    def st(v):
        return {"model": {"w": torch.full((64,), float(v)), "b": torch.arange(8) + v}, "step": v}

    dead = dead_pid()
    (tmp_path / f".step_00000002.fastckpt-tmp.{dead}.{_C.temp_host()}.1.0.00000000.dcp").mkdir()  # a crashed sharded save
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        mgr = CheckpointManager(tmp_path, keep_last=2, sharded=True)
        assert temp_files(tmp_path) == []
        assert mgr.load_latest(state=st(0)) is None
        for v in (1, 2, 3):
            assert mgr.save(v, st(v)) == tmp_path / f"step_{v:08d}"
        assert mgr.steps() == [2, 3] and (tmp_path / "latest").read_text() == "step_00000003\n"
        assert (tmp_path / "step_00000003" / ".metadata").is_file()
        target = st(0)
        r = mgr.load_latest(state=target)
        assert r.step == 3 and r.state is target
        assert_same(st(3), target)
        mgr.save(3, st(33))  # re-saving a step replaces it
        assert_same(st(33), mgr.load_latest(state=st(0)).state)
        assert temp_files(tmp_path) == []
        for f in (tmp_path / "step_00000003").glob("*.distcp"):  # damage the newest
            os.truncate(f, f.stat().st_size // 2)
        with pytest.warns(RuntimeWarning, match=r"skipping checkpoint .*step_00000003"):
            r = mgr.load_latest(state=st(0))
        assert r.step == 2
        assert_same(st(2), r.state)
        with pytest.raises(ValueError, match="state="):
            mgr.load_latest()
        src = st(4)
        fut = mgr.async_save(4, src)
        src["model"]["w"].mul_(-1)  # after staging: must not reach the checkpoint
        assert isinstance(fut.result(timeout=60), SaveResult)
        assert (tmp_path / "latest").read_text() == "step_00000004\n" and mgr.steps() == [3, 4]
        assert_same(st(4), mgr.load_latest(state=st(0)).state)
        mgr.async_save(5, st(5))
        mgr.wait()
        assert mgr.steps() == [4, 5] and temp_files(tmp_path) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_snapshot_is_pinned_isolated_and_keeps_locations(tmp_path):
    saver = AsyncSaver()
    dev = torch.device("cuda", 0)
    state = {"w": torch.randn(1 << 20, device=dev), "h": torch.arange(1000, device=dev).half(), "c": torch.ones(3)}
    state["v"] = state["w"][10:20]
    expected = {k: v.cpu() for k, v in state.items()}
    _C.fault_inject("write", nth=1, delay_ms=100, times=0, path_contains="cuda.pt")
    fut = saver.save(state, tmp_path / "cuda.pt")
    state["w"].mul_(-1)  # queued on the same stream after the snapshot's copies
    state["h"].zero_()
    fut.result(timeout=60)
    assert saver.stager.allocations == 1 and saver.stager._free[0].pinned
    got = fastckpt.load(tmp_path / "cuda.pt", verify=True)  # no map_location: back on the saved device
    assert got["w"].device == dev and got["c"].device.type == "cpu"
    assert_same(expected, {k: v.cpu() for k, v in got.items()})
    assert got["v"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()


def test_background_staging_through_the_manager(tmp_path, monkeypatch):
    """mgr.async_save(..., background_staging=True): the call returns before the large tensors are
    copied, the optimizer's step waits for the copies, `latest` names the step once it is durable
    and load_latest gives the state as it was at the call."""
    from staging_gate import Gate, step_in_thread

    model = nn.Linear(1024, 1024)  # 4 MiB: copied in the background
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(2, 1024)).sum().backward()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    want = {"model": copy.deepcopy(model.state_dict()), "step": 5}
    gate = Gate(monkeypatch)
    fut = mgr.async_save(5, {"model": model.state_dict(), "step": 5}, background_staging=True)
    assert gate.entered.wait(30) and not fut.done()
    t, stepped = step_in_thread(opt)
    assert not stepped.wait(0.3) and not (tmp_path / "latest").exists()
    gate.open()
    t.join(30)
    assert stepped.is_set()
    fut.result(timeout=60)
    mgr.wait()
    assert (tmp_path / "latest").read_text() == "step_00000005.pt\n"
    r = mgr.load_latest()
    assert r.step == 5
    states.assert_same(r.state, want)
    mgr.close()
