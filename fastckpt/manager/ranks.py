"""CheckpointManager's distributed coordination: the ranks that share a checkpoint directory.

:class:`Ranks` holds the process group the user gave (or the world), this rank and the
world size, the collectives of the manager (a gather that is also a barrier, and the
failure agreement built on it: every rank learns whether any rank failed, so that none
hangs or runs ahead), and sharded mode's DCP calls: ``dcp.save`` / ``dcp.load`` on the
user's group, and ``dcp.async_save`` through one FastWriter (its staging reused).

The manager's own gloo groups, with the user's group's timeout: one for the collective
saves and loads of replicated checkpoints that run in the caller's thread
(:meth:`Ranks.own_group`), and one reserved for background saves (:meth:`Ranks.open_async_group`:
DCP's background collectives in sharded mode, the writer thread's collective save in
replicated mode; fastckpt/_manager_async.py), so that a thread in the background never runs
a collective on a group that the training loop or the manager's caller uses at the same time.

The manager's own groups are freed by ``close()``, by ``with``, and at interpreter exit
(:func:`_release_at_exit`, while the interpreter is fully alive, because a gloo group that
dies during finalization aborts the process), and a forked child starts with fresh locks
(:func:`_after_fork_in_child`). Which rank does what with the directory is the manager's
business (fastckpt/manager.py); what the directory holds is fastckpt/_manager_policy.py's.
"""

import atexit
import errno
import logging
import os
import threading
import weakref
from datetime import timedelta
from typing import Any, List, Optional, Tuple

from .._core import dist_exit as _dist_exit
from ..collective.group import agree
from ..errors import RanksFailed

log = logging.getLogger("fastckpt")


# ------------------------------------------------------------------ what a failure can be

_failures_cache: Optional[Tuple[type, ...]] = None


def failure_types() -> Tuple[type, ...]:
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


# Raised by :meth:`Ranks.agree` on the ranks that did not fail: another rank did
# (the message says which and why). The one "rank r failed" error of fastckpt.
PeerFailed = RanksFailed


# ------------------------------------------------------------------ groups

def _dist_initialized() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return dist.is_available() and dist.is_initialized()


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


def _dcp_writer(path: str) -> Any:
    """The storage writer of sharded checkpoints: fastckpt.dcp's FastWriter
    (the engine). It takes the stock FileSystemWriter's path argument, which
    can stand in for it here."""
    from ..dcp import FastWriter
    return FastWriter(path)


def _dcp_reader(path: str, verify: bool, weights_only: bool) -> Any:
    """The storage reader of a sharded checkpoint: FastReader (the engine; CRCs
    checked when ``verify``), which with ``weights_only`` unpickles
    ``.metadata`` through fastckpt's restricted unpickler and non-tensor values
    through torch's weights-only one (the stock planner would hand them to
    ``torch.load(..., weights_only=False)``)."""
    from ..dcp import FastReader
    return FastReader(path, verify=verify, weights_only=weights_only)


