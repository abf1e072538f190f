"""CheckpointManager's remote tier (``replicate_to=URL``).

The manager's directory is the first tier: a step is committed there (durable,
``latest`` moved) exactly as without a remote tier. Rank 0 then queues the
committed checkpoint (a file, or a sharded DCP directory) on a
:class:`fastckpt.remote.Replicator`, which uploads it in the background and
writes the step's manifest last; training never waits for it, and an upload
failure is logged, kept for :meth:`RemoteTier.wait` and :meth:`RemoteTier.status`,
and never touches the local checkpoint. ``keep_last_remote`` applies remotely
once a newer step is complete there.

Who uploads (fastckpt/remote/team.py): with several ranks, in sharded mode each
rank uploads the files it wrote, and in collective mode (every rank writes a
share of each file) each rank uploads a share of the file's parts, as parts of
one multipart upload (S3; where the store cannot share an upload, ``file://``
and fsspec's other filesystems, rank 0 uploads the file alone). Rank 0's
replicator coordinates (its Coordinator), every other rank serves it (a
Worker), through the job's c10d store; rank 0 writes the manifest once every
rank reported success. A step queued or being uploaded is kept locally until
its upload ends (retention leaves it alone; it is applied again at the next
commit and at close), because each rank opens its files only when the upload
begins. ``collective=False`` and a single rank: rank 0 uploads alone, its files
opened when the step is queued.

Restore: :meth:`CheckpointManager.load_latest` tries the local checkpoints
first; when none is left (a new or replaced node) or every one is damaged,
rank 0 restores the newest complete, CRC-verified remote step into the
directory (never one newer than what the local ``latest`` names: ``latest``
stays authoritative), points ``latest`` at it, and every rank loads it as a
local checkpoint.
"""

import logging
import uuid
import warnings
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from .ranks import failure_types

log = logging.getLogger("fastckpt")


def team(mgr: Any) -> bool:
    """Whether every rank of ``mgr`` uploads its part of each step: sharded and collective modes with several ranks."""
    return mgr._remote_url is not None and mgr.world_size > 1 and (mgr.sharded or mgr.collective)


def open_rank0(mgr: Any, url: Optional[str], storage_options: Optional[Dict[str, Any]],
               keep_last_remote: Optional[int]) -> Optional[str]:
    """Rank 0, in the manager's constructor: its remote tier (the store checked);
    returns the key prefix of the ranks' uploads in the job's store, which every
    rank learns, where every rank uploads its part (:func:`team`)."""
    if url is None:
        return None
    prefix = f"fastckpt-remote/{uuid.uuid4().hex}" if team(mgr) else None
    mgr._remote = RemoteTier(mgr, url, storage_options, keep_last_remote, prefix)
    return prefix


def open_others(mgr: Any, url: Optional[str], storage_options: Optional[Dict[str, Any]],
                keep_last_remote: Optional[int], prefix: Optional[str]) -> None:
    """Collective where every rank uploads its part (nothing elsewhere): every
    other rank opens the store (checked) and starts serving rank 0's uploads;
    any rank's failure raises on every rank."""
    if not team(mgr):
        return
    err = None
    if mgr.rank != 0:
        try:
            mgr._remote = RemoteTier(mgr, url, storage_options, keep_last_remote, prefix)
        except failure_types() as e:  # noqa: BLE001 - every rank learns of it
            err = e
    try:
        mgr._ranks.agree(err, f"opening the remote tier {url}")
    except BaseException:
        if mgr._remote is not None:
            mgr._remote.close(wait=False)
            mgr._remote = None
        raise


def close_all(mgr: Any) -> None:
    """Collective where every rank uploads its part (nothing elsewhere), in
    ``close()``: every rank serves rank 0's last uploads until it says they
    ended, then a barrier (rank 0 keeps the job's store up until every rank is done with it)."""
    if not team(mgr):
        return
    if mgr._remote is not None:
        mgr._remote.close(wait=True)
    mgr._ranks.agree(None, "closing the remote tier")


