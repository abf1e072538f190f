"""fastckpt.async_save: checkpoint in the background while training goes on.

``async_save(obj, path)`` pickles ``obj`` and copies every tensor's storage
(CPU or CUDA) into host staging memory, then returns a
:class:`concurrent.futures.Future`; a background thread writes that snapshot
with :func:`fastckpt.save` (same file, same atomic durable commit). The caller
may modify or free its tensors as soon as ``async_save`` returns.

Staging memory is one contiguous *arena* per snapshot (the staging layer's
snapshot component, :mod:`fastckpt.staging.snapshot`), exactly the state's
size rounded up to 1 MiB (page-locked once through :mod:`fastckpt.staging.device`
when the state holds CUDA tensors, so device-to-host copies run at full
speed; never rounded up to a power of two), taken
from a small pool and given back when the write is done: saving the same
state again reuses the same arena, nothing is allocated. The writer sends the
page-aligned bodies of the large storages to the disk straight from the arena
(O_DIRECT; no second copy through the engine's staging buffers: docs/ENGINE.md,
``append_borrowed``) with the CRC-32 each host storage's copy took in the
same pass (``Snapshot.crcs``), so the background work is mostly the I/O.
Host memory is
bounded by ``async_max_in_flight`` (a :mod:`fastckpt.knobs` knob, default 1)
times the size of the state: a call that would exceed that many saves in
flight waits for the oldest to finish first.

Errors are never lost, and a failed save never stops the next one:

* a failed save's future holds the exception, and the failure is logged at
  ERROR level on the ``fastckpt`` logger when it happens (the path and the
  cause);
* ``async_save`` never raises an *earlier* save's failure: the next save is
  snapshotted and written as usual (a call raises only for its own snapshot);
* a failure whose future nobody looked at (``result()`` or ``exception()``) is
  raised by the next :func:`wait_for_saves` (or :meth:`AsyncSaver.wait`,
  :meth:`fastckpt.CheckpointManager.wait` / ``close()``), once, with a note
  naming the save; at interpreter exit (which waits for pending saves) it is
  logged again at ERROR level.

A saver's writer thread runs only while it has saves to write: it starts
with the first pending save and ends once none is left (a later save starts
a new one), so an idle saver holds no thread. It is a daemon thread (the
exit handler below waits for its saves, so none is cut short) with a
``stop()`` that waits for the pending saves and joins it. A saver of one's
own (:class:`AsyncSaver`) is stopped with :meth:`AsyncSaver.close`: it
finishes the pending saves, joins its writer thread and raises a failure
nobody looked at; nothing of it is left running.

A training loop that must stop at the first failed checkpoint checks the
previous save's future (``fut.exception(timeout=0)`` once ``fut.done()``) or
calls :func:`wait_for_saves` now and then.

After ``os.fork()`` (or multiprocessing's "fork" start method) the child's
savers start afresh: a writer thread of their own (the parent's does not
exist in the child), new locks, no staging memory and no record of the
parent's failures. A save the parent had in flight at fork() is the parent's
to write and report: in the child its future fails at once with a
RuntimeError, and nothing there (``wait_for_saves``, the checkpoint
manager's ``wait``, interpreter exit) waits for it. As with any fork of a
process that uses torch, keep torch single-threaded in the child
(``torch.set_num_threads(1)``) or prefer the "spawn"/"forkserver" methods.
"""

import atexit
import collections
import concurrent.futures
import io
import logging
import os
import pickle
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.serialization as _ts

from .staging.snapshot import Snapshot, Snapshotter
from .staging.through import Through, Waited, eligible
from .formats import torch_rules as _torch_rules
from . import knobs
from ._core import paths as _paths
from .formats.pickler import DEFAULT_PROTOCOL, pickle_with_storages
from ._core.atomic import write_file
from .torchsave.writer import write_archive

__all__ = ["async_save", "wait_for_saves", "wait_staged", "AsyncSaver", "SaveFuture", "SaveResult", "Stager", "default_saver"]

log = logging.getLogger("fastckpt")


@dataclass(frozen=True)
class SaveResult:
    """What a completed asynchronous save reports through its future."""
    path: str
    nbytes: int              # bytes of tensor data in the snapshot (0 for the manager's sharded saves)
    snapshot_seconds: float  # how long async_save blocked its caller (pickle + copies)
    write_seconds: float     # background: fastckpt.save of the snapshot, durable on return
    staged_seconds: float = 0.0  # from the call until every copy was complete (background staging: later
    #                              than the return; otherwise snapshot_seconds)
    fence_seconds: float = 0.0   # how long optimizer steps and wait_staged() waited for this save's staging
    through_bytes: int = 0       # background staging: bytes written straight from the live tensors
    fence_copied_bytes: int = 0  # background staging: bytes the fence copied (unwritten when it came)


