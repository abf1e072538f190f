"""async_save(..., background_staging=True): the call returns once the state is pickled and its small
tensors copied; a staging thread copies the large host tensors while the caller goes on (here with the
knob async_write_through=0, its default, set here: with it on, page-aligned tensors are written straight
from their memory, test_write_through.py). Until those
copies are complete the fence holds: every optimizer's step() waits for them (a global step
pre-hook), fastckpt.wait_staged() and fut.wait_staged() wait too. The file is the one fastckpt.save
writes of the state as it was at the call, whatever the caller changes after the fence, and every
failure (of the staging copies or of the write) reaches the future, never a torn file or a hung fence.

The staging thread is held at a gate (Snapshot.complete waits for an event the test sets), so what
"before the copies are complete" means does not depend on timing."""

import errno
import os
import threading

import pytest
import torch

import fastckpt
from fastckpt import _C, knobs
from fastckpt.saver import AsyncSaver, SMALL_SYNC

from leaks import fd_count, temp_files
from staging_gate import Gate, step_in_thread, step_waits_for
from states import assert_same

BIG = (SMALL_SYNC // 4) * 3  # float32 elements: 3 MiB, copied in the background


@pytest.fixture(autouse=True)
def _copied():
    """These tests are about the staging thread's copies: a tensor that torch happened to put on a
    page boundary would otherwise be written straight from its memory (test_write_through.py)."""
    with knobs.override(async_write_through=0):
        yield


def _state():
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(BIG, generator=g), "t": torch.randn(1024, 1536, generator=g).t(),  # strided, 6 MiB
            "bn": torch.randn(64, generator=g), "step": 7}


def test_the_file_is_the_state_at_the_call_and_the_optimizer_waits_for_the_copies(tmp_path, monkeypatch):
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weight: copied in the background
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 1024)).sum().backward()
    sd = {"model": model.state_dict(), "step": 3}
    before = {k: v.clone() for k, v in sd["model"].items()}
    gate = Gate(monkeypatch)
    fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    assert gate.entered.wait(30) and not fut.staged and not fut.done()
    assert not fut.wait_staged(timeout=0.05) and not fastckpt.wait_staged(timeout=0.05)
    step_waits_for(gate, opt, model.weight, before["weight"])  # it would change the weight being copied
    assert fut.staged
    res = fut.result(timeout=60)
    assert not torch.equal(model.weight.detach(), before["weight"])  # the step ran after the copies
    assert res.staged_seconds >= res.snapshot_seconds and res.fence_seconds > 0
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), {"model": before, "step": 3})
    assert temp_files(tmp_path) == []


def test_small_tensors_are_copied_before_the_call_returns(tmp_path, monkeypatch):
    """Buffers a forward pass changes (BatchNorm's statistics: small) are in the snapshot before
    the call returns; large tensors changed after the fence are not in the file either."""
    sd = _state()
    want = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    gate = Gate(monkeypatch)
    fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    sd["bn"].add_(1)  # allowed at once: small
    gate.open()
    assert fastckpt.wait_staged(timeout=60) and fut.staged
    sd["w"].add_(1)
    sd["t"].mul_(2)
    fut.result(timeout=60)
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), want)


def test_the_sources_stay_alive_until_copied(tmp_path, monkeypatch):
    sd = _state()
    want = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    gate = Gate(monkeypatch)
    fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    del sd  # the caller drops its tensors: the staging thread still holds what it has to copy
    gate.open()
    fut.result(timeout=60)
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), want)


def test_the_same_file_as_fastckpt_save(tmp_path):
    sd = _state()
    fastckpt.save(sd, tmp_path / "s.pt")
    fastckpt.async_save(sd, tmp_path / "a.pt", background_staging=True).result(timeout=60)
    assert (tmp_path / "s.pt").stat().st_size == (tmp_path / "a.pt").stat().st_size
    assert_same(fastckpt.load(tmp_path / "a.pt", verify=True), fastckpt.load(tmp_path / "s.pt", verify=True))


