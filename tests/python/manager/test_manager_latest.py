"""CheckpointManager.load_latest: `latest` is authoritative (rollbacks), only a
damaged checkpoint is skipped, and weights_only holds in sharded mode too.
One process; the two-rank runs are in test_ddp_resume.py and test_manager_exit.py.
"""
import errno
import os
import pickle
import warnings

import pytest
import torch

import fastckpt
from fastckpt import _C
from fastckpt.manager.manager import CheckpointManager
from leaks import temp_files

pytestmark = [pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
              # DCP in one process: "assuming the intent is to save in a single process"
              pytest.mark.filterwarnings("ignore:.*single process.*:UserWarning")]


def small_state(v):
    return {"w": torch.full((256,), float(v)), "b": torch.arange(v, v + 4), "step": v}


def sharded_state(v):
    return {"model": {"w": torch.full((64,), float(v)), "b": torch.arange(8) + v}, "step": v}


def blank(sharded):
    return sharded_state(-1) if sharded else None


def assert_state(got, v, sharded):
    want = sharded_state(v) if sharded else small_state(v)
    if sharded:
        assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["model"]["b"], want["model"]["b"])
    else:
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    assert got["step"] == v


def make(tmp_path, sharded, steps, keep_last=3):
    mgr = CheckpointManager(tmp_path, keep_last=keep_last, sharded=sharded)
    for s in steps:
        mgr.save(s, sharded_state(s) if sharded else small_state(s))
    return mgr


needs_dcp = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
MODES = [pytest.param(False, id="replicated"), pytest.param(True, id="sharded", marks=needs_dcp)]


# ---------------------------------------------------------------- item 11: latest is authoritative

@pytest.mark.parametrize("sharded", MODES)
def test_load_latest_follows_latest_after_a_rollback(tmp_path, sharded, caplog):
    """Steps 10, 20, 30, then 5: `latest` names 5 and load_latest loads 5; 10-30
    are an abandoned branch, moved into abandoned/ and kept; retention counts
    only the new branch."""
    mgr = make(tmp_path, sharded, (10, 20, 30))
    with caplog.at_level("WARNING", logger="fastckpt"):
        mgr.save(5, sharded_state(5) if sharded else small_state(5))
    name = mgr.name_for
    assert (tmp_path / "latest").read_text() == f"{name(5)}\n"
    r = mgr.load_latest(state=blank(sharded))
    assert r.step == 5 and r.path == str(tmp_path / name(5))
    assert_state(r.state, 5, sharded)
    assert mgr.steps() == [5]
    assert sorted(os.listdir(tmp_path / "abandoned")) == [name(10), name(20), name(30)]
    assert any("abandoned" in rec.getMessage() and name(30) in rec.getMessage() for rec in caplog.records)
    for s in (6, 7, 8):  # the new branch goes on; retention never touches the abandoned one
        mgr.save(s, sharded_state(s) if sharded else small_state(s))
    assert mgr.steps() == [6, 7, 8] and mgr.load_latest(state=blank(sharded)).step == 8
    assert sorted(os.listdir(tmp_path / "abandoned")) == [name(10), name(20), name(30)]
    assert temp_files(tmp_path) == []
    # the abandoned checkpoints are intact (they can be moved back by hand)
    if not sharded:
        assert_state(fastckpt.load(tmp_path / "abandoned" / name(30), verify=True), 30, sharded)


@pytest.mark.parametrize("sharded", MODES)
def test_newer_checkpoints_left_before_the_move_are_never_loaded(tmp_path, sharded):
    """A crash right after `latest` moved back to step 5 (before the newer ones
    were moved aside), or a save that renamed its checkpoint but never moved
    `latest`: load_latest still loads what `latest` names, and says why."""
    mgr = make(tmp_path, sharded, (5, 10, 20, 30), keep_last=None)
    (tmp_path / "latest").write_text(f"{mgr.name_for(5)}\n")
    with pytest.warns(RuntimeWarning, match=r"not loading .*step_00000010.*step_00000030.* newer than"):
        r = mgr.load_latest(state=blank(sharded))
    assert r.step == 5
    assert_state(r.state, 5, sharded)
    mgr.save(6, sharded_state(6) if sharded else small_state(6))  # the next commit moves them aside
    assert mgr.steps() == [5, 6]
    assert sorted(os.listdir(tmp_path / "abandoned")) == [mgr.name_for(s) for s in (10, 20, 30)]