class SaveFuture(concurrent.futures.Future):
    """A Future that knows whether anyone looked at its outcome.

    ``result()`` or ``exception()`` count as looking; a failure nobody looked
    at is raised by the next :meth:`AsyncSaver.wait` (:func:`wait_for_saves`)
    or logged at exit (it is logged when it happens in any case).
    """

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.observed = False
        self._staged = _DONE  # set once every copy of the snapshot is complete

    @property
    def staged(self) -> bool:
        """Whether the snapshot is complete: the state saved may change from here."""
        return self._staged.is_set()

    def wait_staged(self, timeout: Optional[float] = None) -> bool:
        """Wait until the snapshot is complete (at once unless the save stages
        in the background); returns False on timeout. A failed staging counts
        as complete here (nothing copies any more); the future holds its error."""
        return _fence_wait([self._staged], timeout)

    def result(self, timeout: Optional[float] = None) -> SaveResult:
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self.observed = True
        return super().exception(timeout)

    def __repr__(self) -> str:
        return f"<SaveFuture path={self.path!r} state={self._state}>"


# ---------------------------------------------------------------- staging

# AsyncSaver.stager's type, under the name this module has always exported: the
# staging layer's snapshot component (one arena per snapshot, reused).
Stager = Snapshotter


class _NoData:
    """A storage whose bytes are not written (``torch.serialization.skip_data``):
    only its size is kept, for the archive's layout; nothing is copied."""
    __slots__ = ("_n",)

    def __init__(self, n: int):
        self._n = n

    def nbytes(self) -> int:
        return self._n


class SaveSnapshot:
    """What the writer thread writes: a zip archive (``data_pkl``, the staged
    storages and ``opts``, :func:`fastckpt.torchsave.writer.write_archive`'s
    settings read in the caller's thread) or, for the legacy format, the
    whole file already serialized (``legacy``). ``copies``: the staging
    snapshot that holds the staged storages, until released."""
    __slots__ = ("data_pkl", "staged", "copies", "nbytes", "opts", "legacy", "ready", "copied", "through",
                 "stage_error", "started_at", "staged_at", "fence_s", "watch")

    def __init__(self, data_pkl, staged, copies: Optional[Snapshot], nbytes, opts=None, legacy=None):
        self.data_pkl = data_pkl
        self.staged = staged
        self.copies = copies
        self.nbytes = nbytes
        self.opts = opts or {}
        self.legacy = legacy
        self.ready = _DONE            # set once nothing reads the live tensors (background staging: later)
        self.copied = _DONE           # set once the staging thread's copies are made
        self.through: Optional[Through] = None  # sources written straight from the live tensors until the fence
        self.stage_error: Optional[BaseException] = None
        self.started_at = 0.0       # perf_counter() when the caller's snapshot began
        self.staged_at: Optional[float] = None  # perf_counter() when background staging completed
        self.fence_s = 0.0          # how long the fence (optimizer steps, wait_staged) waited for it
        self.watch: Optional[_Watch] = None  # async_write_through=2: what this save tells about the next


class _Staged:
    """A snapshot taken by :meth:`AsyncSaver.stage`, not yet handed to the writer thread."""
    __slots__ = ("fut", "snap", "snap_s")

    def __init__(self, fut: "SaveFuture", snap: SaveSnapshot, snap_s: float):
        self.fut, self.snap, self.snap_s = fut, snap, snap_s


def _take_snapshot(stager: Snapshotter, obj: Any, pickle_module: Any, pickle_protocol: int,
                   use_new_zipfile: bool, disable_byteorder_record: bool,
                   defer_over: Optional[int] = None) -> SaveSnapshot:
    """Serialize ``obj`` in the caller's thread as :func:`fastckpt.save`
    would, with torch's settings as they are in this thread now
    (``torch.serialization.skip_data()`` is per thread; the storage alignment
    and CRC setting are read now too, so the file does not depend on when
    the writer thread runs)."""
    if not use_new_zipfile:
        # torch's legacy format, by torch's own writer (as fastckpt.save does), into
        # memory now; the writer thread commits those bytes (temporary file,
        # fdatasync, rename). torch refuses skip_data here, as it does for torch.save.
        buf = io.BytesIO()
        torch.save(obj, buf, pickle_module, pickle_protocol, _use_new_zipfile_serialization=False)
        data = buf.getvalue()
        return SaveSnapshot(None, None, None, len(data), legacy=data)
    skip_data = bool(_ts._serialization_tls.skip_data)
    data_pkl, storages = pickle_with_storages(obj, pickle_module, pickle_protocol, skip_data=skip_data)
    opts = dict(alignment=_torch_rules.storage_alignment(), compute_crc32=_torch_rules.compute_crc32(),
                byteorder=not disable_byteorder_record, skip_data=skip_data)
    if skip_data:  # no storage bytes are written: none are copied (meta and fake tensors have none)
        return SaveSnapshot(data_pkl, [_NoData(s.nbytes()) for s in storages], None, 0, opts)
    copies = stager.take(storages, defer_over)
    return SaveSnapshot(data_pkl, copies.views, copies, copies.nbytes, opts)


# ---------------------------------------------------------------- background staging and its fence

