"""Faults: a matrix of injected errors (ENOSPC, EIO), EINTR/EAGAIN
storms (50 in a row) and short transfers at several points of fastckpt.save,
fastckpt.load, dcp.save/dcp.load with FastWriter/FastReader (one process, no
process group) and CheckpointManager.save/load_latest.

Every fault gives either success (storms and short transfers must be retried)
or an OSError carrying the injected errno and a path inside the checkpoint
directory; afterwards no temporary file and no extra descriptor is left, the
previous checkpoint is bitwise intact, and the next save succeeds.

Not repeated here (identical cases in test_serialization.py's
test_fault_keeps_the_old_checkpoint): fastckpt.save with write-1/3-ENOSPC,
write-2-EIO, fsync-1-ENOSPC/EIO, rename-1-EXDEV/ENOSPC.

Also a real full filesystem: a 8 MiB tmpfs (root and mount(2) needed, else skipped).
"""
import errno
import os
import shutil
import subprocess
import tempfile
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastckpt
from fastckpt import FormatError, _C
from fastckpt.dcp import FastReader, FastWriter

from dcp_calls import dcp_unwrapped
from leaks import fd_count, temp_files
from states import same_state

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SMALL = dict(buffer_size=64 << 10, buffer_count=4, queue_depth=4)


def _state(seed, n=300000):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "i": torch.randint(0, 1000, (4099,), generator=g),
            "h": torch.randn(333, generator=g).to(torch.bfloat16), "step": seed}



def _tree(d):
    out = {}
    for root, _, files in os.walk(d):
        for n in files:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = f.read()
    return out


def _all_temps(d):
    return [os.path.join(r, n) for r, dirs, files in os.walk(d) for n in files + dirs if ".fastckpt-tmp." in n]


def _check_error(e, err, directory):
    assert isinstance(e, OSError), repr(e)
    assert e.errno == err, repr(e)
    assert os.strerror(err) in str(e), str(e)
    fn = e.filename or ""
    d = os.path.realpath(directory)
    assert fn == d or fn.startswith(d + os.sep) or fn.startswith(str(directory)), (fn, d)


# ---------------------------------------------------------------- the matrix
# (op, nth, kwargs for fault_inject, expectation); expectation "ok" = must succeed,
# an errno = must fail with it, "ok|EIO" etc. = either (documented below).
STORM = dict(times=50)
WRITE_FAULTS = [
    ("open", 1, dict(errno=errno.ENOSPC), errno.ENOSPC),
    ("open", 1, dict(errno=errno.EIO), errno.EIO),
    ("write", 2, dict(errno=errno.EIO), errno.EIO),
    ("write", 5, dict(errno=errno.ENOSPC), errno.ENOSPC),
    ("fallocate", 1, dict(errno=errno.ENOSPC), errno.ENOSPC),
    ("truncate", 1, dict(errno=errno.EIO), errno.EIO),
    ("fsync", 1, dict(errno=errno.EIO), errno.EIO),
    ("rename", 1, dict(errno=errno.EIO), errno.EIO),
    ("open", 1, dict(errno=errno.EINTR, **STORM), "ok"),
    ("write", 1, dict(errno=errno.EINTR, **STORM), "ok"),
    ("write", 3, dict(errno=errno.EAGAIN, **STORM), "ok"),
    ("fsync", 1, dict(errno=errno.EINTR, **STORM), "ok"),
    ("fallocate", 1, dict(errno=errno.EINTR, **STORM), "ok"),
    ("truncate", 1, dict(errno=errno.EINTR, **STORM), "ok"),
    ("write", 1, dict(short=4096, **STORM), "ok"),
    ("write", 2, dict(short=100, **STORM), "ok"),
    ("write", 4, dict(short=0, times=3), "ok|EIO"),  # zero-length writes: retried or a clean EIO
]
READ_FAULTS = [
    ("open", 1, dict(errno=errno.EIO), errno.EIO),
    ("read", 1, dict(errno=errno.EIO), errno.EIO),
    ("read", 3, dict(errno=errno.EIO), errno.EIO),
    ("read", 2, dict(errno=errno.ENOMEM), errno.ENOMEM),
    ("open", 1, dict(errno=errno.EINTR, **STORM), "ok"),
    ("read", 1, dict(errno=errno.EINTR, **STORM), "ok"),
    ("read", 2, dict(errno=errno.EAGAIN, **STORM), "ok"),
    ("read", 1, dict(short=4096, **STORM), "ok"),
    ("read", 2, dict(short=0, times=3), "ok|format"),  # a zero-length read is end of file: a truncated file
]


