"""FastWriter's staging buffers and per-save state under reuse races.

* A staged dict that is garbage-collected late (its finalizer runs after its
  slot was released by its save and taken by a newer ``stage()``) must not free
  the slot under the newer save: the newer checkpoint holds its own bytes.
* The save of one staged dict releases that dict's buffers, never those of
  another staged dict that is still waiting for its save.
* Overlapping saves that share one FastWriter (two ``dcp.async_save`` calls,
  or a ``dcp.save`` while an async save runs) each write their own checkpoint
  to their own directory; neither is lost while its future reports success.

Interleavings are forced with events at chosen points (no sleeps, no timing).
"""

import gc
import threading

import pytest
import torch
import torch.distributed as dist

if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402

from fastckpt.dcp import FastReader, FastWriter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

WAIT = 120  # seconds: only a bound against a hang, never a timing assertion


class HookedWriter(FastWriter):
    """Runs `before_write` (once) at the start of the next write_data, in the thread of that save."""

    before_write = None

    def write_data(self, plan, planner):
        cb, self.before_write = self.before_write, None
        if cb is not None:
            cb()
        return super().write_data(plan, planner)


def state(v: float, step: int):
    return {"x": torch.full((1000,), v), "y": torch.full((3, 5), -v, dtype=torch.float64), "step": step}


def load(path):
    tgt = {"x": torch.zeros(1000), "y": torch.zeros(3, 5, dtype=torch.float64), "step": 0}
    dcp.load(tgt, storage_reader=FastReader(path))
    return tgt


def assert_holds(path, v: float, step: int):
    got = load(path)
    want = state(v, step)
    assert got["step"] == step, f"{path} holds step {got['step']}, not {step}"
    assert torch.equal(got["x"], want["x"]) and torch.equal(got["y"], want["y"]), \
        f"{path}: x[0]={got['x'][0].item()} (want {v}): another save's bytes"


class _Box:
    """Holds a staged dict in a reference cycle: only gc.collect() frees it."""

    def __init__(self, staged):
        self.staged = staged
        self.me = self


@pytest.fixture
def no_automatic_gc():
    """Garbage is collected only where the test says so."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_late_finalizer_of_an_old_staged_dict_leaves_a_newer_saves_buffers_alone(tmp_path, no_automatic_gc):
    w = HookedWriter(tmp_path / "unused")
    staged1 = w.stage(state(1.0, 1))
    dcp.save(staged1, storage_writer=w, checkpoint_id=tmp_path / "one")  # releases its slot when written
    boxes = [_Box(staged1)]   # the old staged dict stays alive, in a cycle, past its save
    del staged1

    staged2 = w.stage(state(2.0, 2))  # takes the slot the first save released
    kept = []

    def late_gc_then_stage():
        # the chosen point: save 2 is set up and about to write its staged buffers
        boxes.clear()
        assert gc.collect() > 0           # the old staged dict's finalizer runs now
        kept.append(w.stage(state(3.0, 3)))  # must not reuse the buffers save 2 is writing

    w.before_write = late_gc_then_stage
    dcp.save(staged2, storage_writer=w, checkpoint_id=tmp_path / "two")
    assert kept, "the hook did not run"
    assert torch.equal(staged2["x"], state(2.0, 2)["x"]), "a newer stage() overwrote buffers a save was using"
    assert_holds(tmp_path / "one", 1.0, 1)
    assert_holds(tmp_path / "two", 2.0, 2)
    dcp.save(kept[0], storage_writer=w, checkpoint_id=tmp_path / "three")
    assert_holds(tmp_path / "three", 3.0, 3)


def test_a_save_releases_the_buffers_of_the_dict_it_wrote_only(tmp_path):
    w = FastWriter(tmp_path / "unused")
    a = w.stage(state(1.0, 1))
    b = w.stage(state(2.0, 2))          # staged before a's save: waits for a save of its own
    dcp.save(a, storage_writer=w, checkpoint_id=tmp_path / "a")
    c = w.stage(state(3.0, 3))          # may reuse a's buffers, never b's
    assert torch.equal(b["x"], state(2.0, 2)["x"]), "stage() overwrote a staged dict still waiting for its save"
    dcp.save(b, storage_writer=w, checkpoint_id=tmp_path / "b")
    dcp.save(c, storage_writer=w, checkpoint_id=tmp_path / "c")
    assert_holds(tmp_path / "a", 1.0, 1)
    assert_holds(tmp_path / "b", 2.0, 2)
    assert_holds(tmp_path / "c", 3.0, 3)
    assert w.staging_allocations == 2   # one arena each for a and b; c reused a's


def test_overlapping_async_saves_sharing_one_writer_both_land(tmp_path):
    w = HookedWriter(tmp_path / "unused")
    inside, go = threading.Event(), threading.Event()

    def hold_first_save():  # in save 1's thread: planned, its directory set up, not yet written
        inside.set()
        assert go.wait(WAIT)

    w.before_write = hold_first_save
    f1 = dcp.async_save(state(1.0, 1), checkpoint_id=tmp_path / "one", storage_writer=w)
    try:
        assert inside.wait(WAIT), f1.exception(timeout=0) if f1.done() else "save 1 did not reach write_data"
        f2 = dcp.async_save(state(2.0, 2), checkpoint_id=tmp_path / "two", storage_writer=w)
        f2.result(timeout=WAIT)   # save 2 runs to the end while save 1 is held
    finally:
        go.set()
    f1.result(timeout=WAIT)       # reports success: then its checkpoint must be there, with its bytes
    assert_holds(tmp_path / "one", 1.0, 1)
    assert_holds(tmp_path / "two", 2.0, 2)
    md = FastReader(tmp_path / "one").read_metadata()
    assert str(md.storage_meta.checkpoint_id) == str(tmp_path / "one")
    # after both, the staging buffers are reused: a third save allocates nothing
    allocs = w.staging_allocations
    dcp.async_save(state(3.0, 3), checkpoint_id=tmp_path / "three", storage_writer=w).result(timeout=WAIT)
    assert w.staging_allocations == allocs
    assert_holds(tmp_path / "three", 3.0, 3)


def test_sync_save_while_an_async_save_of_the_same_writer_runs(tmp_path):
    w = HookedWriter(tmp_path / "default")
    inside, go = threading.Event(), threading.Event()

    def hold():
        inside.set()
        assert go.wait(WAIT)

    w.before_write = hold
    f1 = dcp.async_save(state(1.0, 1), checkpoint_id=tmp_path / "async", storage_writer=w)
    try:
        assert inside.wait(WAIT), "the async save did not reach write_data"
        dcp.save(state(2.0, 2), storage_writer=w, checkpoint_id=tmp_path / "sync")
    finally:
        go.set()
    f1.result(timeout=WAIT)
    assert_holds(tmp_path / "async", 1.0, 1)
    assert_holds(tmp_path / "sync", 2.0, 2)
    # without a checkpoint_id, a save writes to the directory the last reset() named, as the stock writer
    dcp.save(state(4.0, 4), storage_writer=w)
    assert_holds(tmp_path / "sync", 4.0, 4)
