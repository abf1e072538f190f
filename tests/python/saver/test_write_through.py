"""Background staging that writes the large host tensors straight from their memory until the fence
(fastckpt.staging.through; knob async_write_through: 1 in these tests, 2 by default, which chooses
per save from the saver's last one).

A tensor whose memory sits at its record's phase in the file (page-aligned, as torch allocates
tensors of 2 MiB and more under THP_MEM_ALLOC_ENABLE=1; here made so by the tests) is not copied
when the write ends before the fence: the writer sends it from the live tensor. When the fence (an
optimizer step, fastckpt.wait_staged) comes first, it copies what is not yet sent into the arena
and waits until no write in flight reads the live memory; from then on the caller may change its
tensors, and the file is still the state at the call. Failures reach the future; the fence never
hangs.

The writer is held at a gate after a chosen piece of live memory (SendGate), so that "before the
write ends" does not depend on timing."""

import errno
import itertools
import os
import sys
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt import _C, knobs
from fastckpt._core.atomic import AtomicFile
from fastckpt.saver import AsyncSaver, SMALL_SYNC
from fastckpt.staging import snapshot as snapshot_mod, through as through_mod

from leaks import fd_count, temp_files
from staging_gate import Gate, SendGate, step_waits_for
from states import align_module, assert_same, page_aligned

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _write_through():
    with knobs.override(async_write_through=1):
        yield


def _state(gen_seed=1):
    g = torch.Generator().manual_seed(gen_seed)
    return {"a": page_aligned(torch.randn(3 * MIB // 4, generator=g)),              # 3 MiB, sent live
            "b": page_aligned(torch.randn(512, 1024, generator=g)),                  # 2 MiB, sent live
            "odd": page_aligned(torch.randn(SMALL_SYNC // 4 + 1000, generator=g), 64),  # deferred, off the phase
            "bn": torch.randn(64, generator=g), "step": 7}


def _clone(sd):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


def _live_bytes(sd):
    return sum(v.numel() * v.element_size() for k, v in sd.items() if k in ("a", "b"))


def test_a_write_that_ends_before_the_fence_copies_nothing(tmp_path, monkeypatch):
    sd = _state()
    want = _clone(sd)
    fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    res = fut.result(timeout=60)
    assert fut.staged and fastckpt.wait_staged(timeout=0)
    assert res.through_bytes == _live_bytes(sd) and res.fence_copied_bytes == 0
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), want, bitwise=True)
    sd["a"].add_(1)  # after the save: not in the file
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), want, bitwise=True)
    # The file fastckpt.save writes of the same state (but for the serialization id, new per save).
    monkeypatch.setattr(fastckpt.formats.archive, "new_serialization_id", lambda: b"0" * 40)
    fastckpt.save(want, tmp_path / "s.pt")
    fastckpt.async_save(_clone(want), tmp_path / "a.pt", background_staging=True).result(timeout=60)
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "s.pt").read_bytes()


@pytest.mark.parametrize("staged", ["a", "b"])
def test_a_source_the_staging_thread_copies_is_written_only_once_copied(tmp_path, monkeypatch, staged):
    """One large tensor off its record's phase (copied by the staging thread), the other written
    through: the writer must wait for that copy, whichever comes first in the file. It did not (the
    wait was on an event already set, made before the staging thread's): the file held the arena's
    bytes (zeros) for that tensor, with their CRC, so it even verified."""
    sd = _state(4)
    sd[staged] = page_aligned(sd[staged], 64)  # off the phase: the staging thread copies it
    want = _clone(sd)
    gate = Gate(monkeypatch)  # the staging thread's copies wait here
    fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    assert gate.entered.wait(30)
    with pytest.raises(TimeoutError):  # the source not yet copied holds the writer
        fut.result(timeout=0.5)
    assert not fut.staged
    gate.open()
    res = fut.result(timeout=60)
    live = "b" if staged == "a" else "a"
    assert res.through_bytes == sd[live].numel() * sd[live].element_size()  # "odd" is off its phase too
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), want, bitwise=True)