def _ids(faults):
    def one(op, nth, kw, _):
        what = errno.errorcode[kw["errno"]] if "errno" in kw else f"short{kw['short']}"
        return f"{op}-{nth}-{what}" + (f"x{kw['times']}" if kw.get("times", 1) > 1 else "")
    return [one(*f) for f in faults]


def _run(fn, op, nth, kw, expect, directory):
    """Run fn under the fault; returns 'ok' or 'failed' after checking the exception."""
    _C.fault_inject(op, nth=nth, **kw)
    try:
        fn()
        outcome = "ok"
    except (OSError, FormatError) as e:
        outcome = "failed"
        if expect == "ok|format":
            assert isinstance(e, FormatError), repr(e)
        elif expect == "ok|EIO":
            _check_error(e, errno.EIO, directory)
        else:
            assert expect != "ok", f"{op}-{nth} {kw}: should have been retried, got {e!r}"
            _check_error(e, expect, directory)
        del e
    fired = _C.fault_fired()
    _C.fault_clear()
    assert fired >= 1, "the fault never fired: the matrix point is dead"
    if outcome == "ok":
        assert expect in ("ok", "ok|EIO", "ok|format"), f"{op}-{nth} {kw}: expected errno {expect}, it succeeded"
    return outcome


def _with_direct(faults):
    """(direct, fault) pairs: O_DIRECT and buffered, except unaligned short transfers
    under O_DIRECT (no kernel returns those before end of file; requeuing the rest
    at an unaligned offset is EINVAL there)."""
    out, ids = [], []
    for direct, name in ((1, "odirect"), (0, "buffered")):
        for f, i in zip(faults, _ids(faults)):
            if direct and f[2].get("short", 0) % 4096:
                continue
            out.append((direct,) + f)
            ids.append(f"{i}-{name}")
    return dict(argvalues=out, ids=ids)


@pytest.mark.parametrize("direct,op,nth,kw,expect", **_with_direct(WRITE_FAULTS))
def test_save_faults(tmp_path, backend, direct, op, nth, kw, expect):
    path = tmp_path / "ckpt.pt"
    old, new = _state(1), _state(2)
    with fastckpt.knobs.override(backend=backend, direct=direct, **SMALL):
        fastckpt.save(old, path)  # also warms this configuration's engine
        before, fds = path.read_bytes(), fd_count()
        outcome = _run(lambda: fastckpt.save(new, path), op, nth, kw, expect, tmp_path)
        assert temp_files(tmp_path) == []
        assert fd_count() == fds
        if outcome == "ok":
            assert same_state(fastckpt.load(path, verify=True), new)
        else:
            assert path.read_bytes() == before
            assert same_state(fastckpt.load(path, verify=True), old)
        fastckpt.save(_state(3), path)
        assert same_state(fastckpt.load(path, verify=True), _state(3))
        assert temp_files(tmp_path) == []


def test_save_fault_in_directory_fsync_after_rename(tmp_path, backend):
    """ENGINE.md: if the directory fsync after the rename fails, commit() raises
    although the complete new file is already under the final name."""
    path = tmp_path / "ckpt.pt"
    with fastckpt.knobs.override(backend=backend, **SMALL):
        fastckpt.save(_state(1), path)
        fds = fd_count()
        _C.fault_inject("fsync", nth=2, errno=errno.EIO)
        with pytest.raises(OSError) as ei:
            fastckpt.save(_state(2), path)
        _check_error(ei.value, errno.EIO, tmp_path)
        del ei
        assert same_state(fastckpt.load(path, verify=True), _state(2))
        assert temp_files(tmp_path) == [] and fd_count() == fds