def test_the_knob_turns_it_on(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    with knobs.override(async_background_staging=1):
        fut = fastckpt.async_save(_state(), tmp_path / "c.pt")
    assert gate.entered.wait(30) and not fut.staged
    gate.open()
    fut.result(timeout=60)
    fut = fastckpt.async_save(_state(), tmp_path / "c.pt")  # default: everything copied before returning
    assert fut.staged
    fut.result(timeout=60)


def test_a_failed_staging_copy_fails_the_future_and_releases_the_fence(tmp_path, monkeypatch):
    saver = AsyncSaver()
    fds = fd_count()
    gate = Gate(monkeypatch, fail=RuntimeError("copy went wrong"))
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 1024)).sum().backward()
    fut = saver.save({"m": model.state_dict()}, tmp_path / "c.pt", background_staging=True)
    t, stepped = step_in_thread(opt)
    gate.open()
    t.join(30)
    assert stepped.is_set()  # the fence opened although the copy failed
    with pytest.raises(RuntimeError, match="copy went wrong"):
        fut.result(timeout=60)
    assert not (tmp_path / "c.pt").exists() and temp_files(tmp_path) == []
    assert saver.stager.free_bytes > 0 and saver.pending() == []  # the arena is back for reuse
    monkeypatch.undo()
    saver.save({"m": model.state_dict()}, tmp_path / "c.pt", background_staging=True).result(timeout=60)
    assert_same(fastckpt.load(tmp_path / "c.pt"), {"m": model.state_dict()})
    saver.close()
    assert fd_count() == fds


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_after_background_staging(tmp_path, err):
    sd = _state()
    fastckpt.save(sd, tmp_path / "c.pt")
    old = fastckpt.load(tmp_path / "c.pt")
    _C.fault_inject("write", nth=1, errno=err)
    try:
        fut = fastckpt.async_save({"other": torch.ones(BIG)}, tmp_path / "c.pt", background_staging=True)
        exc = fut.exception(timeout=60)
    finally:
        _C.fault_clear()
    assert isinstance(exc, OSError) and exc.errno == err and str(tmp_path / "c.pt") in str(exc)
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), old)  # the previous checkpoint, whole
    assert temp_files(tmp_path) == [] and fastckpt.wait_staged(timeout=5)


def test_a_dropped_snapshot_waits_for_its_staging_before_giving_the_arena_back(tmp_path, monkeypatch):
    saver = AsyncSaver()
    gate = Gate(monkeypatch)
    staged = saver.stage(_state(), tmp_path / "c.pt", background_staging=True)
    assert gate.entered.wait(30)
    dropped = threading.Event()
    t = threading.Thread(target=lambda: (saver.drop(staged), dropped.set()))
    t.start()
    assert not dropped.wait(0.3), "drop() gave the arena back while the staging thread copied into it"
    gate.open()
    t.join(30)
    assert dropped.is_set() and staged.fut.cancelled() and saver.stager.free_bytes > 0
    saver.close()
    assert not (tmp_path / "c.pt").exists()