@pytest.mark.parametrize("staging", ["prompt", "late"])
@pytest.mark.parametrize("fence", ["none", "at_once", "mid_write"])
def test_every_mix_of_staged_and_live_sources_writes_the_state_at_the_call(tmp_path, monkeypatch, fence, staging):
    """Each of the three large tensors on its record's phase (written through) or off it (copied by
    the staging thread), in every combination, with no fence, a fence right after the call, or one
    while the write runs; the caller changes every tensor right after the fence. The staging thread
    starts at once or 50 ms late (a loaded machine). The file is the state at the call, bitwise,
    whichever source was sent how."""
    if staging == "late":
        complete = snapshot_mod.Snapshot.complete
        monkeypatch.setattr(snapshot_mod.Snapshot, "complete", lambda snap: (time.sleep(0.05), complete(snap))[1])
    for k, through in enumerate(itertools.product((False, True), repeat=3)):
        base = _state(10 + k)  # values of its own: the arena, reused from the last save, holds that one's
        on = dict(zip(("a", "b", "odd"), through))  # the records of these sit on page boundaries
        sd = {n: (page_aligned(v, 0 if on[n] else 64) if n in on else
                  v.clone() if isinstance(v, torch.Tensor) else v) for n, v in base.items()}
        live = sum(sd[n].nbytes for n in on if on[n])
        want = _clone(sd)
        path = tmp_path / f"c{k}.pt"
        fut = fastckpt.async_save(sd, path, background_staging=True)
        if fence == "at_once":
            assert fastckpt.wait_staged(timeout=60)
        elif fence == "mid_write":
            time.sleep(0.002 * k)
            assert fastckpt.wait_staged(timeout=60)
        else:
            res = fut.result(timeout=60)
            assert res.through_bytes == live and res.fence_copied_bytes == 0, on
        for n in on:
            sd[n].mul_(-2).add_(3)
        res = fut.result(timeout=60)  # each byte sent from live memory or copied by the fence, once
        assert res.through_bytes + res.fence_copied_bytes == live, (on, res)
        assert_same(fastckpt.load(path, verify=True), want, bitwise=True)
        path.unlink()


def test_a_failure_handing_sources_to_the_writer_fails_the_call_and_leaves_no_fence_waiting(tmp_path, monkeypatch):
    """_write_through raising (here: the hand-over cannot be made) fails async_save itself, names no
    partial file, and leaves nothing for the fence or the next save to wait on."""
    import fastckpt.saver as saver_mod

    def broken(*a, **k):
        raise MemoryError("injected: no hand-over")

    monkeypatch.setattr(saver_mod, "Through", broken)
    sd = _state()
    with pytest.raises(MemoryError, match="injected"):
        fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    assert fastckpt.wait_staged(timeout=5)
    assert not (tmp_path / "c.pt").exists() and temp_files(tmp_path) == []
    monkeypatch.undo()
    with knobs.override(async_write_through=1):
        res = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True).result(timeout=60)
    assert res.through_bytes > 0
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), sd, bitwise=True)