@pytest.mark.parametrize("direct,op,nth,kw,expect", **_with_direct(READ_FAULTS))
def test_load_faults(tmp_path, backend, direct, op, nth, kw, expect):
    path = tmp_path / "ckpt.pt"
    old = _state(1)
    with fastckpt.knobs.override(backend=backend, direct=direct, **SMALL):
        fastckpt.save(old, path)
        fastckpt.load(path)
        before, fds = path.read_bytes(), fd_count()
        got = {}
        outcome = _run(lambda: got.update(fastckpt.load(path, verify=True)), op, nth, kw, expect, tmp_path)
        if outcome == "ok":
            assert same_state(got, old)
        assert fd_count() == fds and temp_files(tmp_path) == []
        assert path.read_bytes() == before
        fastckpt.save(_state(3), path)
        assert same_state(fastckpt.load(path, verify=True), _state(3))


def test_short_unaligned_reads_are_requeued_when_buffered(tmp_path):
    """Short reads of a length that is no multiple of the block size: requeued
    (buffered I/O; O_DIRECT returns only aligned short reads before end of file)."""
    path = tmp_path / "ckpt.pt"
    with fastckpt.knobs.override(direct=0, **SMALL):
        fastckpt.save(_state(1), path)
        _C.fault_inject("read", nth=1, short=100, times=50)
        assert same_state(fastckpt.load(path, verify=True), _state(1))
        assert _C.fault_fired() == 50


# ---------------------------------------------------------------- DCP, one process

def _dcp_sd(seed):
    s = _state(seed, n=200000)
    return {"model": {"w": s["w"], "i": s["i"], "h": s["h"]}, "step": seed}


def _dcp_target(seed):
    sd = _dcp_sd(seed)
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}


DCP_WRITE_FAULTS = [f for f in WRITE_FAULTS if f[0] != "open" and not f[2].get("short", 0) % 4096] + [
    ("write", 1, dict(errno=errno.ENOSPC, path_contains=".metadata"), errno.ENOSPC),
    ("rename", 1, dict(errno=errno.EIO, path_contains=".metadata"), errno.EIO),
]


@pytest.mark.parametrize("op,nth,kw,expect", DCP_WRITE_FAULTS, ids=_ids(DCP_WRITE_FAULTS))
def test_dcp_save_faults(tmp_path, op, nth, kw, expect):
    """Each step in its own directory (FORMAT.md 2.4): a failed save of step 2
    leaves step 1 untouched and step 2 without .metadata (not loadable)."""
    d1, d2 = tmp_path / "step_1", tmp_path / "step_2"
    with fastckpt.knobs.override(**SMALL):
        dcp.save(_dcp_sd(1), storage_writer=FastWriter(d1))
        dcp.save(_dcp_sd(1), storage_writer=FastWriter(tmp_path / "warm"))
        shutil.rmtree(tmp_path / "warm")
        before, fds = _tree(d1), fd_count()
        outcome = _run(lambda: dcp_unwrapped(dcp.save, _dcp_sd(2), storage_writer=FastWriter(d2)), op, nth, kw, expect, d2)
        assert _all_temps(tmp_path) == []
        assert fd_count() == fds
        assert _tree(d1) == before
        if outcome == "ok":
            tgt = _dcp_target(2)
            dcp_unwrapped(dcp.load, tgt, storage_reader=FastReader(d2))
            assert same_state(tgt, _dcp_sd(2))
        else:
            assert not (d2 / ".metadata").exists()
            with pytest.raises(FileNotFoundError, match="not a complete DCP checkpoint"):
                FastReader(d2).read_metadata()
        tgt = _dcp_target(1)
        dcp_unwrapped(dcp.load, tgt, storage_reader=FastReader(d1))
        assert same_state(tgt, _dcp_sd(1))
        dcp.save(_dcp_sd(3), storage_writer=FastWriter(d2))  # a retry succeeds
        tgt = _dcp_target(3)
        dcp_unwrapped(dcp.load, tgt, storage_reader=FastReader(d2))
        assert same_state(tgt, _dcp_sd(3))


# (.metadata is read with Python I/O, not through the engine's hook: no point there)
DCP_READ_FAULTS = [f for f in READ_FAULTS if f[3] != "ok|format" and not f[2].get("short", 0) % 4096]


