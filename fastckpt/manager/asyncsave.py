"""CheckpointManager.async_save in replicated mode with ``collective=True``: every rank writes its share in the background.

The flow (every rank, in the caller's thread, then on the saver's writer thread):

1. the barrier before the save (``CheckpointManager._begin`` with ``wait_previous``): every
   rank first waits for its previous background save of this manager, so that one is in
   flight per manager and two saves' collectives never interleave;
2. the group reserved for background saves is made if there is none
   (:meth:`Ranks.open_async_group`: collective, here, where every rank is and nothing of this
   manager runs on it); the training loop's group, and the manager's group of collective saves
   and loads in the caller's thread, are never used from the writer thread;
3. every rank snapshots the state into host memory as :func:`fastckpt.async_save` does
   (:meth:`AsyncSaver.stage`: pickled now, every storage copied into a reused arena, the
   saver's in-flight limit applies), then the ranks agree on the user's group: a rank whose
   snapshot failed makes ``async_save`` raise on every rank, nothing is written;
4. the writer thread of every rank runs the collective save of that snapshot on the group of
   background saves (``fastckpt.save(..., group=...)``: its share of one temporary file,
   rank 0 the rest and the commit; any rank's failure raises on every rank, the temporary file
   is removed, the previous checkpoint is untouched), then rank 0 moves ``latest`` and applies
   retention, then the ranks agree on that outcome (on the group of background saves): every
   rank's future resolves once ``latest`` names the checkpoint, or fails (with the path and
   the cause) on every rank; ``latest`` never moves for a save that failed.

The snapshot is written as it was pickled in step 3 (:class:`_Replay`): the collective save
pickles the object it is given, and the snapshot's object is its pickle (``data.pkl``, with the
device locations of the live storages) and its staged storages; the file is the one
``fastckpt.save(state, path)`` would have written at the moment of the snapshot (torch's
``torch.utils.serialization.config.save`` settings, storage alignment and CRC, are read when
the collective save runs on the writer thread: change them only between saves).
"""

import os
from typing import Any, Optional

from .ranks import failure_types
from ..saver import SaveFuture, SaveSnapshot
from ..serialization import save as _save


def commit_outcome(path: str, rank: int) -> str:
    """What a rank knows of the checkpoint when the group breaks in the exchange
    after the background commit of ``path``: rank 0 (which moved ``latest``
    before it, or raised its own error) that ``latest`` names it; the others
    cannot tell."""
    return f"{path} was committed before that; " + (
        "`latest` names it" if rank == 0 else "this rank cannot tell whether `latest` names it")


class _Replay:
    """The ``pickle_module`` through which ``fastckpt.save`` writes a snapshot
    (:class:`fastckpt.saver.SaveSnapshot`) as it was pickled: its ``dump``
    hands every staged storage, in key order, to the persistent-id hook of the
    save's pickler (which then numbers them as the snapshot did: keys "0",
    "1", ...) and writes the snapshot's ``data.pkl`` as it is, with the
    storages' locations of the moment of the snapshot (``cuda:0`` for a
    device storage staged in host memory)."""
    __name__ = "fastckpt.manager.asyncsave._Replay"

    class Pickler:
        def __init__(self, file, protocol=None, **_kwargs):
            self._file = file

        def persistent_id(self, obj):  # pragma: no cover - the save's pickler overrides it
            return None

        def dump(self, snap: SaveSnapshot) -> None:
            if not isinstance(snap, SaveSnapshot):
                raise TypeError(f"fastckpt: _Replay writes a snapshot, not {type(snap).__name__}")
            for storage in snap.staged:
                self.persistent_id(storage)
            self._file.write(snap.data_pkl)


def write_snapshot(path: str, snap: SaveSnapshot, group: Any) -> None:
    """Collective on ``group``: the snapshot ``snap`` written to ``path`` by
    every rank of ``group`` (:func:`fastckpt.save` with ``group=``)."""
    _save(snap, path, pickle_module=_Replay, group=group,
          _disable_byteorder_record=not snap.opts.get("byteorder", True))


def async_save(mgr: Any, step: int, name: str, state: Any, background_staging: Optional[bool] = None) -> SaveFuture:
    """``mgr.async_save(step, state)`` in replicated mode with ``collective=True``
    (see the module's docstring). Collective on the manager's ranks."""
    mgr._begin(step, name, wait_previous=True)  # one background save of this manager in flight
    ranks = mgr._ranks
    ranks.open_async_group()  # collective, at a safe point: nothing of this manager runs on it now
    path = os.path.join(os.fspath(mgr.directory), name)
    saver = mgr.saver
    with mgr._lock:
        mgr._writing.add(name)
    staged, err = None, None
    try:
        staged = saver.stage(state, path, zip_only=True, background_staging=background_staging)
    except failure_types() as e:  # noqa: BLE001 - every rank learns of it
        err = e
    try:
        ranks.agree(err, f"snapshotting the checkpoint of step {step} ({path})")
    except BaseException:
        if staged is not None:
            saver.drop(staged)
        mgr._finished(name)
        raise

    group = ranks.async_pg  # not released while this save is in flight: close() and exit wait for it

    def write(target: str, snap: SaveSnapshot) -> None:
        write_snapshot(target, snap, group)

    def commit() -> None:
        """On the writer thread, after the collective save returned on every
        rank: rank 0 moves ``latest``; every rank learns the outcome."""
        err = None
        if mgr.rank == 0:
            try:
                mgr._commit(name)
            except failure_types() as e:  # noqa: BLE001
                err = e
        ranks.agree(err, f"committing {path} (moving `latest`)", background=True, path=path,
                    outcome=commit_outcome(path, mgr.rank))

    try:
        fut = saver.submit(staged, write=write, after=commit, cancellable=False)
    except BaseException:  # e.g. interpreter shutdown (the snapshot was dropped)
        mgr._finished(name)
        raise
    mgr._track(fut, name)
    return fut