class Ranks:
    """The ranks sharing a checkpoint directory: the user's process group (or
    the world when torch.distributed is initialized; one rank otherwise), and
    what the manager runs collectively on them. ``path``: the checkpoint
    directory, which the errors of :meth:`agree` name unless told another."""

    def __init__(self, process_group: Any = None, path: Optional[str] = None):
        self.pg, self.path = process_group, path
        self.dist = _dist_initialized()
        if self.dist:
            import torch.distributed as dist
            self.rank = dist.get_rank(self.pg)
            self.world_size = dist.get_world_size(self.pg)
        else:
            self.rank, self.world_size = 0, 1
        self.own_pg = None         # collective saves and loads in the caller's thread: a gloo group of the manager's
        self.async_pg = None       # background saves: a gloo group of their own (DCP's, or the writer thread's)
        self.async_writer = None   # sharded async saves: one FastWriter, its staging reused
        self.memory_pg = None      # the memory tier's replication (its background thread): a gloo group of its own

    # ------------------------------------------------------------ collectives
    def gather(self, obj: Any, background: bool = False) -> List[Any]:
        """Every rank's ``obj``, on every rank (a barrier too); on the user's
        group, or (``background``: from the writer thread) on the group of
        background saves."""
        if not self.dist:
            return [obj]
        out: List[Any] = [None] * self.world_size
        _dist_exit.all_gather_object(out, obj, group=self.async_pg if background else self.pg)  # also a barrier
        return out

    def agree(self, err: Optional[BaseException], what: str, payload: Any = None, background: bool = False,
              who: str = "fastckpt.CheckpointManager", path: Optional[str] = None,
              outcome: Optional[str] = None) -> Any:
        """A barrier that also tells every rank whether any rank failed: raises
        ``err`` here, or :class:`~fastckpt.errors.RanksFailed` (an OSError and
        a RuntimeError, with the first failed rank's errno, EIO where it had
        none) naming the ranks that failed (``who``: the component
        the message starts with; ``path``: the user's path, its ``filename``,
        by default the directory the ranks share).
        When the exchange itself breaks (a rank died: gloo's connection closes;
        or did not arrive within the group's timeout), a rank with an error of
        its own raises that, the others a RanksFailed (EIO) saying that contact
        with the other processes was lost while ``what``, with no rank named
        (``failures`` empty: no rank can tell which died), followed by
        ``outcome`` (what that means for the checkpoint) when given.
        Returns rank 0's ``payload``. ``background``: on the group of
        background saves (:meth:`gather`). The agreement itself is the
        collective saves' (fastckpt/collective/group.py, ``agree``)."""
        path = self.path if path is None else path

        def lost(e: BaseException) -> RanksFailed:
            return RanksFailed(errno.EIO, f"{who}: {what} failed: lost contact with the other processes (a rank "
                               f"died or did not answer in time: {type(e).__name__}: {e})"
                               + (f"; {outcome}" if outcome else ""), path)
        return agree(lambda obj: self.gather(obj, background), err, payload,
                     lambda r, m: f"{who}: {what} failed on rank {r}: {m}", lost, path)[0]

    def store(self) -> Any:
        """A new client of the job's key-value store (torch.distributed's default
        c10d Store: the TCPStore of torchrun or ``env://``, a FileStore...), for
        the remote tier's ranks to talk from their background threads without a
        process group (fastckpt/remote/team.py); each thread clones its own."""
        from torch.distributed import distributed_c10d as c10d
        return c10d._get_default_store().clone()

    # ------------------------------------------------------------ the manager's own groups
    def _new_group(self) -> Any:
        """Collective: a gloo group of the user's group's ranks, with its
        timeout (not torch's default of 30 minutes for a new group: a rank
        whose peer stops responding fails within that timeout instead of
        waiting it out; crash driver's stall checks)."""
        import torch.distributed as dist
        group = self.pg or dist.group.WORLD
        return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                              timeout=_group_timeout(group))

    def open_async_group(self) -> None:
        """Collective (where torch.distributed is initialized; nothing otherwise),
        at a point where no background save of this manager is in flight:
        makes the group of background saves if there is none. dcp.async_save
        (sharded mode) and the writer thread's collective save (replicated
        mode) run collectives from a background thread: never on a group that
        another thread uses meanwhile (two threads' collectives would
        interleave). Freed by :meth:`release`."""
        if self.dist and self.async_pg is None:
            self.async_pg = self._new_group()

    def own_group(self) -> Any:
        """The manager's own gloo group for the collective saves and loads of
        replicated checkpoints in the caller's thread (made now if needed:
        collective); None without torch.distributed."""
        if self.dist and self.own_pg is None:
            self.own_pg = self._new_group()
        return self.own_pg

    def memory_group(self) -> Any:
        """Collective: the gloo group reserved for the memory tier's replicas (made now if needed)."""
        if self.dist and self.memory_pg is None:
            self.memory_pg = self._new_group()
        return self.memory_pg

    # ------------------------------------------------------------ sharded mode (DCP)

    def dcp_save(self, state: Any, path: str) -> None:
        """Collective: every rank writes its shards of ``state`` into ``path``."""
        import torch.distributed.checkpoint as dcp
        dcp.save(state, storage_writer=_dcp_writer(path), process_group=self.pg)

    def dcp_async_save(self, state: Any, path: str) -> Any:
        """Collective: every rank stages its shards of ``state`` and writes them
        into ``path`` in the background (DCP's collectives on the manager's own
        group, made here if :meth:`release` freed it). Returns DCP's future."""
        import torch.distributed.checkpoint as dcp
        from ..dcp import FastWriter
        self.open_async_group()
        if self.async_writer is None:
            self.async_writer = FastWriter(path)
        fut = dcp.async_save(state, checkpoint_id=path, storage_writer=self.async_writer,
                             process_group=self.async_pg)
        return getattr(fut, "upload_completion", fut)  # an AsyncSaveResponse in some modes

    def load_step(self, path: Any, sharded: bool, collective: bool, verify: bool, weights_only: bool,
                  map_location: Any, state: Any) -> Any:
        """Collective: one checkpoint of a manager, loaded: sharded, into ``state`` (DCP); replicated
        with ``state``, into its tensors in place (``fastckpt.load_into``, shared reads with the
        manager's group when collective); else ``fastckpt.load`` (collective when ``collective``)."""
        if sharded:
            self.dcp_load(state, str(path), verify, weights_only)
            return state
        group = self.own_group() if collective else None
        if state is not None:
            from ..serialization import load_into
            load_into(state, path, group=group)
            return state
        from ..serialization import load
        return load(path, map_location=map_location, weights_only=weights_only, verify=verify, group=group)

    def dcp_load(self, state: Any, path: str, verify: bool, weights_only: bool) -> None:
        """Collective: fill ``state`` in place from the sharded checkpoint ``path``."""
        import torch.distributed.checkpoint as dcp
        dcp.load(state, storage_reader=_dcp_reader(path, verify, weights_only), process_group=self.pg)

    def release(self) -> None:
        """Not collective: close the sharded writer (its staging memory) and
        free the manager's own process groups: each is destroyed (if still
        registered) and its last reference dropped, so that gloo's destructor
        joins its worker threads here, while the interpreter is alive."""
        writer, self.async_writer = self.async_writer, None
        if writer is not None:
            writer.close()
        groups = [g for g in (self.async_pg, self.own_pg, self.memory_pg) if g is not None]
        self.async_pg = self.own_pg = self.memory_pg = None
        if not groups:
            return
        import torch.distributed as dist
        while groups:
            pg = groups.pop()
            try:
                dist.destroy_process_group(pg)
            except (ValueError, RuntimeError) as e:  # already destroyed (destroy_process_group() of all groups)
                log.debug("fastckpt.CheckpointManager: own process group already destroyed: %s", e)
            del pg  # the last reference: ProcessGroupGloo's destructor joins its threads now