def test_the_fence_copies_the_rest_and_waits_for_the_writes_in_flight(tmp_path, monkeypatch):
    sd = _state()
    want = _clone(sd)
    gate = SendGate(monkeypatch, after=2)
    gate.watch([sd["a"], sd["b"]])
    order = []  # the writer drains its writes (engine: every request reaped) before the fence returns
    drain = AtomicFile.drain
    monkeypatch.setattr(AtomicFile, "drain", lambda f: (drain(f), order.append("drained")))
    fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    assert gate.entered.wait(30) and not fut.staged
    fenced = threading.Event()
    t = threading.Thread(target=lambda: (fastckpt.wait_staged(), order.append("fenced"), fenced.set()))
    t.start()
    # The writer holds live memory in writes it has not reaped: the fence must wait for them.
    assert not fenced.wait(0.3), "the fence returned while writes from the live tensors were in flight"
    gate.open()
    t.join(30)
    assert fenced.is_set() and fut.staged
    assert order[:2] == ["drained", "fenced"]
    for v in (sd["a"], sd["b"], sd["odd"]):  # the caller changes everything after the fence
        v.mul_(-3).add_(1)
    res = fut.result(timeout=60)
    assert 0 < res.through_bytes < _live_bytes(sd)
    assert res.fence_copied_bytes > 0 and res.fence_seconds > 0
    assert res.through_bytes + res.fence_copied_bytes == _live_bytes(sd)  # no byte both sent and copied
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), want, bitwise=True)
    assert temp_files(tmp_path) == []


def test_the_arena_is_not_given_back_while_the_fence_copies_into_it(tmp_path, monkeypatch):
    """The fence comes while a piece of `b` is in flight and copies the rest of `b` into the arena;
    that write then fails (EIO), so the writer stops without waiting for the copy. The arena must not
    go back to the pool (where another save may take it and have its bytes overwritten) before the
    fence's copy ends; the failure path gave it back as soon as the writer had stopped. The save
    fails naming the path, and leaves no file and no temporary."""
    sd = _state()
    piece = 256 << 10
    after = sd["a"].nbytes // piece + 1  # the first piece of `b`: the rest of it is the fence's to copy
    gate = SendGate(monkeypatch, after=after, piece=piece)
    gate.watch([sd["a"], sd["b"]])
    gated = AtomicFile.write_crc

    def failing(f, t, crc, borrow=False):  # the gated piece's write fails once the gate opens
        out = gated(f, t, crc, borrow)
        if gate.go.is_set() and gate.sent == after and not failing.done:
            failing.done = True
            raise OSError(errno.EIO, "injected: the gated piece's write failed")
        return out
    failing.done = False
    monkeypatch.setattr(AtomicFile, "write_crc", failing)
    copying, go = threading.Event(), threading.Event()
    copy = through_mod.copy_with_crcs
    copied = []

    def held_copy(todo, crcs):  # the fence's copy, held until the test lets it go
        copied.append(sum(v.numel() for _, v, _ in todo))
        copying.set()
        assert go.wait(60), "the test never let the fence's copy go"
        copy(todo, crcs)
        copying.clear()

    monkeypatch.setattr(through_mod, "copy_with_crcs", held_copy)
    given_back = []  # whether the fence was copying, at each release of the arena
    release = snapshot_mod.Snapshot.release
    monkeypatch.setattr(snapshot_mod.Snapshot, "release",
                        lambda snap, keep=1: (given_back.append(copying.is_set()), release(snap, keep))[1])
    path = tmp_path / "c.pt"
    fut = fastckpt.async_save(sd, path, background_staging=True)
    assert gate.entered.wait(30)
    fence = threading.Thread(target=fastckpt.wait_staged)
    fence.start()
    assert copying.wait(30)
    assert copied == [sd["b"].nbytes - piece]  # only what no write had taken
    gate.open()
    with pytest.raises(OSError) as err:  # the writer stops while the fence still copies
        fut.result(timeout=30)
    assert err.value.errno == errno.EIO and str(path) in str(err.value)
    deadline = time.monotonic() + 1.0
    while not given_back and time.monotonic() < deadline:  # time for a premature release to show
        time.sleep(0.01)
    assert given_back == [], "the arena was given back while the fence copied into it"
    go.set()
    fence.join(30)
    deadline = time.monotonic() + 30
    while not given_back and time.monotonic() < deadline:
        time.sleep(0.01)
    assert given_back and not any(given_back)
    assert not path.exists() and temp_files(tmp_path) == []


