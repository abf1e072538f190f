"""fastckpt.CheckpointManager: a directory of step checkpoints for a training loop.

Layout of ``directory``::

    step_00000100.pt     complete checkpoints (replicated mode: one fastckpt.save file each)
    step_00000200/       ... or, in sharded mode, one DCP directory each
    latest               "step_00000200.pt\\n": the last checkpoint saved, replaced atomically
    .step_00000300.pt.fastckpt-tmp.<pid>.<host>.<start>.<n>.<r>   a save in progress (or left by a crash)
    .step_00000400.fastckpt-tmp.<pid>.<host>.<start>.<n>.<r>.dcp  ... of a sharded checkpoint (a directory)
    abandoned/step_00000300.pt   newer checkpoints set aside by a rollback (see below)

A checkpoint appears under its final name only when it is complete: single
files are committed by the engine (temporary file, fdatasync, rename,
directory fsync); sharded directories are written under a temporary name and
renamed by rank 0 once every rank's data and DCP's ``.metadata`` are durable.
``latest`` is then replaced the same way, and retention deletes older
checkpoints. Anything named ``.*.fastckpt-tmp.*`` is never a checkpoint;
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

* replicated mode (DDP; default): rank 0 writes, all ranks wait for it
  (a barrier before and after that also tells every rank whether rank 0
  failed, so that no rank hangs or runs ahead); all ranks read.
* sharded mode (``sharded=True``; FSDP, DTensor): every rank writes its shards
  with ``torch.distributed.checkpoint``; all ranks load in place.

The directory must be visible to every rank that reads it (one node, or a
shared filesystem).
"""

import atexit
import concurrent.futures
import errno
import itertools
import logging
import os
import pickle
import re
import shutil
import stat
import sys
import threading
import time
import types
import uuid
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, List, NamedTuple, Optional, Set, Tuple, Union

from . import _C
from .async_save import AsyncSaver, SaveFuture, _fail_inherited, default_saver
from ._owner import check_directory_owner
from .engine import fsync_dir, get_engine
from .errors import FormatError
from .serialization import load as _load
from .serialization import save as _save

__all__ = ["CheckpointManager", "Restored", "TMP_MARK"]

log = logging.getLogger("fastckpt")

# Temporary names (docs/FORMAT.md 1.6): the engine's `.<name>.fastckpt-tmp.<pid>.<host>.<start>.<n>.<r>`
# (csrc/engine/temp_file.h; parsed by _C.parse_temp_name), and the manager's (and `fastckpt convert`'s)
# directories: the same, then `.dcp` (a sharded save in progress), `.del` (retention removing an old
# one) or `.old` (a re-saved step's previous directory), made by _temp_name.
TMP_MARK = ".fastckpt-tmp."
_TMP_RE = re.compile(r"^\..+\.fastckpt-tmp\.(?:(\d+)\.)?")  # the pid, right after the mark
_TMP_KINDS = ("dcp", "del", "old")
_tmp_counter = itertools.count()