# Background staging (``async_save(..., background_staging=True)``): the caller
# pickles and copies the device tensors and the host tensors of at most
# SMALL_SYNC bytes (buffers such as BatchNorm's running statistics, which a
# forward pass changes); a staging thread copies the larger host tensors while
# the loop goes on. Until then those tensors must not change in place: every
# optimizer's step() waits for them (a global step pre-hook, registered with
# the first background staging), and wait_staged() is the fence for any other
# in-place change. With the knob async_write_through, large host tensors whose
# memory sits at their record's phase in the file are not copied at all unless
# the fence comes before the writer has sent them (fastckpt.staging.through).
# Its default (2) chooses per save: a loop checkpoints periodically, so where
# the saver's last background save was written before its first fence came
# (and that fence did come: the loop went on while it was written), the next
# one writes through (no copy, no memory traffic for it); where the fence came
# first, or none came at all, the next one copies in the background (a fence
# that has to copy and to wait for writes in flight blocks the loop longer than
# a copy that runs beside the forward and backward passes). The first copies.
SMALL_SYNC = 1 << 20

_DONE = threading.Event()
_DONE.set()
_fence_lock = threading.Lock()
_staging: List[SaveSnapshot] = []     # snapshots whose background copies are not complete


class _Watch:
    """async_write_through=2: what a saver keeps of its last background save to choose the next
    (:meth:`AsyncSaver._through_pays`): times only, never the snapshot (whose views hold its arena)."""
    __slots__ = ("fence_at", "written_at", "sent_live")

    def __init__(self):
        self.fence_at: Optional[float] = None    # perf_counter() of the first fence after the call
        self.written_at: Optional[float] = None  # perf_counter() when its write was over
        self.sent_live: Optional[bool] = None    # written through: wholly sent before the fence came (or not)


_watching: List[_Watch] = []          # watches whose first fence is still to come
_hook_handle: Optional[Any] = None


def _fence_wait(events: List[threading.Event], timeout: Optional[float]) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    for ev in events:
        if not ev.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
    return True


def wait_staged(timeout: Optional[float] = None) -> bool:
    """The fence of background staging: wait until every snapshot that
    :func:`async_save` (or the checkpoint manager) is copying in the
    background is complete, so that the state saved may be changed in place.
    ``optimizer.step()`` of every torch optimizer waits this way by itself;
    call this before any other in-place change of a saved tensor (an EMA
    update, a hand-written parameter update, ``load_state_dict``). Returns at
    once when nothing stages in the background; False on timeout."""
    with _fence_lock:
        pending = list(_staging)
        if _watching:
            now = time.perf_counter()
            for w in _watching:
                w.fence_at = now
            _watching.clear()
    if not pending:
        return True
    t0 = time.perf_counter()
    for s in pending:  # what the writer has not sent from the live tensors yet is copied now
        if s.through is not None:
            s.through.fence()
    ok = _fence_wait([s.ready for s in pending], timeout)
    waited = time.perf_counter() - t0
    for s in pending:
        s.fence_s += waited
    return ok


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _staging or _watching:  # plain reads: the common case (nothing staging) costs no lock
        wait_staged()


def _write_through(snap: SaveSnapshot) -> None:
    """Hand the deferred sources that can be written straight from their live memory to a
    :class:`~fastckpt.staging.through.Through` (the staging thread copies only the others), and
    give the writer sources that send them, or wait for the staging thread's copies of the others."""
    copies = snap.copies
    items = [job for job in copies.pending if eligible(job[1], job[2])]
    if not items:
        return
    snap.through = Through(items)
    through = {i for i, _, _ in items}
    copies.pending = [job for job in copies.pending if job[0] not in through]
    staged = list(snap.staged)
    for i in through:
        staged[i] = snap.through.source(i)
    for i, _, _ in copies.pending:
        staged[i] = Waited(staged[i], i, copies.crcs, snap.copied, lambda: snap.stage_error, snap.through)
    snap.staged = staged


def _forget(watch: Optional[_Watch]) -> None:  # under _fence_lock
    if watch in _watching:
        _watching.remove(watch)


def _unwatch(watch: Optional[_Watch]) -> None:
    with _fence_lock:
        _forget(watch)


def _stage_in_background(snap: SaveSnapshot, write_through: bool = False) -> None:
    """Start the thread that completes ``snap``'s copies; the fence holds until it has, and, with
    ``write_through``, until nothing reads the live tensors any more (see :func:`_write_through`).
    ``snap.watch``, if any, gets the time of the first fence after the call."""
    global _hook_handle
    # The events first: the sources that _write_through makes wait on snap.copied, which until here
    # is the set placeholder of a snapshot copied before the call (a source made before this line
    # would send the arena's bytes before the staging thread has copied them).
    snap.ready = threading.Event()
    snap.copied = threading.Event()
    if write_through:
        _write_through(snap)
    with _fence_lock:
        if _hook_handle is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
            _hook_handle = register_optimizer_step_pre_hook(_before_optimizer_step)
        _staging.append(snap)
        if snap.watch is not None:
            _watching.append(snap.watch)

    def run() -> None:
        try:
            snap.copies.complete()
        except BaseException as e:  # noqa: BLE001 - the save's future reports it
            snap.stage_error = e
        finally:
            snap.copied.set()
            if snap.through is not None:  # the writer (or the fence) lets go of the live tensors
                snap.through.done.wait()
            snap.staged_at = time.perf_counter()
            with _fence_lock:
                if snap in _staging:
                    _staging.remove(snap)
            snap.ready.set()

    t = threading.Thread(target=run, name="fastckpt-stage", daemon=True)
    try:
        t.start()
    except BaseException:
        with _fence_lock:
            _staging.remove(snap)
        snap.copied.set()
        snap.ready.set()
        raise