# ------------------------------------------------------------------ exit and fork

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()   # the CheckpointManagers of this process
_exit_hook = False
_exit_lock = threading.Lock()


def _release_at_exit() -> None:
    """atexit (registered when the first manager is made, i.e. after torch's
    own exit handlers, so it runs before them, and while the interpreter is
    fully alive): every live manager finishes its background saves and frees
    its own gloo group, whose worker threads are joined here rather than
    during interpreter finalization; then the references torch keeps to
    destroyed groups are dropped (:func:`_dist_exit.drop_torch_refs_to_destroyed_groups`)."""
    for mgr in list(_live):
        try:
            mgr._release(wait=True)
        except Exception:  # noqa: BLE001 - never mask other exit handlers
            log.exception("fastckpt.CheckpointManager: error while finishing %s at exit", mgr.directory)
    try:
        n = _dist_exit.drop_torch_refs_to_destroyed_groups()
        if n:
            log.debug("fastckpt.CheckpointManager: dropped %d reference(s) torch kept to destroyed groups", n)
    except Exception:  # noqa: BLE001
        log.debug("fastckpt.CheckpointManager: could not drop torch's references to destroyed groups",
                  exc_info=True)


def register_manager(mgr: Any) -> None:
    """A new manager: released at exit (``mgr._release(wait=True)``) and told of a fork (``mgr._after_fork()``)."""
    global _exit_hook
    with _exit_lock:
        _live.add(mgr)
        if not _exit_hook:
            atexit.register(_release_at_exit)
            _exit_hook = True


def _after_fork_in_child() -> None:
    """In a child made by ``fork()`` (only the forking thread survives): a new
    lock for this module, and every live manager forgets what the parent was
    doing (:meth:`CheckpointManager._after_fork`)."""
    global _exit_lock
    _exit_lock = threading.Lock()
    for mgr in list(_live):
        mgr._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