@pytest.mark.parametrize("op,nth,kw,expect", DCP_READ_FAULTS, ids=_ids(DCP_READ_FAULTS))
def test_dcp_load_faults(tmp_path, op, nth, kw, expect):
    d = tmp_path / "step_1"
    with fastckpt.knobs.override(**SMALL):
        dcp.save(_dcp_sd(1), storage_writer=FastWriter(d))
        dcp_unwrapped(dcp.load, _dcp_target(1), storage_reader=FastReader(d))
        before, fds = _tree(d), fd_count()
        tgt = _dcp_target(1)
        outcome = _run(lambda: dcp_unwrapped(dcp.load, tgt, storage_reader=FastReader(d)), op, nth, kw, expect, d)
        if outcome == "ok":
            assert same_state(tgt, _dcp_sd(1))
        assert fd_count() == fds and _all_temps(tmp_path) == []
        assert _tree(d) == before


# ---------------------------------------------------------------- CheckpointManager

MANAGER_FAULTS = [
    ("write", 2, dict(errno=errno.ENOSPC, path_contains="step_"), errno.ENOSPC),
    ("fsync", 1, dict(errno=errno.EIO, path_contains="step_"), errno.EIO),
    ("write", 1, dict(errno=errno.ENOSPC, path_contains="latest"), errno.ENOSPC),
    ("rename", 1, dict(errno=errno.EIO, path_contains="latest"), errno.EIO),
    ("write", 1, dict(errno=errno.EINTR, times=50), "ok"),
    ("write", 1, dict(short=4096, times=50), "ok"),
    ("fsync", 1, dict(errno=errno.EINTR, times=50, path_contains="latest"), "ok"),
]


@pytest.mark.parametrize("op,nth,kw,expect", MANAGER_FAULTS, ids=_ids(MANAGER_FAULTS))
def test_manager_save_faults(tmp_path, op, nth, kw, expect):
    d = tmp_path / "ck"
    with fastckpt.knobs.override(**SMALL):
        mgr = fastckpt.CheckpointManager(d, keep_last=2)
        mgr.save(1, _state(1))
        before, fds = (d / "step_00000001.pt").read_bytes(), fd_count()
        outcome = _run(lambda: mgr.save(2, _state(2)), op, nth, kw, expect, d)
        assert temp_files(d) == [] and fd_count() == fds
        assert (d / "step_00000001.pt").read_bytes() == before
        if outcome == "ok":
            assert mgr.latest_name() == "step_00000002.pt"
        else:
            # a failed `latest` update leaves the complete step 2 file, but latest names step 1
            assert mgr.latest_name() == "step_00000001.pt"
        # `latest` is authoritative (README): after a failed save, even one whose complete
        # step 2 file is in place and only the `latest` update failed, step 1 is loaded
        # (a newer complete file is named in a warning, never loaded)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            r = mgr.load_latest()
        assert r.step == (2 if outcome == "ok" else 1) and same_state(r.state, _state(r.step))
        mgr.save(3, _state(3))
        r = fastckpt.CheckpointManager(d, keep_last=2).load_latest()
        assert r.step == 3 and same_state(r.state, _state(3))
        assert temp_files(d) == []


@pytest.mark.parametrize("case", ["eio_newest", "eintr_storm", "short_reads"])
def test_manager_load_latest_faults(tmp_path, case):
    d = tmp_path / "ck"
    with fastckpt.knobs.override(**SMALL):
        mgr = fastckpt.CheckpointManager(d, keep_last=3)
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        fds = fd_count()
        if case == "eio_newest":
            # EIO says the machine is in trouble, not the checkpoint: it propagates, naming
            # the file, instead of a silent rollback to step 1
            _C.fault_inject("read", nth=1, errno=errno.EIO, times=0, path_contains="step_00000002")
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                with pytest.raises(OSError, match="step_00000002") as ei:
                    mgr.load_latest()
            assert ei.value.errno == errno.EIO
            assert _C.fault_fired() >= 1
            _C.fault_clear()
            r = mgr.load_latest()
            assert r.step == 2 and same_state(r.state, _state(2))
        else:
            kw = dict(errno=errno.EINTR) if case == "eintr_storm" else dict(short=4096)
            _C.fault_inject("read", nth=1, times=50, **kw)
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                r = mgr.load_latest()
            assert r.step == 2 and same_state(r.state, _state(2))
            assert _C.fault_fired() >= 1
            _C.fault_clear()
        assert fd_count() == fds and temp_files(d) == []
        mgr.save(3, _state(3))
        assert mgr.load_latest().step == 3