# ---------------------------------------------------------------- the saver

def fail_inherited(fut: concurrent.futures.Future) -> None:
    """In a child made by ``fork()``: fail (if not done) the future of a save
    the parent had in flight, which no thread of this process will complete.
    Its lock is made anew (a thread of the parent may have held it) and its
    done-callbacks are not run (they would take locks of the parent's state;
    their owners reset themselves in their own fork hooks)."""
    fut._condition = threading.Condition()  # type: ignore[attr-defined]
    if isinstance(fut, SaveFuture):
        fut.observed = True  # the parent reports it; the child must not raise it again
    if fut.done():
        return
    fut._done_callbacks = []  # type: ignore[attr-defined]
    path = getattr(fut, "path", "?")
    try:
        concurrent.futures.Future.set_exception(fut, RuntimeError(
            f"fastckpt: the asynchronous save of {path!r} was in flight when this process was forked; "
            "the parent process writes it, this child cannot wait for it"))
    except concurrent.futures.InvalidStateError:  # pragma: no cover - cancelled meanwhile
        pass


_savers: "weakref.WeakSet[AsyncSaver]" = weakref.WeakSet()


class AsyncSaver:
    """Background checkpoint writer: one writer thread (saves complete in call
    order, so the last save of a path wins), a :class:`~fastckpt.staging.snapshot.Snapshotter`, the in-flight
    limit and the record of failures nobody looked at.

    Most code uses the process-wide one through :func:`async_save`. One made
    for a component of its own is stopped with :meth:`close` (or used as a
    context manager).
    """

    def __init__(self, max_in_flight: Optional[int] = None):
        self._max_in_flight = max_in_flight
        self.stager = Snapshotter()
        self._cv = threading.Condition()
        self._jobs: "collections.deque[tuple]" = collections.deque()  # submitted, in call order
        self._thread: Optional[_WriterThread] = None  # alive while _jobs has work (see _work)
        self._in_flight: List[SaveFuture] = []
        self._failed: List[SaveFuture] = []
        self._worker_ident: Optional[int] = None
        self._closed = False
        # async_write_through=2: the watch of this saver's last background save (see _through_pays);
        # None: none yet (the first copies)
        self._watched: Optional[_Watch] = None
        _savers.add(self)

    @property
    def max_in_flight(self) -> int:
        n = self._max_in_flight if self._max_in_flight is not None else knobs.get("async_max_in_flight")
        return max(1, int(n))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: this saver takes no more saves."""
        return self._closed

    def pending(self) -> List[SaveFuture]:
        """Saves snapshotted and not yet finished, oldest first."""
        with self._cv:
            return list(self._in_flight)

    # -- errors nobody looked at
    def note_failure(self, fut: SaveFuture, exc: Optional[BaseException] = None) -> None:
        """Record a failed save (this saver's, or one made elsewhere: the
        checkpoint manager's sharded saves): log it at ERROR level now, with its
        path and cause, and keep it so that, unobserved, :meth:`wait` raises it
        and interpreter exit logs it again. ``exc`` defaults to the future's."""
        if exc is None:
            exc = concurrent.futures.Future.exception(fut, timeout=0)
        log.error("fastckpt: the asynchronous save of %r failed: %s: %s (that checkpoint was not written; "
                  "later saves go on)", fut.path, type(exc).__name__, exc,
                  exc_info=(type(exc), exc, exc.__traceback__))
        with self._cv:
            self._failed.append(fut)

    def raise_unobserved(self) -> None:
        """Raise the first failure of an earlier save whose future nobody
        checked (with a note saying which save it was); forget the others."""
        with self._cv:
            failed = [f for f in self._failed if not f.observed]
            self._failed.clear()
        if not failed:
            return
        for f in failed:
            f.observed = True
        exc = concurrent.futures.Future.exception(failed[0])
        note = (f"fastckpt: raised here because the asynchronous save of {failed[0].path!r} failed "
                "and its future was never checked")
        if len(failed) > 1:
            note += f" ({len(failed) - 1} more failed: {', '.join(repr(f.path) for f in failed[1:])})"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:  # pragma: no cover - Python < 3.11
            log.error("%s", note)
        raise exc

    # -- saving
    def save(self, obj: Any, f, pickle_module: Any = pickle, pickle_protocol: int = DEFAULT_PROTOCOL,
             _use_new_zipfile_serialization: bool = True, _disable_byteorder_record: bool = False,
             *, after: Optional[Callable[[], None]] = None,
             background_staging: Optional[bool] = None) -> SaveFuture:
        """Snapshot ``obj`` and write it to ``f`` in the background; see :func:`async_save`.

        ``after``, if given, runs on the writer thread once the file is
        committed (a failure there fails the future); the checkpoint manager
        uses it to move its ``latest`` pointer.
        """
        return self.submit(self.stage(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization,
                                      _disable_byteorder_record, background_staging=background_staging),
                           after=after)

    def stage(self, obj: Any, f, pickle_module: Any = pickle, pickle_protocol: int = DEFAULT_PROTOCOL,
              _use_new_zipfile_serialization: bool = True, _disable_byteorder_record: bool = False,
              *, zip_only: bool = False, background_staging: Optional[bool] = None) -> "_Staged":
        """The first half of :meth:`save`: take an in-flight slot (waiting for
        the oldest save if the limit is reached) and snapshot ``obj`` in this
        thread. Nothing is written until :meth:`submit`; :meth:`drop` gives
        the slot and the staging memory back instead. With ``zip_only`` (a
        snapshot for a collective write) the legacy format and
        ``torch.serialization.skip_data()`` are refused (ValueError) before
        anything is staged. Raises what the snapshot raised (the slot is
        given back). ``background_staging`` (default: the knob
        ``async_background_staging``): see :func:`async_save`."""
        if not isinstance(f, (str, os.PathLike)):
            raise TypeError("fastckpt.async_save writes to a path (str or os.PathLike), "
                            f"not {type(f).__name__}")
        if threading.get_ident() == self._worker_ident:
            raise RuntimeError("fastckpt.async_save called from the save thread itself (it would wait for itself)")
        _ts._check_dill_version(pickle_module)
        path = os.fspath(f)
        if zip_only and (not _use_new_zipfile_serialization or _ts._serialization_tls.skip_data):
            raise ValueError(f"cannot save {path!r} collectively in the background: the legacy format and "
                             "torch.serialization.skip_data() are not supported by collective saves")
        # An earlier failure is not raised here: it was logged when it happened and
        # wait() raises it; this save goes ahead.
        limit = self.max_in_flight
        with self._cv:
            while not self._closed and len(self._in_flight) >= limit:
                self._cv.wait()
            if self._closed:
                raise RuntimeError(f"fastckpt: cannot save {path!r}: this AsyncSaver is closed "
                                   "(make a new AsyncSaver for further saves)")
            fut = SaveFuture(path)
            self._in_flight.append(fut)  # the slot is ours from here
        if background_staging is None:
            background_staging = bool(knobs.get("async_background_staging"))
        snap: Optional[SaveSnapshot] = None
        try:
            t0 = time.perf_counter()
            # The live storages are not kept alive by the background save: only copies (and,
            # while background staging copies them, the sources it has still to copy).
            snap = _take_snapshot(self.stager, obj, pickle_module, pickle_protocol,
                                  _use_new_zipfile_serialization, _disable_byteorder_record,
                                  SMALL_SYNC if background_staging else None)
            snap.started_at = t0
            if snap.copies is not None and snap.copies.pending:
                # A collective write (zip_only) writes the arena copies with a writer of its own.
                mode = 0 if zip_only else knobs.get("async_write_through")
                through = mode == 1 or (mode == 2 and self._through_pays())
                if mode == 2:
                    snap.watch = self._watched = _Watch()
                share = knobs.get("async_caller_copy")
                if share and not through:  # a share of the copy here, the rest beside the loop
                    snap.copies.copy_share(share / 100)
                _stage_in_background(snap, write_through=through)
                fut._staged = snap.ready
        except BaseException:
            if snap is not None:
                _unwatch(snap.watch)
            if snap is not None and snap.copies is not None:  # the staging thread did not start
                snap.copies.release(keep=None)
            self._done(fut)
            raise
        return _Staged(fut, snap, time.perf_counter() - t0)

    def submit(self, staged: "_Staged", *, after: Optional[Callable[[], None]] = None,
               write: Optional[Callable[[str, "SaveSnapshot"], None]] = None, cancellable: bool = True) -> SaveFuture:
        """The second half of :meth:`save`: the writer thread writes the
        snapshot ``staged`` (with ``write(path, snapshot)`` if given, else as
        :func:`fastckpt.save` would), then runs ``after``. Returns its future,
        which ``cancellable=False`` marks running at once (``cancel()`` then
        returns False: a collective write cannot be called off on one rank)."""
        if not cancellable:
            staged.fut.set_running_or_notify_cancel()
        job = (staged.fut, staged.snap, staged.snap_s, after, write)
        try:
            with self._cv:
                self._jobs.append(job)
                if self._thread is None:
                    thread = _WriterThread(self)
                    try:
                        thread.start()
                    except BaseException:
                        self._jobs.remove(job)
                        raise
                    self._thread = thread
        except BaseException:  # e.g. no thread can start (interpreter shutdown): staged but not submitted
            self.drop(staged)
            raise
        return staged.fut

    def _work(self) -> None:
        """The writer thread's body: write the submitted snapshots in call
        order; end (and forget this thread, under the lock that submit takes
        to start one) as soon as none is left."""
        self._worker_ident = threading.get_ident()
        me = threading.current_thread()
        try:
            while True:
                with self._cv:
                    if not self._jobs:
                        if self._thread is me:
                            self._thread = None
                        return
                    job = self._jobs.popleft()
                self._run(*job)
        except BaseException:  # pragma: no cover - _run delivers every failure through its future
            with self._cv:
                if self._thread is me:
                    self._thread = None
                if self._jobs:  # never leave submitted saves without a thread
                    self._thread = _WriterThread(self)
                    self._thread.start()
            raise

    def drop(self, staged: "_Staged") -> None:
        """A snapshot of :meth:`stage` that will not be written: its staging
        memory and in-flight slot are given back, its future is cancelled
        (once a background staging of it has stopped copying into that memory)."""
        _unwatch(staged.snap.watch)
        if staged.snap.through is not None:  # no writer will send from the live tensors
            staged.snap.through.finish()
        staged.snap.ready.wait()
        if staged.snap.copies is not None:
            staged.snap.copies.release(keep=self.max_in_flight)
        staged.snap.staged = staged.snap.data_pkl = staged.snap.legacy = None
        staged.fut.observed = True
        if not staged.fut.cancel():  # already marked running (submit with cancellable=False)
            concurrent.futures.Future.set_exception(staged.fut, RuntimeError(
                f"fastckpt: the asynchronous save of {staged.fut.path!r} was not written"))
        self._done(staged.fut)

    def _run(self, fut: SaveFuture, snap: SaveSnapshot, snap_s: float, after, write=None) -> None:
        try:
            if not fut.running() and not fut.set_running_or_notify_cancel():
                return  # cancelled before it started: nothing written
            try:
                if snap.through is None:  # background staging: every copy complete before a byte is written
                    snap.ready.wait()     # (else each source waits for its own copy, or sends the live bytes)
                if snap.stage_error is not None:
                    raise snap.stage_error
                t0 = time.perf_counter()
                if write is not None:
                    write(fut.path, snap)
                elif snap.legacy is not None:
                    write_file(fut.path, snap.legacy)
                else:
                    copies = snap.copies  # None for skip_data: nothing staged, no CRCs
                    write_archive(fut.path, snap.data_pkl, snap.staged, borrowed=copies is not None,
                                  crcs=copies.crcs if copies is not None else None, **snap.opts)
                snap.staged = snap.legacy = None
                through = snap.through
                if through is not None:  # a fence may still be copying into the arena: wait for it
                    through.finish()
                    snap.ready.wait()
                if snap.copies is not None:  # none for skip_data and the legacy format
                    snap.copies.release(keep=self.max_in_flight)
                if after is not None:
                    after()
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                self.note_failure(fut, e)
                fut.set_exception(e)
                return
            self._learn(snap, through)
            staged_s = snap_s if snap.staged_at is None else snap.staged_at - snap.started_at
            fut.set_result(SaveResult(fut.path, snap.nbytes, snap_s, time.perf_counter() - t0, staged_s,
                                      snap.fence_s, through.live_bytes if through else 0,
                                      through.copied_bytes if through else 0))
        finally:
            if snap.watch is not None and snap.watch.written_at is None:  # not written (failed, cancelled):
                _unwatch(snap.watch)                                      # no fence needs to stamp it
            if snap.through is not None:  # written, failed or cancelled: nothing more is sent from live memory
                snap.through.finish()
            snap.ready.wait()  # never give the arena back while a staging thread (or the fence) copies into it
            snap.staged = snap.data_pkl = snap.legacy = None  # a kept failure's traceback must not pin the snapshot
            if snap.copies is not None:
                snap.copies.release(keep=self.max_in_flight)
            self._done(fut)

    def _learn(self, snap: SaveSnapshot, through: Optional[Through]) -> None:
        """async_write_through=2: `snap` is written; note when, and whether it was sent from the live
        tensors before the fence came. It stays watched until its first fence (if that has not come
        yet): :meth:`_through_pays` reads both when this saver's next background save is staged."""
        w = snap.watch
        with _fence_lock:
            if w is None or w is not self._watched:
                return
            w.written_at = time.perf_counter()
            w.sent_live = None if through is None else not through.fenced

    def _through_pays(self) -> bool:
        """async_write_through=2: whether this saver's next background save writes through: its last
        one was written before its first fence, and that fence came (the loop went on meanwhile). A save
        whose fence came first, one that failed or is still being written, or one that no fence
        followed yet (saves back to back, or no optimizer step in between) says copy."""
        with _fence_lock:
            last, self._watched = self._watched, None
            if last is None:
                return False
            _forget(last)
            if last.written_at is None or last.fence_at is None:
                return False
            if last.sent_live is not None:  # written through: the fence found every byte sent and drained
                return last.sent_live
            return last.written_at <= last.fence_at  # copied: its write (its sync included) ended first

    def _done(self, fut: SaveFuture) -> None:
        with self._cv:
            if fut in self._in_flight:
                self._in_flight.remove(fut)
            self._cv.notify_all()

    def wait(self, timeout: Optional[float] = None, raise_errors: bool = True) -> bool:
        """Wait until every save started so far is finished. Returns False on
        timeout. With ``raise_errors``, then raises the first failure nobody
        looked at (see :meth:`raise_unobserved`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        if raise_errors:
            self.raise_unobserved()
        return True

    def close(self, raise_errors: bool = True) -> None:
        """Finish every pending save, then stop this saver: its writer thread
        is shut down and joined (no thread of it is left), its free staging
        memory dropped, and it is no longer waited for at interpreter exit or
        renewed in a forked child. A later :meth:`save` or :meth:`stage`
        raises RuntimeError; make a new AsyncSaver instead. Calling close
        again does nothing (but raise a failure not raised yet).

        With ``raise_errors``, once the thread is gone, raises the first
        failure nobody looked at, as :meth:`wait` does. A snapshot staged
        before close but not yet submitted keeps close waiting until it is
        submitted or dropped.

        Raises:
            RuntimeError: called from the writer thread itself (it would wait
                for itself).
        """
        if threading.get_ident() == self._worker_ident:
            raise RuntimeError("fastckpt: AsyncSaver.close() called from its own save thread "
                               "(it would wait for itself)")
        with self._cv:
            self._closed = True   # stage() takes no new slot from here
            self._cv.notify_all()  # a stage() waiting for a slot wakes up and refuses
        try:
            self.wait(raise_errors=False)
        finally:
            self._join_writer()
            self.stager.clear()
            _savers.discard(self)
        if raise_errors:
            self.raise_unobserved()

    def _join_writer(self) -> None:
        """Join the writer thread once it has nothing left to write (a save
        submitted meanwhile is written first: the thread takes it)."""
        while True:
            with self._cv:
                thread = self._thread
            if thread is None or thread is threading.current_thread():
                return
            thread.join()
            with self._cv:
                if self._thread is thread:  # it died without clearing itself (cannot happen; never spin)
                    self._thread = None

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(raise_errors=exc[0] is None)

    def _after_fork_in_child(self) -> None:
        """In a child made by ``fork()``: no writer thread (the parent's
        does not exist here; the first save starts one), new locks, empty staging and no
        record of the parent's failures. The saves the parent had in flight
        are the parent's to write and report: in the child their futures fail
        at once with a RuntimeError (nothing waits for them, at exit either),
        and they hold no in-flight slot."""
        inherited = self._in_flight
        self._cv = threading.Condition()
        self._in_flight = []
        self._failed = []
        self._worker_ident = None
        self.stager = Snapshotter()
        self._jobs = collections.deque()  # the parent's, written by the parent
        self._thread = None
        for fut in inherited:
            fail_inherited(fut)

    def _at_exit(self) -> None:
        self.wait(raise_errors=False)
        with self._cv:
            failed = [f for f in self._failed if not f.observed]
            self._failed.clear()
        for f in failed:
            exc = concurrent.futures.Future.exception(f)
            log.error("fastckpt: the asynchronous save of %r FAILED and nobody checked its future; "
                      "that checkpoint does not exist: %s: %s", f.path, type(exc).__name__, exc,
                      exc_info=(type(exc), exc, exc.__traceback__))


def _yield_cpu(nice: int) -> None:
    """Make the calling thread at least `nice` nice (Linux: a thread's own scheduling priority),
    so that a background write takes the CPU the training loop leaves; never raises."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > now:
            os.setpriority(os.PRIO_PROCESS, tid, min(nice, 19))
    except OSError as e:  # e.g. a seccomp profile that refuses it: the write goes on at its priority
        log.debug("fastckpt: could not lower the save thread's priority: %s", e)


class _WriterThread(threading.Thread):
    """A saver's writer thread (see the module docstring): named
    ``fastckpt-save``, a daemon, gone once its saver has nothing to write."""

    def __init__(self, saver: AsyncSaver):
        super().__init__(name="fastckpt-save", daemon=True)
        self._saver = saver

    def run(self) -> None:
        _yield_cpu(knobs.get("async_writer_nice"))
        self._saver._work()

    def stop(self) -> None:
        """Wait for the saver's pending saves, then for this thread to end
        (failures stay the saver's to raise)."""
        if threading.current_thread() is self:
            raise RuntimeError("fastckpt: the save thread cannot stop itself")
        self._saver.wait(raise_errors=False)
        self.join()


_default: Optional[AsyncSaver] = None
_default_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # os.fork() (or multiprocessing's "fork") copies only the calling thread:
    # every saver's writer thread is gone in the child, and a lock another
    # thread held at fork() stays held forever. A new lock here, and every
    # saver made fit for the child (AsyncSaver._after_fork_in_child).
    global _default_lock, _fence_lock
    _default_lock = threading.Lock()
    _fence_lock = threading.Lock()
    for snap in _staging:  # the parent's staging threads: not in this child, which cannot wait for them
        snap.ready.set()
    _staging.clear()
    for saver in list(_savers):
        saver._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def default_saver() -> AsyncSaver:
    """The process-wide saver behind :func:`async_save` (and the checkpoint manager)."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = AsyncSaver()
        return _default


def async_save(obj: Any, f, pickle_module: Any = pickle, pickle_protocol: int = DEFAULT_PROTOCOL,
               _use_new_zipfile_serialization: bool = True, _disable_byteorder_record: bool = False,
               *, background_staging: Optional[bool] = None) -> SaveFuture:
    """Save like :func:`fastckpt.save`, in the background.

    Returns once ``obj`` is pickled and every tensor's data is copied into
    host staging memory (page-locked for CUDA tensors; device-to-host copies
    are issued on each device's current stream and waited for), so the caller
    may modify its tensors right away. The file is then written by a
    background thread with :func:`fastckpt.save`: temporary file, O_DIRECT
    writes, fdatasync, rename, directory fsync.

    At most ``fastckpt.knobs.get("async_max_in_flight")`` saves (default 1,
    environment ``FASTCKPT_ASYNC_MAX_IN_FLIGHT``) are in flight; a further
    call first waits for the oldest. Saves complete in call order.

    Args:
        obj: what :func:`fastckpt.save` accepts.
        f: a path (str or os.PathLike).
        pickle_module, pickle_protocol: as for torch.save.
        _use_new_zipfile_serialization: as for torch.save and
            :func:`fastckpt.save`. ``False`` writes torch's legacy format with
            torch's own writer: serialized into memory in the caller's thread
            (that is the snapshot; it takes the file's size in host memory),
            then committed in the background like every save (temporary file,
            fdatasync, rename, directory fsync).
        _disable_byteorder_record: as for torch.save: no ``byteorder`` record.
        background_staging: True: return once ``obj`` is pickled and its
            device tensors and small host tensors (at most 1 MiB each) are
            copied; a staging thread copies the larger host tensors while the
            caller goes on, then the file is written. Until those copies are
            complete (``fut.staged``, ``fut.wait_staged()``) the saved tensors
            must not change in place: every torch optimizer's ``step()``
            waits for them by itself (a global optimizer step pre-hook), and
            :func:`wait_staged` is the fence before any other in-place change
            (an EMA update, ``load_state_dict``). The loop's forward and
            backward passes overlap the copy. Default: the knob
            ``async_background_staging`` (0: copy everything before returning).

    torch's settings are honoured as :func:`fastckpt.save` honours them, as
    they are in the *calling* thread when ``async_save`` is called:
    ``torch.serialization.skip_data()`` (a per-thread setting; no storage's
    bytes are copied or written, so meta and fake tensors can be saved; the
    legacy format refuses it, as torch.save does) and
    ``torch.utils.serialization.config.save`` (``storage_alignment``,
    ``compute_crc32``). The file is the one ``fastckpt.save`` would write.

    Returns:
        A :class:`SaveFuture`; its result is a :class:`SaveResult` once the
        file is durable under its final name (with the staging and fence
        times of a background staging).

    Raises:
        Pickling errors (``obj`` cannot be saved), raised before anything is
        staged. I/O errors of this save are raised by its future (and logged
        at ERROR level when they happen). The failure of an *earlier* save is
        never raised here, and never stops this save: :func:`wait_for_saves`
        raises it if nobody looked at its future.

    Example:
        >>> fut = fastckpt.async_save({"model": model.state_dict(), "step": step}, "ckpt.pt")
        >>> opt.step()            # safe: the snapshot is taken
        >>> fut.result()          # or fastckpt.wait_for_saves() before exiting
    """
    if isinstance(f, (str, os.PathLike)): _paths.check_save_target(f)  # noqa: E701  (before anything is staged)
    return default_saver().save(obj, f, pickle_module, pickle_protocol,
                                _use_new_zipfile_serialization, _disable_byteorder_record,
                                background_staging=background_staging)


def wait_for_saves(timeout: Optional[float] = None) -> bool:
    """Wait for every pending :func:`async_save` (and checkpoint manager save);
    then raise the first failure whose future nobody looked at (with a note
    naming it and any others; each is raised once). Returns False on timeout.

    This is where a failed background save that nobody checked is raised:
    ``async_save`` itself never raises an earlier save's failure (the next
    save is written regardless), and every failure is logged at ERROR level
    on the ``fastckpt`` logger when it happens."""
    return default_saver().wait(timeout)


@atexit.register
def _wait_at_exit() -> None:
    for saver in list(_savers):
        try:
            saver._at_exit()
        except Exception:  # noqa: BLE001 - never mask other exit handlers
            log.exception("fastckpt: error while waiting for asynchronous saves at exit")
