"""fastckpt.CheckpointManager: a directory of step checkpoints for a training loop.

Layout of ``directory``::

    step_00000100.pt     complete checkpoints (replicated mode: one fastckpt.save file each)
    step_00000200/       ... or, in sharded mode, one DCP directory each
    latest               "step_00000200.pt\\n": the last checkpoint saved, replaced atomically
    .fastckpt-tmp.<key>.<pid>.<host>.<start>.<n>.<r>       a save in progress (or left by a crash)
    .fastckpt-tmp.<key>.<pid>.<host>.<start>.<n>.<r>.dcp   ... of a sharded checkpoint (a directory)
    abandoned/step_00000300.pt   newer checkpoints set aside by a rollback (see below)

A checkpoint appears under its final name only when it is complete: single
files are committed by the engine (temporary file, fdatasync, rename,
directory fsync); sharded directories are written under a temporary name and
renamed by rank 0 once every rank's data and DCP's ``.metadata`` are durable.
``latest`` is then replaced the same way, and retention deletes older
checkpoints. Anything named ``*.fastckpt-tmp.*`` is never a checkpoint (``<key>``
stands for the target's name without spelling it, so that no tool scanning for
checkpoint names takes a temporary for one);
leftovers of crashed saves are removed only by the host that wrote them
(:meth:`CheckpointManager.clean_temporaries`).

``latest`` is authoritative: a save is committed when ``latest`` names it,
and :meth:`CheckpointManager.load_latest` loads what ``latest`` names (or,
if that one is damaged, an older one), never a checkpoint of a higher step.

Rollback: saving a step lower than existing checkpoints (say 5 after 10, 20,
30, having gone back to an earlier state) starts a new branch. Once ``latest``
names step 5, the checkpoints of higher steps (10, 20, 30) are an *abandoned
branch*: they are never loaded, and rank 0 moves them into the subdirectory
``abandoned/`` (same filesystem: a rename; a name already there gets a
``.1``, ``.2``... suffix) with a warning. Retention neither counts nor
deletes them there; delete them (or move one back, then point ``latest`` at
it) yourself. A crash before they are moved leaves them in place, still
ignored; the next commit moves them. The same holds for a checkpoint of a
higher step left by a save that failed or crashed after its rename but
before ``latest`` moved: it was never committed.

Distributed rules (when ``torch.distributed`` is initialized; every rank must
call every method, in the same order):

* replicated mode (DDP; default): every rank writes a share of each
  checkpoint file and every rank reads a share of it on load, the shares
  exchanged over the group (``fastckpt.save/load(..., group=...)``, on a gloo
  group of the manager's own); the file is the one a single-process save
  writes. Any rank's failure raises on every rank, so that no rank hangs or
  runs ahead. With ``collective=False``: rank 0 writes, all ranks wait for it
  (a barrier before and after that also tells every rank whether rank 0
  failed), and every rank reads the whole file. :meth:`async_save`: every
  rank snapshots and writes its share in the background, on a gloo group for
  background saves (``collective=False``: rank 0 snapshots, writes alone).
* sharded mode (``sharded=True``; FSDP, DTensor): every rank writes its shards
  with ``torch.distributed.checkpoint``; all ranks load in place.

The directory must be visible to every rank that reads it (one node, or a
shared filesystem).

Where the code is: this module is the public face and decides which rank does what, in
which order; ``policy.py`` holds the policy (names, ``latest``, rollback, retention, which
failures are damage), ``ranks.py`` the coordination (process groups, failure agreement, DCP
collectives, the manager's own gloo groups), ``asyncsave.py`` the collective asynchronous
save, ``remote.py`` and ``memory.py`` the wiring of the remote and memory tiers.
"""

import concurrent.futures
import logging
import os
import shutil
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, List, NamedTuple, Optional, Set, Union