def test_a_forked_child_does_not_wait_for_the_parents_staging(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    fut = fastckpt.async_save(_state(), tmp_path / "c.pt", background_staging=True)
    assert gate.entered.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: the parent's staging thread is not here; the fence must not hang
        code = 1
        try:
            torch.set_num_threads(1)
            code = 0 if fastckpt.wait_staged(timeout=5) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    gate.open()
    fut.result(timeout=60)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert_same(fastckpt.load(tmp_path / "c.pt"), _state())


@pytest.mark.parametrize("nice", [0, 7])
def test_the_writer_thread_takes_the_nice_value_of_its_knob(tmp_path, nice):
    """async_writer_nice: the thread that writes in the background runs at least that nice (it
    yields the CPU to the training loop); 0 leaves it at the caller's priority."""
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    saver = AsyncSaver()
    try:
        with knobs.override(async_writer_nice=nice):
            saver.save(_state(), tmp_path / "c.pt",
                       after=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                       ).result(timeout=60)
    finally:
        saver.close()
    assert seen == [max(caller, nice)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller  # the caller's own is unchanged
    assert_same(fastckpt.load(tmp_path / "c.pt"), _state())


# -- async_caller_copy: a share of the background copy done by the call itself

def _four():
    g = torch.Generator().manual_seed(4)
    return {f"w{i}": torch.randn(BIG, generator=g) for i in range(4)}  # 3 MiB each: all copied in the background


@pytest.mark.parametrize("share, by_call", [(50, 2), (49, 1), (100, 4), (0, 0)])
def test_the_call_copies_its_share_before_returning(tmp_path, monkeypatch, share, by_call):
    """async_caller_copy: the call copies the first large tensors that make up at most that percent
    of their bytes; the staging thread (held at its gate here) copies the others. Those the call
    copied may change at once: the file has them as they were at the call."""
    sd = _four()
    want = {k: v.clone() for k, v in sd.items()}
    gate = Gate(monkeypatch)
    with knobs.override(async_caller_copy=share):
        fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    for k in list(sd)[:by_call]:
        sd[k].add_(1)  # copied by the call: no fence needed
    assert gate.entered.wait(30) and not fut.staged  # the staging thread still runs, for the rest (if any)
    gate.open()
    assert fastckpt.wait_staged(timeout=60)
    for k in list(sd)[by_call:]:
        sd[k].add_(1)
    fut.result(timeout=60)
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), want)
    assert temp_files(tmp_path) == []


def test_copy_share_takes_whole_sources_in_order_up_to_the_share():
    from fastckpt.staging.snapshot import Snapshotter
    sizes = [3 << 20, 1 << 20, 4 << 20, 2 << 20]  # 10 MiB
    srcs = [torch.full((n // 4,), float(i)) for i, n in enumerate(sizes)]
    stager = Snapshotter()
    for share, copied in [(0.0, 0), (0.3, 3 << 20), (0.39, 3 << 20), (0.45, 4 << 20), (0.85, 8 << 20), (1.0, 10 << 20)]:
        snap = stager.take(srcs, defer_over=0)
        assert len(snap.pending) == 4
        assert snap.copy_share(share) == copied
        done = [i for i in range(4) if i not in {j for j, _, _ in snap.pending}]
        assert sum(sizes[i] for i in done) == copied and done == list(range(len(done)))
        for i in done:  # copied, with its CRC
            assert torch.equal(snap.views[i], srcs[i]) and snap.crcs[i] is not None
        snap.complete()
        assert all(torch.equal(v, s) for v, s in zip(snap.views, srcs)) and None not in snap.crcs
        snap.release()


def test_a_failed_copy_by_the_call_raises_and_leaves_nothing_held(tmp_path, monkeypatch):
    from fastckpt.staging import snapshot as snapshot_mod
    saver = AsyncSaver()
    fds = fd_count()
    real = snapshot_mod.copy_with_crcs

    def failing(jobs, crcs):
        if jobs and threading.current_thread() is threading.main_thread():
            raise OSError(errno.EFAULT, "copy went wrong")
        return real(jobs, crcs)

    monkeypatch.setattr(snapshot_mod, "copy_with_crcs", failing)
    with knobs.override(async_caller_copy=50), pytest.raises(OSError, match="copy went wrong"):
        saver.save(_four(), tmp_path / "c.pt", background_staging=True)
    assert fastckpt.wait_staged(timeout=0) and saver.pending() == [] and saver.stager.free_bytes > 0
    assert not (tmp_path / "c.pt").exists() and temp_files(tmp_path) == []
    monkeypatch.undo()
    with knobs.override(async_caller_copy=50):
        saver.save(_four(), tmp_path / "c.pt", background_staging=True).result(timeout=60)
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), _four())
    saver.close()
    assert fd_count() == fds


@pytest.mark.parametrize("bad", [-1, 101, 2.5, "x"])
def test_the_caller_share_is_a_percent(bad):
    with pytest.raises(ValueError, match="async_caller_copy"):
        with knobs.override(async_caller_copy=bad):
            knobs.get("async_caller_copy")