def test_the_optimizer_step_is_the_fence(tmp_path, monkeypatch):
    model = align_module(torch.nn.Linear(1024, 1024), min_bytes=MIB)  # 4 MiB of weight
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 1024)).sum().backward()
    sd = {"model": model.state_dict(), "step": 3}
    before = {k: v.clone() for k, v in sd["model"].items()}
    gate = SendGate(monkeypatch, after=1)
    gate.watch([model.weight])
    fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    assert gate.entered.wait(30)
    step_waits_for(gate, opt, model.weight, before["weight"])  # it would change the weight being written
    assert fut.staged
    res = fut.result(timeout=60)
    assert not torch.equal(model.weight.detach(), before["weight"])
    assert res.through_bytes > 0 and res.fence_copied_bytes > 0
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), {"model": before, "step": 3}, bitwise=True)


def test_a_fence_before_the_writer_starts_copies_everything(tmp_path, monkeypatch):
    """The writer busy with an earlier save (two in flight): the fence copies every source and
    nothing is sent from live memory."""
    saver = AsyncSaver(max_in_flight=2)
    try:
        first = _state(2)
        gate = SendGate(monkeypatch, after=1)
        gate.watch([first["a"], first["b"]])
        f1 = saver.save(first, tmp_path / "first.pt", background_staging=True)
        assert gate.entered.wait(30)
        sd = _state(3)
        want = _clone(sd)
        f2 = saver.save(sd, tmp_path / "c.pt", background_staging=True)
        threading.Timer(0.5, gate.open).start()  # the first save's fence waits for its writes
        assert fastckpt.wait_staged(timeout=60)
        sd["a"].zero_()
        sd["b"].zero_()
        r2 = f2.result(timeout=60)
        f1.result(timeout=60)
    finally:
        saver.close()
    assert r2.through_bytes == 0 and r2.fence_copied_bytes == _live_bytes(sd)
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), want, bitwise=True)


def test_the_knob_off_copies_in_the_background_as_before(tmp_path):
    sd = _state()
    with knobs.override(async_write_through=0):
        res = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True).result(timeout=60)
    assert res.through_bytes == 0 and res.fence_copied_bytes == 0
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), sd, bitwise=True)


def test_the_default_chooses_from_the_saver_s_last_save(tmp_path, monkeypatch):
    """async_write_through=2 (the default): a saver's first background save copies; a save written
    before its first fence, when that fence came, makes the next one write through; a save whose
    fence came first (written through or copied), or that no fence followed (saves back to back),
    makes the next one copy. Every file is the state at its call."""
    import fastckpt.saver as saver_mod
    held = threading.Event()
    go = threading.Event()
    go.set()
    write_archive = saver_mod.write_archive

    def gated(*a, **k):  # the writer held before it writes, while go is clear
        held.set()
        assert go.wait(60), "the test never let the writer go"
        return write_archive(*a, **k)
    monkeypatch.setattr(saver_mod, "write_archive", gated)
    saver = AsyncSaver()
    wants = []

    def save(sd, fence="after"):
        """fence: "first" (the loop's fence while the write is held), "after" (once it is written),
        or "none" (the next save comes with no fence in between)."""
        wants.append(_clone(sd))
        path = tmp_path / f"c{len(wants)}.pt"
        if fence == "first":
            go.clear()
            held.clear()
        fut = saver.save(sd, path, background_staging=True)
        if fence == "first":  # the fence (an optimizer step, here wait_staged) while the write is held
            assert held.wait(30)
            assert fastckpt.wait_staged(timeout=60)
            for v in (sd["a"], sd["b"], sd["odd"]):
                v.add_(1)  # the state changes once the fence returns
            go.set()
        res = fut.result(timeout=60)
        if fence == "after":
            assert fastckpt.wait_staged(timeout=60)
        return res

    def copied(r):
        return r.through_bytes == 0 and r.fence_copied_bytes == 0

    try:
        with knobs.override(async_write_through=2):
            sd = _state()
            assert copied(save(sd))                        # the first copies
            r = save(sd)                                   # written before the fence that followed: through
            assert r.through_bytes == _live_bytes(sd) and r.fence_copied_bytes == 0
            assert save(sd, "first").fence_copied_bytes > 0  # through, but the fence came first: it copied
            assert copied(save(sd, "first"))               # so this one copies (and its fence comes first too)
            assert copied(save(sd))                        # so does this one, written before its fence
            r = save(sd, "none")                           # through again; no fence follows it
            assert r.through_bytes == _live_bytes(sd)
            assert copied(save(sd))                        # no evidence that the loop leaves time: copy
            assert save(sd).through_bytes == _live_bytes(sd)
    finally:
        saver.close()
    for i, want in enumerate(wants):
        assert_same(fastckpt.load(tmp_path / f"c{i + 1}.pt", verify=True), want, bitwise=True)
    assert temp_files(tmp_path) == []
    assert saver_mod._watching == [] or all(s.written_at is not None for s in saver_mod._watching)