class RemoteTier:
    """One manager's remote tier on one rank: rank 0's replicator, or, when
    every rank uploads its part (``prefix``: the team's keys in the job's
    store), another rank's worker. Without a prefix, other ranks hold none."""

    def __init__(self, mgr: Any, url: str, storage_options: Optional[Dict[str, Any]],
                 keep_last_remote: Optional[int], prefix: Optional[str] = None):
        from ..remote import Replicator, open_store  # fsspec and the store's client only when asked for
        from ..remote.team import Coordinator, Worker
        self.mgr = mgr
        self.team = prefix is not None
        self.rep = self.worker = None
        if mgr.rank == 0:
            # The store is checked now (credentials, bucket): a bad one fails the manager's construction.
            # Rank 0 is the prefix's only writer: it aborts uploads and deletes steps that a killed run left.
            coord = Coordinator(mgr._ranks.store(), prefix, mgr.world_size) if self.team else None
            try:
                self.rep = Replicator(url, storage_options, keep_last_remote=keep_last_remote, clean_stale=True,
                                      team=coord)
            except BaseException:
                if coord is not None:
                    coord.close()
                raise
            self.url = self.rep.url
        else:
            store = open_store(url, storage_options)  # checked on every rank that uploads
            self.worker = Worker(mgr._ranks.store(), prefix, mgr.rank, mgr.world_size, store, mgr.directory)
            self.url = store.url

    def committed(self, name: str) -> None:
        """Rank 0, after ``latest`` names ``name``: queue its upload (returns at once). A failure to
        queue it (its files already gone) is logged and kept, never raised into the save."""
        step = self.mgr._dir.parse(name)
        try:
            self.rep.submit(step, self.mgr.directory / name)
        except Exception as e:  # noqa: BLE001 - the local checkpoint is committed; the upload is best effort
            log.error("fastckpt.CheckpointManager: not replicating %s to %s: %s", name, self.url, e)
            self._submit_error = e

    _submit_error: Optional[BaseException] = None

    def busy(self) -> Set[str]:
        """Rank 0: the names local retention must leave alone (queued or being uploaded by every rank)."""
        return set(self.rep.pending_names()) if self.team and self.rep is not None else set()

    def status(self) -> Dict[str, Any]:
        if self.worker is not None:
            return self.worker.status()
        st = self.rep.status()
        if self._submit_error is not None and st["last_error"] is None:
            st["last_error"] = str(self._submit_error)
        return st

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Rank 0: block until no upload is queued or running; raise the last failure
        (once; a step that failed on other ranks: :class:`fastckpt.remote.team.RanksFailed`
        naming them). Another rank that uploads its part (sharded and collective
        modes): block until rank 0 ruled on every step it had queued when this was
        called (after the manager's collective ``wait()`` that covers the
        asynchronous saves); raise this rank's own failure or rank 0's verdict that a
        step failed (once)."""
        if self.worker is not None:
            return self.worker.wait(timeout)
        done = self.rep.wait(timeout)
        err, self._submit_error = self._submit_error, None
        if err is not None:
            raise err
        return done

    def close(self, wait: bool = True) -> None:
        """Finish the running upload (with ``wait``, the queued one too; another rank: serve rank 0 until
        it says that uploads ended); a failure is logged (it was when it happened) and stays in
        :meth:`status`. Rank 0 then applies local retention to the steps it kept for their upload."""
        if self.worker is not None:
            self.worker.close(wait=wait)
            return
        self.rep.close(wait=wait)
        if self.team:
            try:
                self.mgr._prune()
            except Exception as e:  # noqa: BLE001 - retention tries again at the next commit
                log.warning("fastckpt.CheckpointManager: retention in %s after the uploads failed: %s",
                            self.mgr.directory, e)

    def steps(self, below: Optional[int]) -> List[int]:
        """The complete remote steps (with a manifest), at most ``below`` when given."""
        return [s for s in self.rep.list_steps() if below is None or s <= below]

    def restore(self, step: int) -> Optional[str]:
        """Rank 0: remote ``step`` downloaded and verified into the manager's directory (replacing a
        damaged local copy), ``latest`` pointed at it; its name, or None when it fails its checks (the
        replicator warned: missing file, size or CRC-32 mismatch)."""
        from ..remote.replicator import restore_step
        try:
            _, path = restore_step(self.rep.store, str(self.mgr.directory), step, self.rep.opts)
        except FileNotFoundError as e:
            warnings.warn(f"fastckpt.CheckpointManager: not restoring step {step} from {self.url}: {e}",
                          RuntimeWarning, stacklevel=5)
            return None
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if self.mgr._dir.parse(name) != step:
            raise RuntimeError(f"fastckpt.CheckpointManager: step {step} restored from {self.url} is named "
                               f"{name!r}, not this manager's name for it ({self.mgr.name_for(step)!r}): was it "
                               "replicated by a manager in the other mode (sharded or not)?")
        self.mgr._dir.commit(name, self.mgr._busy())  # `latest` names it (not uploaded again)
        warnings.warn(f"fastckpt.CheckpointManager: restored step {step} from {self.url} into "
                      f"{self.mgr.directory}", RuntimeWarning, stacklevel=5)
        return name


def candidates(mgr: Any, listing: List[Tuple[int, str]]) -> Iterator[Tuple[int, str]]:
    """The checkpoints load_latest tries, in order (collective: every rank iterates alike): every step
    complete in either tier, newest first (remote ones never newer than what the local ``latest``
    names), each from the local copy first; when the loop asks for more after a local copy (it was
    damaged), or the step is only remote, rank 0 restores the remote copy and every rank learns its
    name."""
    if mgr._remote_url is None:
        yield from listing
        return
    remote, err = None, None
    if mgr.rank == 0:
        try:
            latest = mgr._dir.latest_name()
            remote = mgr._remote.steps(None if latest is None else mgr._dir.parse(latest))
        except failure_types() as e:  # noqa: BLE001 - every rank learns of it
            err = e
    remote = mgr._ranks.agree(err, f"listing the remote checkpoints of {mgr._remote_url}", remote)
    local = dict(listing)
    for step in sorted(set(local) | set(remote), reverse=True):
        if step in local:
            yield step, local[step]
        if step in remote:
            name, err = None, None
            if mgr.rank == 0:
                try:
                    name = mgr._remote.restore(step)
                except failure_types() as e:  # noqa: BLE001
                    err = e
            name = mgr._ranks.agree(err, f"restoring step {step} from {mgr._remote_url}", name)
            if name is not None:
                yield step, name