def _process_start(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot (/proc/PID/stat
    field 22, as the engine's temporary names hold it); 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # fields from 3 (state) on: 22 is [19]
    except (OSError, ValueError, IndexError):
        return 0


def _temp_name(name: str, kind: Optional[str] = None) -> str:
    """A temporary name for ``name`` in the engine's format (this process's
    pid, this host, its start time), then ``.kind`` (one of ``_TMP_KINDS``)
    for directories, which the engine never touches."""
    pid = os.getpid()
    base = (f".{name}{TMP_MARK}{pid}.{_C.temp_host()}.{_process_start(pid)}."
            f"{next(_tmp_counter)}.{uuid.uuid4().hex[:8]}")
    return base if kind is None else f"{base}.{kind}"


def _replace_dir(tmp: Union[str, os.PathLike], final: Union[str, os.PathLike]) -> None:
    """Rename the finished directory `tmp` to its sibling `final` and make the
    rename durable (an fsync of their parent). An existing `final` (a re-saved
    step, a converted checkpoint written over) is first moved aside under a
    temporary name of this host and process (``.old``: clean_temporaries
    removes it if this process dies before it does), then removed. The one
    rename-into-place of directories: the manager's sharded saves and
    `fastckpt convert` to DCP."""
    parent, name = os.path.split(os.fspath(final))
    if os.path.lexists(final):
        aside = os.path.join(parent, _temp_name(name, "old"))
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(parent)


def _parse_temp(entry: str) -> Optional[Tuple[str, dict, Optional[str]]]:
    """``(target, {"pid", "host", "start"}, kind)`` of a name made by the
    engine or by :func:`_temp_name`, or None (not one: older names without a
    host included)."""
    for base, kind in [(entry, None)] + [(entry[:-len(k) - 1], k) for k in _TMP_KINDS if entry.endswith("." + k)]:
        i = base.rfind(TMP_MARK)
        if i < 2 or not base.startswith("."):
            continue
        info = _C.parse_temp_name(base, base[1:i])
        if info is not None:
            return base[1:i], info, kind
    return None


def _writer_gone(info: dict) -> bool:
    """Whether the process (of this host) that made a temporary name is
    certainly gone: no such pid, or one that started at another time (the
    pid was reused). False when in doubt (the engine's temp_writer_gone)."""
    if not _pid_alive(info["pid"]):
        return True
    if not info["start"]:
        return False
    now = _process_start(info["pid"])
    return now != 0 and now != info["start"]
LATEST = "latest"
ABANDONED = "abandoned"               # checkpoints of an abandoned branch (a rollback) are moved here


def _drop_torch_refs_to_destroyed_groups() -> int:
    """``torch.distributed.nn.functional`` (imported by
    ``torch.distributed.checkpoint``, DDP and others) binds
    ``dist.group.WORLD`` as the default argument of its functions when it is
    first imported; imported after ``init_process_group``, that keeps the
    default group alive after ``destroy_process_group()``. Such a group dies
    only during interpreter finalization, and that is fatal with gloo: each
    of its worker threads keeps the last collective it ran, whose tensors
    hold Python objects, until the group is destroyed; releasing them then
    takes the GIL, and a thread that takes the GIL during finalization is
    killed inside a noexcept destructor: "terminate called without an
    active exception", SIGABRT (issue 11 item 13).

    Called at exit, while the interpreter is fully alive: replaces those
    default arguments, where they name a group that was already destroyed
    (no longer registered), by None (which means the default group, as if
    the module had been imported before ``init_process_group``). If nothing
    else holds the group, it is freed here, through its Python object,
    whose destructor releases the GIL while it joins the worker threads.
    Live groups are left alone. Returns how many defaults were replaced."""
    mod = sys.modules.get("torch.distributed.nn.functional")
    if mod is None:
        return 0
    import torch.distributed as dist
    live = set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()
    n = 0
    for f in list(vars(mod).values()):
        if not isinstance(f, types.FunctionType) or not f.__defaults__:
            continue
        d = tuple(None if isinstance(x, dist.ProcessGroup) and x not in live else x for x in f.__defaults__)
        if any(x is not y for x, y in zip(d, f.__defaults__)):
            f.__defaults__ = d
            n += 1
    return n


_live: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()
_exit_hook = False
_exit_lock = threading.Lock()


def _release_at_exit() -> None:
    """atexit (registered when the first manager is made, i.e. after torch's
    own exit handlers, so it runs before them, and while the interpreter is
    fully alive): every live manager finishes its background saves and frees
    its own gloo group, whose worker threads are joined here rather than
    during interpreter finalization; then the references torch keeps to
    destroyed groups are dropped (:func:`_drop_torch_refs_to_destroyed_groups`)."""
    for mgr in list(_live):
        try:
            mgr._release(wait=True)
        except Exception:  # noqa: BLE001 - never mask other exit handlers
            log.exception("fastckpt.CheckpointManager: error while finishing %s at exit", mgr.directory)
    try:
        n = _drop_torch_refs_to_destroyed_groups()
        if n:
            log.debug("fastckpt.CheckpointManager: dropped %d reference(s) torch kept to destroyed groups", n)
    except Exception:  # noqa: BLE001
        log.debug("fastckpt.CheckpointManager: could not drop torch's references to destroyed groups",
                  exc_info=True)


def _register(mgr: "CheckpointManager") -> None:
    global _exit_hook
    with _exit_lock:
        _live.add(mgr)
        if not _exit_hook:
            atexit.register(_release_at_exit)
            _exit_hook = True


def _after_fork_in_child() -> None:
    """In a child made by ``fork()`` (only the forking thread survives): new
    locks for the module and every live manager (another thread may have held
    one at fork()); the parent's saves in flight are not the child's: their
    futures fail at once (see :func:`fastckpt.async_save._fail_inherited`)
    and the names they were writing are not the child's to protect, so the
    child's ``wait``, ``clean_temporaries`` and exit never wait for them."""
    global _exit_lock
    _exit_lock = threading.Lock()
    for mgr in list(_live):
        mgr._lock = threading.Lock()
        for f in mgr._futures:
            _fail_inherited(f)
        mgr._futures = []
        mgr._writing = set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.load_latest` found."""
    step: int
    state: Any
    path: str


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dcp_writer(path: str) -> Any:
    """The storage writer of sharded checkpoints: fastckpt.dcp's FastWriter
    (the engine). It takes the stock FileSystemWriter's path argument, which
    can stand in for it here."""
    from .dcp import FastWriter
    return FastWriter(path)


def _dcp_reader(path: str, verify: bool, weights_only: bool) -> Any:
    """The storage reader of a sharded checkpoint: FastReader (the engine; CRCs
    checked when ``verify``), which with ``weights_only`` unpickles
    ``.metadata`` through fastckpt's restricted unpickler and non-tensor values
    through torch's weights-only one (the stock planner would hand them to
    ``torch.load(..., weights_only=False)``)."""
    from .dcp import FastReader
    return FastReader(path, verify=verify, weights_only=weights_only)


# What "this checkpoint is missing or incomplete" looks like as an OSError:
# the file or directory is not there (or not of its kind). Every other errno
# (EIO, EACCES, ENOMEM, ESTALE, EUCLEAN, ...) says the machine, the filesystem
# or the caller is in trouble, not the checkpoint: it propagates.
_DAMAGE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})


def _failure_kind(e: BaseException) -> str:
    """How :meth:`CheckpointManager.load_latest` treats a failure to load one
    checkpoint: ``"damaged"`` (missing, incomplete or failing its checks: try
    the previous one), ``"refused"`` (the weights-only unpickler refused a
    value: raised, not corruption) or ``"error"`` (anything else: raised)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and type(e).__name__ == "CheckpointException":  # DCP wraps every rank's error
        kinds = {_failure_kind(f[0] if isinstance(f, tuple) else f) for f in failures.values()}
        if not kinds or "error" in kinds:
            return "error"
        return "refused" if "refused" in kinds else "damaged"
    if isinstance(e, FormatError):
        return "damaged"
    if isinstance(e, pickle.UnpicklingError):
        return "refused"
    if isinstance(e, OSError):
        return "damaged" if e.errno in _DAMAGE_ERRNOS else "error"
    return "error"


def _unwrap(e: BaseException) -> BaseException:
    """DCP's CheckpointException holding exactly one error: that error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and type(e).__name__ == "CheckpointException" and len(failures) == 1:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            e = inner
    return e


_failures_cache: Optional[Tuple[type, ...]] = None


def _failures() -> Tuple[type, ...]:
    """What a failed save or load can raise: Exception, and DCP's
    CheckpointException, which is a BaseException."""
    global _failures_cache
    if _failures_cache is None:
        try:
            from torch.distributed.checkpoint.api import CheckpointException
            _failures_cache = (Exception, CheckpointException)
        except ImportError:  # pragma: no cover - torch without distributed
            _failures_cache = (Exception,)
    return _failures_cache


def _group_timeout(group: Any) -> Optional[timedelta]:
    """The timeout ``group`` was created with (torch has no public getter), or None
    (torch's default) where it cannot be told."""
    import torch
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend, or a torch without these internals
            continue
    return None


def _done_future(result=None) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(result)
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
        verify: check every storage's CRC-32 when loading (replicated mode).
        clean: delete leftover temporary files/directories of crashed saves
            now (see :meth:`clean_temporaries`).
        saver: the :class:`~fastckpt.async_save.AsyncSaver` for
            :meth:`async_save` (default: the process-wide one, which
            :func:`fastckpt.wait_for_saves` also waits for).

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
                 saver: Optional[AsyncSaver] = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (got {keep_last})")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.sharded = sharded
        self.verify = verify
        self._pg = process_group
        self._saver = saver
        self._lock = threading.Lock()
        self._writing: Set[str] = set()          # final names of saves in flight
        self._futures: List[concurrent.futures.Future] = []  # this manager's asynchronous saves
        self._dcp_writer = None                  # sharded async saves: one FastWriter, its staging reused
        self._dcp_pg = None                      # ... and a gloo group of their own for DCP's background collectives
        self._dist = self._dist_initialized()
        if self._dist:
            import torch.distributed as dist
            self.rank = dist.get_rank(self._pg)
            self.world_size = dist.get_world_size(self._pg)
        else:
            self.rank, self.world_size = 0, 1
        err = None
        if self.rank == 0:
            try:
                check_directory_owner(self.directory)
                if not self.directory.is_dir():
                    self.directory.mkdir(parents=True, exist_ok=True)
                    fsync_dir(self.directory.parent)
                if clean:
                    self.clean_temporaries()
            except _failures() as e:  # noqa: BLE001 - every rank learns of it
                err = e
        self._agree(err, "preparing the checkpoint directory")
        if sharded and self._dist:
            self._dcp_pg = self._new_dcp_group()
        _register(self)

    def _new_dcp_group(self) -> Any:
        """Collective. dcp.async_save runs collectives from a background thread:
        never on the group the training loop uses (two threads' collectives
        would interleave). Its timeout is the user's group's, not torch's
        default of 30 minutes for a new group: a rank whose peer stops
        responding in the middle of an asynchronous save fails within that
        timeout instead of waiting it out (crash driver's stall check). Freed
        by :meth:`close` / ``with`` / interpreter exit (:meth:`_release`)."""
        import torch.distributed as dist
        group = self._pg or dist.group.WORLD
        return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                              timeout=_group_timeout(group))

    # ------------------------------------------------------------ names
    def name_for(self, step: int) -> str:
        return f"step_{step:08d}" if self.sharded else f"step_{step:08d}.pt"

    def path_for(self, step: int) -> Path:
        return self.directory / self.name_for(step)

    def _parse(self, name: str) -> Optional[int]:
        m = re.fullmatch(r"step_(\d+)" if self.sharded else r"step_(\d+)\.pt", name)
        return int(m.group(1)) if m else None

    def _complete(self) -> List[Tuple[int, str]]:
        """Complete checkpoints as (step, name), oldest first."""
        found = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        for name in names:
            step = self._parse(name)
            if step is None:
                continue
            p = self.directory / name
            if self.sharded and not (p.is_dir() and (p / ".metadata").is_file()):
                continue
            if not self.sharded and not p.is_file():
                continue
            found.append((step, name))
        return sorted(found)

    def steps(self) -> List[int]:
        """Steps of the complete checkpoints in the directory, oldest first."""
        return [s for s, _ in self._complete()]

    def latest_name(self) -> Optional[str]:
        """The checkpoint the ``latest`` pointer names, or None."""
        try:
            text = (self.directory / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        if self._parse(text) is None:
            warnings.warn(f"fastckpt.CheckpointManager: {self.directory / LATEST} holds {text[:80]!r}, "
                          "which is not a checkpoint name; ignoring it", RuntimeWarning, stacklevel=2)
            return None
        return text

    # ------------------------------------------------------------ collectives
    @staticmethod
    def _dist_initialized() -> bool:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover
            return False
        return dist.is_available() and dist.is_initialized()

    def _gather(self, obj: Any) -> List[Any]:
        if not self._dist:
            return [obj]
        import torch.distributed as dist
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._pg)  # also a barrier
        return out

    def _agree(self, err: Optional[BaseException], what: str, payload: Any = None) -> Any:
        """A barrier that also tells every rank whether any rank failed: raises
        ``err`` here, or a RuntimeError naming the rank that failed. Returns
        rank 0's ``payload``."""
        msg = None if err is None else f"{type(err).__name__}: {err}"
        got = self._gather((msg, payload))
        if err is not None:
            raise err
        for r, (m, _) in enumerate(got):
            if m is not None:
                raise RuntimeError(f"fastckpt.CheckpointManager: {what} failed on rank {r}: {m}")
        return got[0][1]

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
                tmp_name = _temp_name(name, "dcp")
                (self.directory / tmp_name).mkdir()
        except _failures() as e:  # noqa: BLE001
            err = e
        try:
            tmp_name = self._agree(err, f"an earlier checkpoint save (before step {step})", tmp_name)
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

        Returns the checkpoint's path (None on ranks that do not write in
        replicated mode).

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
        if self.rank == 0:
            with self._lock:
                self._writing.add(name)
            try:
                _save(state, path)
                self._commit(name)
            except _failures() as e:  # noqa: BLE001
                err = e
            finally:
                with self._lock:
                    self._writing.discard(name)
        self._agree(err, f"saving the checkpoint of step {step}")
        return path if self.rank == 0 else None

    def async_save(self, step: int, state: Any) -> concurrent.futures.Future:
        """Like :meth:`save`, but returns once ``state`` is snapshotted into
        host memory and writes it in the background; ``latest`` moves and
        retention runs when the write is durable. Collective: on return every
        rank may change its state.

        Replicated mode: rank 0 snapshots (see :func:`fastckpt.async_save`;
        the in-flight limit applies) and the other ranks wait for that.
        Sharded mode: every rank stages its shards (``dcp.async_save`` with
        FastWriter, whose staging buffers are reused) after waiting for its
        previous sharded save; DCP's background collectives run on a gloo
        group of the manager's own, not on the training loop's.

        Returns:
            The save's future (result: a SaveResult once the checkpoint is
            durable and, on rank 0, ``latest`` names it); in replicated mode,
            on ranks other than 0, a completed future whose result is None.
            :meth:`wait` (collective) waits for every save and reports
            failures on all ranks.

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
        self._begin(step, name, wait_previous=False)  # the saver's in-flight limit orders the saves
        err = None
        fut: Optional[concurrent.futures.Future] = None
        if self.rank == 0:
            with self._lock:
                self._writing.add(name)
            try:
                fut = self.saver.save(state, self.directory / name, after=lambda: self._commit(name))
            except _failures() as e:  # noqa: BLE001
                err = e
                with self._lock:
                    self._writing.discard(name)
            else:
                with self._lock:
                    self._futures = [f for f in self._futures if not f.done()] + [fut]
                me = weakref.ref(self)  # no cycle manager -> future -> callback -> manager
                fut.add_done_callback(lambda _f: me() is not None and me()._finished(name))
        self._agree(err, f"snapshotting the checkpoint of step {step}")
        return fut if fut is not None else _done_future()

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
        except _failures() as e:  # noqa: BLE001
            err = e
        self._agree(err, "an asynchronous checkpoint save")

    def close(self) -> None:
        """:meth:`wait` (raising on every rank any failure nobody looked at),
        then free what the manager holds: the staging memory of sharded
        asynchronous saves and the manager's own gloo group (its worker
        threads are joined now). Collective. The manager stays usable: a later
        sharded :meth:`async_save` makes a new group (collectively).

        Call it (or use the manager as a context manager) before
        ``destroy_process_group()``: a sharded asynchronous save still running
        then would find its group destroyed. At interpreter exit, managers
        still open finish their saves and free their group by themselves (an
        exit handler, not collective)."""
        try:
            self.wait()
        finally:
            self._release(wait=False)

    def _release(self, wait: bool) -> None:
        """Not collective: (with ``wait``) wait for this process's background
        saves of this manager, then close the sharded writer and free the
        manager's own process group: it is destroyed (if still registered)
        and its last reference dropped, so that gloo's destructor joins its
        worker threads here, while the interpreter is alive."""
        if wait:
            self.wait_local()
        writer, self._dcp_writer = self._dcp_writer, None
        if writer is not None:
            writer.close()
        pg, self._dcp_pg = self._dcp_pg, None
        if pg is None:
            return
        import torch.distributed as dist
        try:
            dist.destroy_process_group(pg)
        except (ValueError, RuntimeError) as e:  # already destroyed (destroy_process_group() of all groups)
            log.debug("fastckpt.CheckpointManager: own process group already destroyed: %s", e)
        del pg  # the last reference: ProcessGroupGloo's destructor joins its threads now

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
        it (atomically), then apply retention. Rank 0 only."""
        data = (name + "\n").encode()
        w = _C.Writer(get_engine(), str(self.directory / LATEST), len(data))
        try:
            w.write(data)
            w.commit()  # temporary file, fdatasync, rename over `latest`, directory fsync
        except BaseException:
            w.abort()
            raise
        self._abandon_newer(self._parse(name))
        self._prune()

    def _abandon_newer(self, step: int) -> List[str]:
        """``latest`` now names ``step``: move the complete checkpoints of
        higher steps (an abandoned branch, see the module docs) into
        ``abandoned/``. Rank 0 only. Returns their new paths."""
        with self._lock:
            busy = set(self._writing)
        newer = [n for s, n in self._complete() if s > step and n not in busy]
        if not newer:
            return []
        where = self.directory / ABANDONED
        if not where.is_dir():
            where.mkdir(exist_ok=True)
            fsync_dir(self.directory)
        moved = []
        for name in newer:
            dest, n = where / name, 0
            while dest.exists() or dest.is_symlink():
                n += 1
                dest = where / f"{name}.{n}"
            try:
                os.rename(self.directory / name, dest)
            except FileNotFoundError:
                continue
            moved.append(str(dest))
        fsync_dir(where)
        fsync_dir(self.directory)
        if moved:
            log.warning("fastckpt.CheckpointManager: step %d is older than %d checkpoint(s) in %s (a rollback): "
                        "that branch is abandoned; moved %s (never loaded, never deleted by retention)",
                        step, len(moved), self.directory, ", ".join(moved))
        return moved

    def _prune(self) -> List[str]:
        if self.keep_last is None:
            return []
        complete = self._complete()
        keep = {n for _, n in complete[-self.keep_last:]}
        latest = self.latest_name()
        with self._lock:
            protected = keep | set(self._writing) | ({latest} if latest else set())
        removed = []
        for step, name in complete:
            if name in protected:
                continue
            p = self.directory / name
            try:
                if p.is_dir():  # rename first, so that a crash never leaves half a checkpoint under its name
                    doomed = self.directory / _temp_name(name, "del")
                    os.rename(p, doomed)
                    shutil.rmtree(doomed)
                else:
                    os.unlink(p)
                removed.append(name)
            except FileNotFoundError:
                pass
        if removed:
            fsync_dir(self.directory)
            log.debug("fastckpt.CheckpointManager: retention removed %s", removed)
        return removed

    def clean_temporaries(self) -> List[str]:
        """Delete what crashed saves *of this host* left in the directory:
        temporary names (``.<name>.fastckpt-tmp.<pid>.<host>.<start>.<n>.<r>``,
        files, and the manager's directories with a ``.dcp``, ``.del`` or
        ``.old`` suffix; docs/FORMAT.md 1.6) whose process is gone.

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
        removed: List[str] = []
        foreign: List[str] = []
        unknown: List[str] = []
        engine_targets: Set[str] = set()
        me, uid = _C.temp_host(), os.geteuid()
        for name in sorted(os.listdir(self.directory)):
            if TMP_MARK not in name:
                continue
            parsed = _parse_temp(name)
            if parsed is None:
                unknown.append(name)
                continue
            target, info, kind = parsed
            if info["host"] != me:
                foreign.append(name)
                continue
            p = self.directory / name
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and kind is None:
                engine_targets.add(target)  # the engine's own files: its checks (lock included) decide
                continue
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)) or st.st_uid != uid:
                continue
            if not _writer_gone(info):
                log.debug("fastckpt.CheckpointManager: keeping %s (process %d is alive)", name, info["pid"])
                continue
            try:
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(p)
                else:
                    os.unlink(p)
                removed.append(name)
            except FileNotFoundError:
                pass
        for target in sorted(engine_targets):
            removed.extend(_C.remove_leftovers(str(self.directory / target)))
        removed.sort()
        if removed:
            fsync_dir(self.directory)
            log.warning("fastckpt.CheckpointManager: removed %d leftover temporary file(s) of interrupted saves "
                        "in %s: %s", len(removed), self.directory, ", ".join(removed))
        if foreign:
            log.warning("fastckpt.CheckpointManager: kept %d temporary file(s) of other hosts in %s (never removed "
                        "from here: another node may be writing them; delete them by hand once no job there "
                        "writes to this directory): %s", len(foreign), self.directory, ", ".join(foreign))
        if unknown:
            log.warning("fastckpt.CheckpointManager: kept %d temporary file(s) in %s whose name does not say which "
                        "host wrote them (an older fastckpt's): %s", len(unknown), self.directory, ", ".join(unknown))
        return removed

    # ------------------------------------------------------------ sharded (DCP)
    def _save_sharded(self, step: int, name: str, state: Any) -> Path:
        import torch.distributed.checkpoint as dcp
        tmp = self._begin(step, name, wait_previous=True, tmp_dir=True)
        err = None
        try:
            try:
                dcp.save(state, storage_writer=_dcp_writer(str(tmp)), process_group=self._pg)
            except _failures() as e:  # noqa: BLE001
                err = e
            self._agree(err, f"writing the shards of step {step}")
            if self.rank == 0:
                try:
                    self._publish_dir(tmp, name)
                    self._commit(name)
                except _failures() as e:  # noqa: BLE001
                    err = e
            self._agree(err, f"committing the checkpoint of step {step}")
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
        import torch.distributed.checkpoint as dcp
        from .async_save import SaveResult
        from .dcp import FastWriter
        # one sharded save in flight: every rank waits for its previous one first
        tmp = self._begin(step, name, wait_previous=True, tmp_dir=True)
        if self._dist and self._dcp_pg is None:  # closed before: a new group (every rank is here)
            self._dcp_pg = self._new_dcp_group()
        err = None
        fut = SaveFuture(str(self.directory / name))
        fut.set_running_or_notify_cancel()
        dfut = None
        try:
            if self._dcp_writer is None:
                self._dcp_writer = FastWriter(str(tmp))
            dfut = dcp.async_save(state, checkpoint_id=str(tmp), storage_writer=self._dcp_writer,
                                  process_group=self._dcp_pg)
            dfut = getattr(dfut, "upload_completion", dfut)  # an AsyncSaveResponse in some modes
        except _failures() as e:  # noqa: BLE001
            err = e
        try:
            self._agree(err, f"staging the shards of step {step}")
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
                    self._publish_dir(tmp, name)
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

    def _publish_dir(self, tmp: Path, name: str) -> None:
        """Rank 0: every rank's files and .metadata are written; make the
        directory durable and rename it to its final name."""
        for entry in os.scandir(tmp):  # the stock writer fsyncs its files; a cheap check for the others
            if entry.is_file():
                fd = os.open(entry.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(tmp)
        _replace_dir(tmp, self.directory / name)  # re-saving a step: the old one moved aside, then removed

    # ------------------------------------------------------------ loading
    def load_latest(self, map_location: Any = None, *, state: Any = None, weights_only: bool = True) -> Optional[Restored]:
        """Load the checkpoint ``latest`` names; if it is damaged, the newest
        older one that loads. Collective.

        ``latest`` is authoritative: checkpoints of higher steps than the one
        it names (an abandoned branch after a rollback, or a save that never
        committed) are never loaded (a warning names them). Without a
        ``latest`` file (it was deleted, or no save has committed yet), the
        complete checkpoints are tried newest first, with a warning.

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
            state: sharded mode: the state dict to load into, in place
                (``torch.distributed.checkpoint.load``); required there. A
                checkpoint that fails part-way may have filled some entries;
                the next one tried overwrites every entry it loads.
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
        listing = None
        err = None
        if self.rank == 0:
            try:
                listing = self._candidates()
            except _failures() as e:  # noqa: BLE001
                err = e
        listing = self._agree(err, "listing checkpoints", listing)
        failures = []
        for step, name in listing:
            path = self.directory / name
            result, err = None, None
            try:
                if self.sharded:
                    import torch.distributed.checkpoint as dcp
                    dcp.load(state, storage_reader=_dcp_reader(str(path), self.verify, weights_only),
                             process_group=self._pg)
                    result = state
                else:
                    result = _load(path, map_location=map_location, weights_only=weights_only, verify=self.verify)
            except _failures() as e:  # noqa: BLE001 - classified below
                err = e
            kind = None if err is None else _failure_kind(err)
            got = self._gather(None if err is None else (type(_unwrap(err)).__name__, str(_unwrap(err)), kind))
            bad = [(r, g) for r, g in enumerate(got) if g is not None]
            if not bad:
                return Restored(step, result, str(path))
            for what in ("error", "refused"):
                ranks = [r for r, g in bad if g[2] == what]
                if not ranks:
                    continue
                if kind == what:
                    e = _unwrap(err)
                    note = (f"fastckpt.CheckpointManager: raised while loading {path}; " +
                            ("not a damaged checkpoint, so older checkpoints were not tried"
                             if what == "error" else "the weights-only unpickler refused it (not corruption)"))
                    if hasattr(e, "add_note"):
                        e.add_note(note)
                    if e is err:
                        raise err
                    raise e from err
                first = dict(bad)[ranks[0]]
                if what == "refused":
                    raise RuntimeError(f"fastckpt.CheckpointManager: {path}: the weights-only unpickler refused it "
                                       f"on rank(s) {ranks}: {first[1]}")
                raise RuntimeError(f"fastckpt.CheckpointManager: loading {path} failed on rank(s) {ranks} "
                                   f"({first[0]}: {first[1]}); not a damaged checkpoint, so older checkpoints "
                                   "were not tried")
            why = "; ".join(f"rank {r}: {g[0]}: {g[1]}" for r, g in bad)
            failures.append(f"{name} ({why})")
            warnings.warn(f"fastckpt.CheckpointManager: skipping checkpoint {path}, which is damaged: {why}; "
                          "falling back to the previous one", RuntimeWarning, stacklevel=2)
        if failures:
            raise RuntimeError(f"fastckpt.CheckpointManager: no checkpoint in {self.directory} could be loaded: "
                               + "; ".join(failures))
        return None

    def _candidates(self) -> List[Tuple[int, str]]:
        """Rank 0: the checkpoints :meth:`load_latest` tries, in order: the one
        ``latest`` names, then the older complete ones, newest first."""
        complete = self._complete()
        latest = self.latest_name()
        if latest is None:
            if complete:
                warnings.warn(f"fastckpt.CheckpointManager: {self.directory / LATEST} is missing; trying the "
                              "complete checkpoints newest first", RuntimeWarning, stacklevel=3)
            return [(s, n) for s, n in reversed(complete)]
        top = self._parse(latest)
        newer = [n for s, n in complete if s > top]
        if newer:
            warnings.warn(f"fastckpt.CheckpointManager: not loading {', '.join(newer)} in {self.directory}: "
                          f"newer than {latest}, which {LATEST} names (an abandoned branch after a rollback, or a "
                          "save that never committed)", RuntimeWarning, stacklevel=3)
        if latest not in {n for _, n in complete}:
            warnings.warn(f"fastckpt.CheckpointManager: {self.directory / LATEST} names {latest}, "
                          "which is missing or incomplete; trying older checkpoints", RuntimeWarning, stacklevel=3)
        return [(s, n) for s, n in reversed(complete) if s <= top]

    restore = load_latest