def test_the_choice_keeps_no_snapshot_alive(tmp_path, monkeypatch):
    """What async_write_through=2 keeps of a written save, to decide the next, is a few times: not the
    snapshot, whose views would keep its arena's memory alive after the saver let go of it."""
    import gc
    import weakref
    from fastckpt.staging import snapshot as snapshot_mod
    taken = []
    take = snapshot_mod.Snapshotter.take
    monkeypatch.setattr(snapshot_mod.Snapshotter, "take",
                        lambda self, *a, **k: (lambda s: (taken.append(weakref.ref(s)), s)[1])(take(self, *a, **k)))
    saver = AsyncSaver()
    try:
        with knobs.override(async_write_through=2):
            saver.save(_state(), tmp_path / "c.pt", background_staging=True).result(timeout=60)
        saver.stager.clear()  # the arena kept for reuse goes: nothing else may hold it
        gc.collect()
        assert taken and all(r() is None for r in taken)
    finally:
        saver.close()


def test_the_knob_takes_0_1_or_2():
    assert knobs.PY_NAMES["async_write_through"][1] == 2
    for bad in (3, -1, "auto"):
        with pytest.raises(ValueError, match="async_write_through .*from 0 to 2"):
            with knobs.override(async_write_through=bad):
                pass


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
@pytest.mark.parametrize("nth", [1, 3])
def test_a_failed_write_from_live_memory(tmp_path, err, nth):
    """The write fails part way (the first request, or one among the live pieces): the future holds
    the error naming the path, the previous file stays, nothing is left behind, the fence does not
    hang, and the next save works."""
    old = _state(4)
    # the first background save of a process starts what the process keeps (the saver's thread
    # and engine): counted before the descriptors are
    fastckpt.async_save(old, tmp_path / "c.pt", background_staging=True).result(timeout=60)
    fds = fd_count()
    sd = _state()
    _C.fault_inject("write", nth=nth, errno=err)
    try:
        fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
        exc = fut.exception(timeout=60)
    finally:
        _C.fault_clear()
    assert isinstance(exc, OSError) and exc.errno == err and str(tmp_path / "c.pt") in str(exc)
    assert fastckpt.wait_staged(timeout=5) and fut.staged
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), old, bitwise=True)
    assert temp_files(tmp_path) == []
    fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True).result(timeout=60)
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), sd, bitwise=True)
    assert fd_count() == fds


def test_a_write_failing_while_the_fence_waits(tmp_path, monkeypatch):
    """The fence waits for the writer's live requests; the writer's next request fails instead: the
    fence returns, the save fails, the previous file stays."""
    old = _state(4)
    fastckpt.save(old, tmp_path / "c.pt")
    sd = _state()
    gate = SendGate(monkeypatch, after=1)
    gate.watch([sd["a"], sd["b"]])
    fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    assert gate.entered.wait(30)
    _C.fault_inject("write", nth=1, errno=errno.EIO, times=0)
    try:
        threading.Timer(0.3, gate.open).start()
        assert fastckpt.wait_staged(timeout=60)
        exc = fut.exception(timeout=60)
    finally:
        _C.fault_clear()
    assert isinstance(exc, OSError) and exc.errno == errno.EIO
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), old, bitwise=True)
    assert temp_files(tmp_path) == []