# ---------------------------------------------------------------- a real full filesystem

@pytest.fixture
def small_tmpfs():
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    d = tempfile.mkdtemp(prefix="fastckpt-fullfs-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", d], capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"mount -t tmpfs refused here: {r.stderr.strip() or r.returncode}")
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


@pytest.mark.parametrize("backend_name", ["uring", "threads"])
def test_real_enospc_on_a_full_filesystem(small_tmpfs, backend_name):
    from engines import uring_refusal
    if backend_name == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    path = os.path.join(small_tmpfs, "ckpt.pt")
    old = {"w": torch.randn(3 << 18)}            # 3 MiB: fits twice (old file + its replacement)
    with fastckpt.knobs.override(backend=backend_name, **SMALL):
        for prealloc in (1, 0):  # refused by fallocate, or by a write once the space runs out
            with fastckpt.knobs.override(preallocate=prealloc):
                fastckpt.save(old, path)  # also creates this configuration's engine
                before, fds = open(path, "rb").read(), fd_count()
                with pytest.raises(OSError) as ei:
                    fastckpt.save({"w": torch.randn(3 << 19)}, path)  # 6 MiB beside the old 3 MiB
            _check_error(ei.value, errno.ENOSPC, small_tmpfs)
            del ei
            assert temp_files(small_tmpfs) == [] and fd_count() == fds
            assert open(path, "rb").read() == before
            assert same_state(fastckpt.load(path, verify=True), old)
        small = {"w": torch.randn(1000)}
        fastckpt.save(small, path)  # fits: the old file's space comes back after the rename
        assert same_state(fastckpt.load(path, verify=True), small)
        assert temp_files(small_tmpfs) == []


# ---------------------------------------------------------------- CUDA: pinned memory after faults

def _pinned_state():
    s = torch.cuda.memory.host_memory_stats()
    from fastckpt.staging import device as _staging
    return (s.get("allocated_bytes.current", 0), s.get("active_requests.current", 0),
            sum(len(p._free) for p in _staging._pools.values()),
            sum(p._lent for p in _staging._pools.values()))


def test_cuda_faults_leak_no_pinned_memory(tmp_path):
    """Faulted saves of CUDA state (fastckpt.save through the pinned stager,
    async_save through its pinned arena, dcp.save with FastWriter) give the
    injected error and leave the pinned pools as they were: no pinned block
    allocated or left checked out, the staging pool's buffers all back in it,
    no descriptor or temporary file left; the next saves succeed."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {"w": torch.randn(20 << 20, device="cuda", generator=g), "b": torch.randn(1000, device="cuda", generator=g)}
    path, ck = tmp_path / "c.pt", tmp_path / "dcp"

    def sync_save():
        fastckpt.save(sd, path)

    def async_save():
        err = fastckpt.async_save(sd, path).exception()
        if err is not None:
            raise err

    def dcp_save():
        dcp_unwrapped(dcp.save, sd, storage_writer=FastWriter(ck), no_dist=True)

    kinds = (sync_save, async_save, dcp_save)
    for save in kinds:  # the pools are filled once, then reused
        save()
    torch.cuda.synchronize()
    before, fds = _pinned_state(), fd_count()
    for _ in range(3):
        for save in kinds:
            _C.fault_inject("write", nth=2, errno=errno.ENOSPC)
            with pytest.raises(OSError) as ei:
                save()
            _C.fault_clear()
            assert ei.value.errno == errno.ENOSPC, (save.__name__, ei.value)
            del ei
            torch.cuda.synchronize()
            assert _pinned_state() == before, save.__name__
            assert fd_count() == fds and temp_files(tmp_path) == [] and temp_files(ck) == []
    for save in kinds:
        save()
    cpu = {k: v.cpu() for k, v in sd.items()}
    assert same_state(fastckpt.load(path, map_location="cpu", verify=True), cpu)
    tgt = {k: torch.zeros_like(v) for k, v in cpu.items()}
    dcp_unwrapped(dcp.load, tgt, storage_reader=FastReader(ck), no_dist=True)
    assert same_state(tgt, cpu)
    assert _pinned_state() == before