def test_a_second_rollback_keeps_both_abandoned_copies(tmp_path):
    mgr = make(tmp_path, False, (10, 20))
    mgr.save(5, small_state(5))
    mgr.save(20, small_state(21))  # the new branch's step 20
    mgr.save(5, small_state(5))
    assert sorted(os.listdir(tmp_path / "abandoned")) == ["step_00000010.pt", "step_00000020.pt",
                                                          "step_00000020.pt.1"]
    assert fastckpt.load(tmp_path / "abandoned" / "step_00000020.pt.1")["step"] == 21
    assert mgr.load_latest().step == 5


def test_damaged_latest_falls_back_only_to_older_steps(tmp_path):
    """Fallback from the checkpoint `latest` names goes to older steps, never
    to a newer (abandoned) one."""
    mgr = make(tmp_path, False, (10, 20, 30), keep_last=None)
    (tmp_path / "latest").write_text("step_00000020.pt\n")
    p = tmp_path / "step_00000020.pt"
    os.truncate(p, p.stat().st_size // 2)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r = mgr.load_latest()
    assert r.step == 10
    msgs = [str(w.message) for w in rec]
    assert any("skipping checkpoint" in m and "step_00000020.pt" in m for m in msgs), msgs


def test_missing_latest_file_tries_newest_first_with_a_warning(tmp_path):
    mgr = make(tmp_path, False, (10, 20))
    os.unlink(tmp_path / "latest")
    with pytest.warns(RuntimeWarning, match="latest is missing"):
        assert mgr.load_latest().step == 20


# ---------------------------------------------------------------- item 12: no silent rollback

@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES, errno.ENOMEM, errno.ESTALE])
@pytest.mark.parametrize("sharded", MODES)
def test_io_errors_propagate_instead_of_rolling_back(tmp_path, sharded, err):
    """EIO (a failing disk), EACCES (permissions), ENOMEM, ESTALE (NFS): the
    machine is in trouble, not the checkpoint."""
    mgr = make(tmp_path, sharded, (10, 20))
    _C.fault_inject("read", nth=1, errno=err, times=0, path_contains="step_00000020")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "skipping checkpoint" either
        with pytest.raises(OSError) as ei:
            mgr.load_latest(state=blank(sharded))
    assert ei.value.errno == err
    assert any("step_00000020" in n and "not a damaged checkpoint" in n for n in getattr(ei.value, "__notes__", []))
    _C.fault_clear()
    assert mgr.load_latest(state=blank(sharded)).step == 20


@pytest.mark.parametrize("sharded", MODES)
def test_out_of_memory_propagates_instead_of_rolling_back(tmp_path, sharded, monkeypatch):
    mgr = make(tmp_path, sharded, (10, 20))
    if sharded:
        import torch.distributed.checkpoint as dcp
        real = dcp.load

        def load(state, *, storage_reader, **kw):
            if "step_00000020" in str(storage_reader.path):
                raise MemoryError("simulated: cannot allocate")
            return real(state, storage_reader=storage_reader, **kw)
        monkeypatch.setattr(dcp, "load", load)
    else:
        import fastckpt.serialization as m  # the manager's replicated loads call fastckpt.serialization.load
        real = m.load

        def load(path, **kw):
            if "step_00000020" in str(path):
                raise MemoryError("simulated: cannot allocate")
            return real(path, **kw)
        monkeypatch.setattr(m, "load", load)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(MemoryError, match="simulated"):
            mgr.load_latest(state=blank(sharded))


def test_a_map_location_error_propagates_instead_of_rolling_back(tmp_path):
    """A device that runs out of memory while step 20 is mapped onto it: raised,
    not 'resumed' from step 10."""
    mgr = make(tmp_path, False, (10, 20))
    calls = []

    def flaky(storage, location):
        calls.append(location)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return storage

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            mgr.load_latest(map_location=flaky)
    assert mgr.load_latest(map_location=flaky).step == 20