def test_a_failed_fence_copy_fails_the_save_and_opens_the_fence(tmp_path, monkeypatch):
    from fastckpt.staging import through as through_mod
    sd = _state()
    fastckpt.save(_state(4), tmp_path / "c.pt")
    gate = SendGate(monkeypatch, after=1)
    gate.watch([sd["a"], sd["b"]])

    def broken(jobs, crcs):
        raise MemoryError("no memory for the copy")

    monkeypatch.setattr(through_mod, "copy_with_crcs", broken)
    fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
    assert gate.entered.wait(30)
    threading.Timer(0.3, gate.open).start()
    assert fastckpt.wait_staged(timeout=60) and fut.staged
    with pytest.raises(MemoryError, match="no memory for the copy"):
        fut.result(timeout=60)
    assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), _state(4), bitwise=True)
    assert temp_files(tmp_path) == []


def test_a_dropped_snapshot_does_not_wait_for_a_writer(tmp_path):
    saver = AsyncSaver()
    try:
        staged = saver.stage(_state(), tmp_path / "c.pt", background_staging=True)
        done = threading.Event()
        t = threading.Thread(target=lambda: (saver.drop(staged), done.set()))
        t.start()
        t.join(30)
        assert done.is_set() and staged.fut.cancelled() and staged.fut.staged
        assert fastckpt.wait_staged(timeout=5)
    finally:
        saver.close()
    assert not (tmp_path / "c.pt").exists()


def test_repeated_saves_with_fences_at_every_piece(tmp_path, monkeypatch):
    """A fence after each piece in turn, the state changed after every fence: every file is the
    state at its call."""
    sd = _state()
    for after in range(1, 8):
        with monkeypatch.context() as m:
            gate = SendGate(m, after=after)
            gate.watch([sd["a"], sd["b"]])
            want = _clone(sd)
            fut = fastckpt.async_save(sd, tmp_path / "c.pt", background_staging=True)
            if gate.entered.wait(5):
                threading.Timer(0.05, gate.open).start()
            else:
                gate.open()  # fewer pieces than `after`: the write ends first
            assert fastckpt.wait_staged(timeout=60)
            for v in (sd["a"], sd["b"], sd["odd"]):
                v.add_(after)
            fut.result(timeout=60)
            assert_same(fastckpt.load(tmp_path / "c.pt", verify=True), want, bitwise=True)


_EXIT = r"""
import sys, torch, fastckpt
sys.path.insert(0, sys.argv[3])
from states import page_aligned
sd = {f"w{i}": page_aligned(torch.randn(1024, 1024)) for i in range(6)}
fut = fastckpt.async_save(sd, sys.argv[1], background_staging=True)
if sys.argv[2] == "wait":
    fut.result()
"""


@pytest.mark.parametrize("wait", ["wait", "exit"])
def test_a_process_exits_cleanly_right_after_a_write_through_save(tmp_path, wait):
    """Interpreter exit waits for the save; the tensors the write held are let go on the writer's
    thread before that wait ends (a daemon thread dropping them during finalization aborted the
    process: 'terminate called without an active exception')."""
    import fastspawn
    import states
    script = tmp_path / "exit.py"
    script.write_text(_EXIT)
    for k in range(5):
        p = fastspawn.run([sys.executable, str(script), str(tmp_path / f"c{k}.pt"), wait,
                           os.path.dirname(states.__file__)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (k, p.returncode, p.stderr[-2000:])
        assert fastckpt.load(tmp_path / f"c{k}.pt").keys() == {f"w{i}" for i in range(6)}