from .asyncsave import async_save as _collective_async_save
from .ranks import Ranks, failure_types, register_manager
from .policy import StepDirectory, judge_load, load_report
from .._core.tempnames import TMP_MARK
from . import remote as _remote_tier
from .remote import candidates as _remote_candidates
from ..saver import AsyncSaver, SaveFuture, fail_inherited, default_saver
from ..serialization import save as _save
from ..memory import MemoryTier
from . import memory as _memory_tier

__all__ = ["CheckpointManager", "Restored", "TMP_MARK"]

log = logging.getLogger("fastckpt")


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.load_latest` found."""
    step: int
    state: Any
    path: str


def _done_future(result=None) -> concurrent.futures.Future:
    (f := concurrent.futures.Future()).set_result(result)
    return f


class CheckpointManager:
    """Save, keep and restore step checkpoints in one directory.

    Args:
        directory: where checkpoints live (created if missing).
        keep_last: how many complete checkpoints to keep (the newest by step;
            ``None`` keeps all). The one ``latest`` names and any being written
            are never deleted.
        sharded: every rank writes its own shards through
            ``torch.distributed.checkpoint`` (a directory per step) instead of
            rank 0 writing one file.
        process_group: the group whose ranks share this directory (default:
            the world, when torch.distributed is initialized).
        collective: replicated mode with more than one rank: every rank
            writes and reads its share of each checkpoint (default); False:
            rank 0 writes it whole and every rank reads it whole.
        verify: check every storage's CRC-32 when loading (replicated mode).
        clean: delete leftover temporary files/directories of crashed saves
            now (see :meth:`clean_temporaries`).
        saver: the :class:`~fastckpt.saver.AsyncSaver` for
            :meth:`async_save` (default: the process-wide one, which
            :func:`fastckpt.wait_for_saves` also waits for).
        replicate_to: an fsspec URL (``s3://bucket/run``, ``gs://...``,
            ``file:///shared/...``): every committed step is uploaded there in
            the background, its manifest last (every rank its part in sharded
            and collective modes, else rank 0), and :meth:`load_latest` restores
            from it when no local checkpoint is left
            (fastckpt/_manager_remote.py). The store is checked now.
        storage_options: passed to fsspec for ``replicate_to``.
        keep_last_remote: complete remote steps to keep (None: all).
        memory: a :class:`fastckpt.MemoryTier`: :meth:`snapshot` into host memory (replicated
            to peer nodes); :meth:`load_latest` restores from there first (docs/guide/memory.md).

    Example:
        >>> mgr = fastckpt.CheckpointManager("ckpt", keep_last=3)
        >>> restored = mgr.load_latest(map_location="cpu")
        >>> start = 0 if restored is None else restored.step + 1
        >>> for step in range(start, steps):
        ...     train_step()
        ...     if step % 100 == 0:
        ...         mgr.async_save(step, {"model": model.module.state_dict(), "optim": opt.state_dict()})
        >>> mgr.wait()
    """

    def __init__(self, directory: Union[str, os.PathLike], keep_last: Optional[int] = 3, *, sharded: bool = False,
                 process_group: Any = None, verify: bool = True, clean: bool = True,
                 saver: Optional[AsyncSaver] = None, collective: bool = True, replicate_to: Optional[str] = None,
                 storage_options: Optional[dict] = None, keep_last_remote: Optional[int] = None,
                 memory: Optional[MemoryTier] = None):
        self._dir = StepDirectory(directory, keep_last, sharded)  # the policy (raises on a bad keep_last)
        self.directory = self._dir.path
        self.keep_last = keep_last
        self.sharded = sharded
        self.verify = verify
        self._saver = saver
        self._lock = threading.Lock()
        self._writing: Set[str] = set()          # final names of saves in flight
        self._futures: List[concurrent.futures.Future] = []  # this manager's asynchronous saves
        self._ranks = Ranks(process_group, str(self.directory))  # the coordination
        self.rank, self.world_size = self._ranks.rank, self._ranks.world_size
        self.collective = bool(collective) and not sharded and self.world_size > 1
        self._remote_url, self._remote = replicate_to, None  # the remote tier (fastckpt/_manager_remote.py)
        err, prefix = None, None
        if self.rank == 0:
            try:
                self._dir.prepare(clean=False)
                if clean:
                    self.clean_temporaries()
                prefix = _remote_tier.open_rank0(self, replicate_to, storage_options, keep_last_remote)
            except failure_types() as e:  # noqa: BLE001 - every rank learns of it
                err = e
        prefix = self._ranks.agree(err, "preparing the checkpoint directory", prefix)
        _remote_tier.open_others(self, replicate_to, storage_options, keep_last_remote, prefix)  # collective
        if sharded:
            self._ranks.open_async_group()
        self._memory = _memory_tier.open_tier(self, memory) if memory is not None else None  # collective
        register_manager(self)

    def _after_fork(self) -> None:
        """In a child made by ``fork()`` (only the forking thread survives; see
        fastckpt/_manager_dist.py): a new lock (another thread may have held
        it at fork()); the parent's saves in flight are not the child's: their
        futures fail at once (see :func:`fastckpt.saver.fail_inherited`)
        and the names they were writing are not the child's to protect, so the
        child's ``wait``, ``clean_temporaries`` and exit never wait for them."""
        self._lock = threading.Lock()
        self._remote = None  # the parent's uploads are not the child's (its replicator's thread is gone)
        for f in self._futures:
            fail_inherited(f)
        self._futures = []
        self._writing = set()

    def _busy(self) -> Set[str]:
        """The final names of saves in flight and steps to upload (rollback and retention leave them alone)."""
        with self._lock:
            names = set(self._writing)
        return names | (self._remote.busy() if self._remote is not None else set())

    # ------------------------------------------------------------ names
    def name_for(self, step: int) -> str:
        return self._dir.name_for(step)

    def path_for(self, step: int) -> Path:
        return self.directory / self.name_for(step)

    def steps(self) -> List[int]:
        """Steps of the complete checkpoints in the directory, oldest first."""
        return [s for s, _ in self._dir.complete()]

    def latest_name(self) -> Optional[str]:
        """The checkpoint the ``latest`` pointer names, or None."""
        return self._dir.latest_name(stacklevel=3)

    # ------------------------------------------------------------ saving
    @property
    def saver(self) -> AsyncSaver:
        return self._saver if self._saver is not None else default_saver()

    def _check_step(self, step: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int (got {step!r})")

    def _begin(self, step: int, name: str, *, wait_previous: bool, tmp_dir: bool = False) -> Optional[Path]:
        """The barrier before a save. Every rank (with ``wait_previous``) waits
        for its earlier asynchronous saves of this manager, so that ``latest``
        moves in order; rank 0 makes the temporary directory of a sharded save.
        Every rank learns of any rank's failure. Returns that directory.

        An earlier asynchronous save's failure is not raised here (it was
        logged when it happened; :meth:`wait` raises it): this save goes ahead."""
        err, tmp_name = None, None
        try:
            if wait_previous:
                self.wait_local()
            if tmp_dir and self.rank == 0:
                tmp_name = self._dir.new_temp_dir(name)
        except failure_types() as e:  # noqa: BLE001
            err = e
        try:
            tmp_name = self._ranks.agree(err, f"an earlier checkpoint save (before step {step})", tmp_name)
        except BaseException:
            if tmp_name is not None and self.rank == 0:
                shutil.rmtree(self.directory / tmp_name, ignore_errors=True)
            raise
        if tmp_name is None:
            return None
        if self.rank == 0:
            with self._lock:
                self._writing.add(name)
        return self.directory / tmp_name

    def save(self, step: int, state: Any) -> Optional[Path]:
        """Save ``state`` as the checkpoint of ``step``, wait until it is durable,
        point ``latest`` at it and apply retention. Collective.

        Returns the checkpoint's path (in replicated mode with
        ``collective=False``, None on ranks other than 0).

        Raises:
            OSError etc.: this rank's write failed; ``latest`` still names the
                previous checkpoint and no temporary file is left.
            RuntimeError: another rank failed (the message says which and why).

        The failure of an earlier :meth:`async_save` is not raised here and
        does not stop this save: it is logged at ERROR level when it happens
        and raised by :meth:`wait` if nobody looked at its future.
        """
        self._check_step(step)
        name = self.name_for(step)
        if self.sharded:
            return self._save_sharded(step, name, state)
        self._begin(step, name, wait_previous=True)
        err = None
        path = self.directory / name
        writes = self.collective or self.rank == 0  # collective: a share each, committed by rank 0
        if writes:
            with self._lock:
                self._writing.add(name)
            try:
                _memory_tier.write_step(self, step, state, path, _save)  # from the snapshot of `step` if any
                if self.rank == 0:
                    self._commit(name)  # `latest` moves once the file is committed
            except failure_types() as e:  # noqa: BLE001
                err = e
            finally:
                with self._lock:
                    self._writing.discard(name)
        self._ranks.agree(err, f"saving the checkpoint of step {step}")
        return path if writes else None

    def snapshot(self, step: int, state: Any) -> None:
        """Copy ``state`` into host memory as the memory tier's snapshot of ``step`` and
        return (``state`` may change then); its CRC-32, commit and replicas follow in the
        background (fastckpt/manager/memory.py). Not collective, but every rank snapshots
        the same steps in the same order. Raises ValueError without a ``memory=`` tier;
        OSError: ENOMEM at the first snapshot (too little memory: the message gives the
        figures), or the memory directory's write error."""
        self._check_step(step)
        _memory_tier.snapshot(self, step, state)

    def async_save(self, step: int, state: Any, *, background_staging: Optional[bool] = None) -> concurrent.futures.Future:
        """Like :meth:`save`, but returns once ``state`` is snapshotted into
        host memory and writes it in the background; ``latest`` moves and
        retention runs when the write is durable. Collective: on return every
        rank may change its state.

        Replicated, collective (several ranks): every rank waits for its
        previous background save (one in flight per manager), snapshots
        ``state`` like :func:`fastckpt.async_save` and its writer thread
        writes its share (``fastckpt.save(..., group=...)`` on the manager's
        gloo group for background saves, never the training loop's); rank 0
        moves ``latest`` after the commit. ``collective=False``: rank 0
        snapshots and writes alone. Sharded: every rank stages its shards
        (``dcp.async_save``, FastWriter's reused buffers) after waiting for its
        previous save, DCP's collectives on that group for background saves.
        ``background_staging`` (replicated mode): as for :func:`fastckpt.async_save`.

        Returns:
            The future (a SaveResult once the checkpoint is durable and
            ``latest`` names it); collective, sharded: every rank's fails if
            any rank fails (path and cause; ``latest`` unmoved);
            ``collective=False``: None on ranks other than 0. :meth:`wait`
            (collective) waits for every save and reports failures on all ranks.

        Raises:
            A snapshot error (e.g. unpicklable state), on every rank. The
            failure of an earlier asynchronous save is never raised here and
            never stops this save: it is logged at ERROR level (on the rank
            that failed) when it happens, and :meth:`wait` raises it on every
            rank if nobody looked at its future.
        """
        self._check_step(step)
        name = self.name_for(step)
        if self.sharded:
            return self._async_save_sharded(step, name, state)
        if self.collective:
            return _collective_async_save(self, step, name, state, background_staging)
        self._begin(step, name, wait_previous=False)  # the saver's in-flight limit orders the saves
        err = None
        fut: Optional[concurrent.futures.Future] = None
        if self.rank == 0:
            with self._lock:
                self._writing.add(name)
            try:
                fut = self.saver.save(state, self.directory / name, after=lambda: self._commit(name),
                                      background_staging=background_staging)
            except failure_types() as e:  # noqa: BLE001
                err = e
                with self._lock:
                    self._writing.discard(name)
            else:
                self._track(fut, name)
        self._ranks.agree(err, f"snapshotting the checkpoint of step {step}")
        return fut if fut is not None else _done_future()

    def _track(self, fut: concurrent.futures.Future, name: str) -> None:
        """A background save of ``name``: :meth:`wait_local` waits for it; then ``name`` leaves ``_writing``."""
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [fut]
        me = weakref.ref(self)  # no cycle manager -> future -> callback -> manager
        fut.add_done_callback(lambda _f: me() is not None and me()._finished(name))

    def _finished(self, name: str) -> None:
        with self._lock:
            self._writing.discard(name)

    def wait_local(self, timeout: Optional[float] = None) -> bool:
        """Wait for this process's asynchronous saves of this manager (not
        collective; no error is raised). False on timeout."""
        with self._lock:
            futs = list(self._futures)
        done, not_done = concurrent.futures.wait(futs, timeout=timeout)
        return not not_done

    def wait(self) -> None:
        """Wait until every asynchronous save of this manager is durable; then
        raise, on every rank, any failure nobody looked at. Collective."""
        err = None
        try:
            self.wait_local()
            self.saver.raise_unobserved()
        except failure_types() as e:  # noqa: BLE001
            err = e
        self._ranks.agree(err, "an asynchronous checkpoint save")

    def close(self) -> None:
        """:meth:`wait` (raising on every rank any failure nobody looked at),
        then let the remote tier's uploads finish (a failure there is logged,
        see :meth:`wait_remote`), then free what the manager holds: the staging memory of sharded
        asynchronous saves and the manager's own gloo groups (their worker
        threads are joined now). Collective. The manager stays usable: a later
        sharded :meth:`async_save` makes a new group (collectively).

        Call it (or use the manager as a context manager) before
        ``destroy_process_group()``: a sharded asynchronous save still running
        then would find its group destroyed. At interpreter exit, managers
        still open finish their saves and free their group by themselves (an
        exit handler, not collective)."""
        try:
            self.wait()
            _remote_tier.close_all(self)  # collective where every rank uploads its part
            _memory_tier.close_tier(self._memory)  # the job is done: its snapshots and replicas are freed
        finally:
            self._release(wait=False)

    def _release(self, wait: bool) -> None:
        """Not collective: (with ``wait``) wait for this process's background
        saves of this manager, then free what the coordination holds (the
        sharded writer's staging memory and the manager's own gloo groups,
        whose worker threads are joined now: :meth:`Ranks.release`)."""
        if wait:
            self.wait_local()
        _memory_tier.quiesce(getattr(self, "_memory", None))  # its thread uses the groups released below
        if self._remote is not None:
            self._remote.close(wait=True)
        self._ranks.release()

    def wait_remote(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait until every committed step queued for the remote tier is uploaded;
        return the newest step complete there; raise the last upload failure
        (once). Not collective. None where this rank takes no part (see
        :meth:`fastckpt.manager.remote.RemoteTier.wait`)."""
        return None if self._remote is None else self._remote.wait(timeout)

    def remote_status(self) -> Optional[dict]:
        """This rank's view of the remote tier: uploading/queued step, last complete,
        last error, bytes it uploaded (None where it takes no part)."""
        return None if self._remote is None else self._remote.status()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Without an exception: :meth:`close` (collective). With one: wait
        for this process's background saves and free the manager's group,
        without collectives (another rank may not be there)."""
        if exc_type is None:
            self.close()
        else:
            self._release(wait=True)

    # ------------------------------------------------------------ commit, retention, cleanup
    def _commit(self, name: str) -> None:
        """The checkpoint ``name`` is complete and durable: point ``latest`` at
        it (atomically), then move an abandoned branch aside and apply
        retention (:meth:`StepDirectory.commit`). Rank 0 only."""
        self._dir.commit(name, self._busy())
        if self._remote is not None:
            self._remote.committed(name)  # the upload is queued; training does not wait for it

    def _prune(self) -> List[str]:
        """Retention now (:meth:`StepDirectory.prune`). Rank 0 only."""
        return self._dir.prune(self._busy())

    def clean_temporaries(self) -> List[str]:
        """Delete what crashed saves *of this host* left in the directory:
        temporary names (``.fastckpt-tmp.<key>.<pid>.<host>.<start>.<n>.<r>``,
        files, and the manager's directories with a ``.dcp``, ``.del`` or ``.old``
        suffix; docs/FORMAT.md 1.6) whose process is gone; an ``.old`` one whose name is missing is put back.

        Kept:

        * another host's temporary names, always: on a shared filesystem
          another node may be writing that file right now, and its process
          cannot be checked from here (a warning names them: delete them by
          hand once no job on that host writes here);
        * names of a live process of this host (this one included; a pid
          reused by another process, told apart by its start time, is not
          live), and files whose lock a live writer holds (the engine's check,
          :func:`fastckpt._C.remove_leftovers`, removes the files);
        * names that are not of this format (an older fastckpt's, without a
          host: which host wrote them cannot be told), and entries owned by
          another user or that are neither files nor directories.

        Refused while a save of this manager is in flight. Not collective: the
        constructor calls it on rank 0 only.

        Returns the names removed.
        """
        with self._lock:
            busy = bool(self._writing) or any(not f.done() for f in self._futures)
        if busy:
            raise RuntimeError("fastckpt.CheckpointManager.clean_temporaries: a save of this manager is in flight")
        return self._dir.clean_temporaries()

    # ------------------------------------------------------------ sharded (DCP)
    def _save_sharded(self, step: int, name: str, state: Any) -> Path:
        tmp = self._begin(step, name, wait_previous=True, tmp_dir=True)
        err = None
        try:
            try:
                self._ranks.dcp_save(state, str(tmp))
            except failure_types() as e:  # noqa: BLE001
                err = e
            self._ranks.agree(err, f"writing the shards of step {step}")
            if self.rank == 0:
                try:
                    self._dir.publish_dir(tmp, name)
                    self._commit(name)
                except failure_types() as e:  # noqa: BLE001
                    err = e
            self._ranks.agree(err, f"committing the checkpoint of step {step}")
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if self.rank == 0:
                with self._lock:
                    self._writing.discard(name)
        return self.directory / name

    def _async_save_sharded(self, step: int, name: str, state: Any) -> concurrent.futures.Future:
        """Every rank stages its shards (FastWriter's reused buffers) and writes
        them in the background with ``dcp.async_save`` on the manager's own gloo
        group; when rank 0's save is done, DCP's .metadata is written (after
        every rank's data), and rank 0 renames the directory, moves ``latest``
        and applies retention, still in the background."""
        from ..saver import SaveResult
        # one sharded save in flight: every rank waits for its previous one first
        tmp = self._begin(step, name, wait_previous=True, tmp_dir=True)
        self._ranks.open_async_group()  # closed before: a new group (collective: every rank is here)
        err = None
        fut = SaveFuture(str(self.directory / name))
        fut.set_running_or_notify_cancel()
        dfut = None
        try:
            dfut = self._ranks.dcp_async_save(state, str(tmp))
        except failure_types() as e:  # noqa: BLE001
            err = e
        try:
            self._ranks.agree(err, f"staging the shards of step {step}")
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                self._finished(name)
            raise
        t0 = time.perf_counter()

        def done(df) -> None:
            exc = None
            try:
                df.result()
                if self.rank == 0:
                    self._dir.publish_dir(tmp, name)
                    self._commit(name)
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                exc = e
                if self.rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
            finally:
                if self.rank == 0:
                    self._finished(name)
            if exc is None:
                fut.set_result(SaveResult(fut.path, 0, 0.0, time.perf_counter() - t0))
            else:
                self.saver.note_failure(fut, exc)
                fut.set_exception(exc)

        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [fut]
        dfut.add_done_callback(done)
        return fut

    # ------------------------------------------------------------ loading
    def load_latest(self, map_location: Any = None, *, state: Any = None, weights_only: bool = True) -> Optional[Restored]:
        """Load the checkpoint ``latest`` names; if it is damaged, the newest
        older one that loads. Collective.

        ``latest`` is authoritative: checkpoints of higher steps than the one
        it names (an abandoned branch after a rollback, or a save that never
        committed) are never loaded (a warning names them). Without a
        ``latest`` file (it was deleted, or no save has committed yet), the
        complete checkpoints are tried newest first, with a warning.

        With ``replicate_to``, every step complete in either tier is a
        candidate, newest first (remote ones never newer than ``latest``), the
        local copy first; a step whose local copy is missing or damaged is
        restored from the remote tier (verified against its manifest's CRC-32s)
        by rank 0 into the directory, ``latest`` pointed at it, then loaded.

        Only a *damaged* checkpoint is skipped: one that is missing or
        incomplete (FileNotFoundError, NotADirectoryError, IsADirectoryError,
        a DCP checkpoint without ``.metadata`` or missing a data file) or
        fails its checks (:class:`fastckpt.FormatError`: truncated, corrupt,
        a CRC mismatch). It is skipped on every rank alike, with a
        ``RuntimeWarning`` naming it and why, and the next older one is
        tried. Any other failure (MemoryError, an out-of-memory error of a
        device, EIO or any other OSError, an error of ``map_location``, a DCP
        planner error such as a missing key) says that the machine or the
        caller is in trouble, not the checkpoint: it propagates at once, on
        every rank, and no older checkpoint is tried.

        Args:
            map_location: as for :func:`fastckpt.load` (replicated mode), e.g.
                ``f"cuda:{local_rank}"``.
            state: the state dict to load into, in place: required in sharded
                mode (``torch.distributed.checkpoint.load``); in replicated
                mode its tensors are filled by :func:`fastckpt.load_into` (no
                second copy of the state; keys, shapes and dtypes must match:
                no ``map_location``). A checkpoint that fails part-way may have
                filled some entries; the next one tried overwrites every entry.
            weights_only: as for :func:`fastckpt.load`, in both modes: in
                sharded mode, no value of the checkpoint (non-tensor entries
                of ``state``) is unpickled by code-running pickle either.

        Returns:
            ``Restored(step, state, path)``, or None when the directory holds
            no complete checkpoint (a fresh start) or none at or below the
            step ``latest`` names.

        Raises:
            pickle.UnpicklingError: ``weights_only`` refused a checkpoint (not
                corruption: older checkpoints are not tried); RuntimeError on
                the ranks where it was not refused.
            Any error that is not a damaged checkpoint (see above), as itself
                on the rank that hit it (with a note naming the checkpoint), a
                RuntimeError naming that rank on the others.
            RuntimeError: checkpoints exist but every one tried is damaged.
        """
        if self.sharded and state is None:
            raise ValueError("sharded mode loads in place: pass state=<state dict to fill>")
        if state is not None and map_location is not None and not self.sharded:
            raise ValueError("load_latest(state=...) fills the state's own tensors: map_location does not apply")
        listing = None
        err = None
        if self.rank == 0:
            try:
                listing = self._dir.candidates()
            except failure_types() as e:  # noqa: BLE001
                err = e
        listing = self._ranks.agree(err, "listing checkpoints", listing)
        got = _memory_tier.restore(self, listing, map_location, weights_only, state) if self._memory else None
        if got is not None:  # (collective) from memory: a step at least as new as the disk's
            return got
        failures = []
        for step, name in _remote_candidates(self, listing):  # local first, then the remote tier
            path = self.directory / name
            result, err = None, None
            try:
                result = self._ranks.load_step(path, self.sharded, self.collective, self.verify, weights_only,
                                               map_location, state)
            except failure_types() as e:  # noqa: BLE001 - classified below
                err = e
            got = self._ranks.gather(load_report(err))
            why = judge_load(path, err, got)
            if why is None:
                return Restored(step, result, str(path))
            failures.append(f"{name} ({why})")
            warnings.warn(f"fastckpt.CheckpointManager: skipping checkpoint {path}, which is damaged: {why}; "
                          "falling back to the previous one", RuntimeWarning, stacklevel=2)
        if failures:
            raise RuntimeError(f"fastckpt.CheckpointManager: no checkpoint in {self.directory} could be loaded: "
                               + "; ".join(failures))
        return None

    restore = load_latest