@pytest.mark.parametrize("sharded", MODES)
def test_missing_or_incomplete_checkpoint_still_falls_back(tmp_path, sharded):
    """What does count as damage: a file gone (FileNotFoundError), a truncated
    file (FormatError), a sharded checkpoint without a data file."""
    mgr = make(tmp_path, sharded, (10, 20))
    if sharded:
        for f in (tmp_path / "step_00000020").glob("*.distcp"):
            os.unlink(f)
    else:
        import fastckpt.serialization as m  # the manager's replicated loads call fastckpt.serialization.load
        real = m.load
        m_load = pytest.MonkeyPatch()

        def load(path, **kw):  # the file vanished between listing and loading
            if "step_00000020" in str(path):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
            return real(path, **kw)
        m_load.setattr(m, "load", load)
    try:
        with pytest.warns(RuntimeWarning, match=r"skipping checkpoint .*step_00000020"):
            r = mgr.load_latest(state=blank(sharded))
    finally:
        if not sharded:
            m_load.undo()
    assert r.step == 10
    assert_state(r.state, 10, sharded)


# ---------------------------------------------------------------- item 1: weights_only in sharded mode

RAN = []


def _touch(path):
    with open(path, "w") as f:
        f.write("ran")
    return "payload"


class Payload:
    """A non-tensor value whose unpickling runs code (it touches a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


@needs_dcp
def test_sharded_load_latest_weights_only_refuses_code_in_values(tmp_path):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    mgr = CheckpointManager(ckpt, sharded=True)
    mgr.save(10, sharded_state(10))
    mgr.save(20, {**sharded_state(20), "extra": Payload(str(marker))})
    target = {**sharded_state(-1), "extra": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a refusal is not corruption: no fallback to 10
        with pytest.raises(pickle.UnpicklingError):
            mgr.load_latest(state=target)  # weights_only=True is the default
    assert not marker.exists(), "loading with weights_only=True ran code from the checkpoint"
    with pytest.raises(pickle.UnpicklingError):
        mgr.load_latest(state={**sharded_state(-1), "extra": None}, weights_only=True)
    assert not marker.exists()
    # What the refusal protects against: the stock path runs it.
    target = {**sharded_state(-1), "extra": None}
    r = mgr.load_latest(state=target, weights_only=False)
    assert r.step == 20 and marker.exists() and target["extra"] == "payload"
    # Plain values (ints, strings, lists) load with weights_only=True.
    mgr.save(30, {**sharded_state(30), "extra": {"lr": 0.1, "name": "adamw"}})
    target = {**sharded_state(-1), "extra": {"lr": None, "name": None}}
    assert mgr.load_latest(state=target).step == 30 and target["extra"] == {"lr": 0.1, "name": "adamw"}


def test_load_latest_into_the_state_the_job_has(tmp_path):
    """Replicated mode with state=: the checkpoint fills the caller's tensors in place (fastckpt.load_into),
    a damaged newest one is skipped as by a plain load, and a state that does not match raises at once."""
    mgr = CheckpointManager(tmp_path / "c", keep_last=3)
    for v in (1, 2, 3):
        mgr.save(v, small_state(v))
    target = small_state(0)
    ptrs = (target["w"].data_ptr(), target["b"].data_ptr())
    r = mgr.load_latest(state=target)
    assert r.step == 3 and r.state is target and (target["w"].data_ptr(), target["b"].data_ptr()) == ptrs
    assert_state(target, 3, False) and target["step"] == 3
    with open(mgr.path_for(3), "r+b") as f:  # a flipped byte inside w's record: its CRC fails
        data = f.read()
        at = data.index(torch.full((256,), 3.0).numpy().tobytes()) + 100
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    with pytest.warns(RuntimeWarning, match="damaged"):
        r = mgr.load_latest(state=target)
    assert r.step == 2 and r.state is target
    assert_state(target, 2, False)
    with pytest.raises(fastckpt.StateMismatchError, match="w"):
        mgr.load_latest(state={"w": torch.zeros(3), "b": torch.zeros(4, dtype=torch.int64), "step": 0})
    with pytest.raises(ValueError, match="map_location"):
        mgr.load_latest(map_location="cpu", state=target)
    mgr.close()
