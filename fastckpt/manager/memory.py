"""CheckpointManager's memory tier: snapshots, saves from a snapshot, restores from memory or a peer, persist on a signal.

* :func:`open_tier` (collective, at the manager's construction): every rank's
  node key gathered, the peers planned (:func:`fastckpt.memory.replicas.plan_peers`),
  the gloo group reserved for replication made where there are peers.
* :func:`write_step`: ``save(step)`` right after ``snapshot(step)`` writes the
  file from the snapshot's bytes (its pickle and storages as they are in host
  memory: no second device copy, no second pickling) where one rank writes the
  whole file; a collective save takes the state again.
* :func:`restore` (collective, first thing in ``load_latest``): every rank's
  holdings gathered; the newest step, not older than the newest checkpoint on
  disk, that *every* rank can restore from its own memory or a peer's replica
  is chosen; a rank lacking it receives it from the peer that holds it (CRC
  checked by both); every rank checks and maps its snapshot; if any rank
  fails, the next step is tried on every rank alike, then the disk. Snapshots
  of newer steps are dropped afterwards (an abandoned branch), so ranks never
  mix steps later.
* :func:`persist_handler`: on ``persist_on``, rank 0 (the state is replicated)
  writes its newest snapshot not yet on disk durably and moves ``latest``,
  within ``persist_deadline``, then the previous handler runs.
"""

import logging
import os
import signal
import threading
import warnings
from typing import Any, List, Optional

import torch

from ..errors import FormatError
from ..memory import MemoryTier
from ..memory.replicas import Peers, node_key, plan_peers, recv_slot, send_slot
from ..memory.slots import Record
from ..serialization import load as _load
from ..torchsave.writer import write_archive
from .ranks import failure_types

log = logging.getLogger("fastckpt")

__all__ = ["open_tier", "snapshot", "write_step", "restore", "install_persist", "quiesce", "close_tier",
           "persist_newest"]


def open_tier(mgr: Any, cfg: MemoryTier) -> Any:
    """Collective: bind `cfg` to `mgr` (see the module's docstring)."""
    if not isinstance(cfg, MemoryTier):
        raise TypeError(f"memory must be a fastckpt.MemoryTier (got {type(cfg).__name__})")
    keys = mgr._ranks.gather(node_key())
    group, peers = None, Peers()
    if cfg.replicas and len(set(keys)) > 1:
        peers = plan_peers(keys, mgr.rank, cfg.replicas)
        group = mgr._ranks.memory_group()
    elif cfg.replicas and mgr.world_size > 1:
        log.info("fastckpt.MemoryTier: every rank is on one node: no replicas")
    bound = cfg.bind(str(mgr.directory), mgr.rank, peers, group)
    if cfg.persist_on is not None:
        install_persist(mgr, bound)
    return bound


def local_state(obj: Any) -> Any:
    """Sharded mode: `obj` with every DTensor replaced by this rank's shard (its local tensor):
    what a rank's snapshot holds."""
    from torch.distributed.tensor import DTensor
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return type(obj)((k, local_state(v)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(local_state(v) for v in obj)
    return obj


def fill_into(target: Any, snap: Any, where: str = "state") -> Any:
    """Sharded mode's restore in place: `target`'s tensors (a DTensor's local shard) filled from
    the snapshot's, other values replaced; FormatError where the two do not match (another world
    size or placement: the disk's checkpoint is the one to load then)."""
    from torch.distributed.tensor import DTensor
    if isinstance(target, DTensor):
        target = target.to_local()
    if isinstance(target, torch.Tensor):
        if not isinstance(snap, torch.Tensor) or snap.shape != target.shape or snap.dtype != target.dtype:
            got = f"{tuple(snap.shape)} {snap.dtype}" if isinstance(snap, torch.Tensor) else type(snap).__name__
            raise FormatError(f"the snapshot's {where} is {got}, the state's {tuple(target.shape)} {target.dtype}")
        target.copy_(snap)
        return target
    if isinstance(target, dict):
        if not isinstance(snap, dict) or set(snap) != set(target):
            raise FormatError(f"the snapshot's {where} does not have the state's keys")
        for k in target:
            got = fill_into(target[k], snap[k], f"{where}.{k}")
            if not isinstance(target[k], torch.Tensor):
                target[k] = got
        return target
    if isinstance(target, list) and isinstance(snap, list) and len(snap) == len(target):
        for i, v in enumerate(target):
            got = fill_into(v, snap[i], f"{where}[{i}]")
            if not isinstance(v, torch.Tensor):
                target[i] = got
        return target
    return snap


def snapshot(mgr: Any, step: int, state: Any) -> None:
    """``mgr.snapshot``: the state (sharded mode: each rank's shards) into the tier."""
    if mgr._memory is None:
        raise ValueError("fastckpt.CheckpointManager.snapshot needs a memory tier: "
                         "CheckpointManager(dir, memory=fastckpt.MemoryTier())")
    mgr._memory.snapshot(step, local_state(state) if mgr.sharded else state)


def _slot_view(tier: Any, rec: Record):
    """data.pkl's bytes and the storages (views of the slot's mapping) of snapshot `rec`."""
    whole = tier.own.view(rec["slot"], rec["nbytes"])
    off, n = rec["pkl"]
    data_pkl = whole[off:off + n].numpy().tobytes()
    st = whole.untyped_storage()
    storages = [st[o:o + n] for o, n in rec["storages"]]
    return data_pkl, storages


def write_from_snapshot(tier: Any, rec: Record, path: str) -> None:
    """The checkpoint file of snapshot `rec`, written durably at `path` (the commit helper's
    temporary file, fdatasync, rename, directory fsync), with every CRC-32."""
    data_pkl, storages = _slot_view(tier, rec)
    write_archive(path, data_pkl, storages, compute_crc32=True, borrowed=True, **rec["opts"])  # the slot holds still


def write_step(mgr: Any, step: int, state: Any, path: Any, save: Any) -> None:
    """``save(step)``'s write (see the module's docstring); `save` is fastckpt.save."""
    tier = mgr._memory
    rec = tier.last if tier is not None else None
    if rec is not None and rec.step == step and not mgr.collective:
        write_from_snapshot(tier, rec, os.fspath(path))
        return
    save(state, path, group=mgr._ranks.own_group() if mgr.collective else None)


# ------------------------------------------------------------------ restore

def _plan(holdings: List[dict], step: int) -> Optional[List[int]]:
    """For each rank, the rank that gives it `step` (itself, or a peer holding its replica); None if one has none."""
    plan = []
    for r, h in enumerate(holdings):
        if step in h["own"]:
            plan.append(r)
            continue
        src = next((g for g, hg in enumerate(holdings) if step in hg["replicas"].get(r, ())), None)
        if src is None:
            return None
        plan.append(src)
    return plan


def restore(mgr: Any, listing: List[Any], map_location: Any, weights_only: bool,
            target: Any = None) -> Optional[Any]:
    """Collective: the Restored of the newest step every rank can restore from memory (not older
    than the newest of the disk's `listing`, (step, name) pairs), or None (the disk's turn).
    Sharded mode: filled into `target` in place."""
    newest_disk = max((s for s, _ in listing), default=None)
    tier = mgr._memory
    tier.wait()
    mine = tier.holdings()
    holdings = mgr._ranks.gather(mine)
    steps = sorted({s for h in holdings for s in h["own"]} | {s for h in holdings for v in h["replicas"].values()
                                                                 for s in v}, reverse=True)
    group = mgr._ranks.own_group() if mgr.world_size > 1 else None
    for step in steps:
        if newest_disk is not None and step < newest_disk:
            break
        plan = _plan(holdings, step)
        if plan is None:
            continue
        err, state, path = None, None, None
        try:
            for r, src in enumerate(plan):  # fetches, in one order on every rank
                if src == r:
                    continue
                if mgr.rank == src:
                    d = tier.replica_dirs[r]
                    rec = tier.slot_of(d, step)
                    why = d.verify(rec) if rec is not None and tier.cfg.verify else None
                    if why is not None:
                        log.warning("fastckpt.MemoryTier: the replica of rank %d at step %d in %s is damaged (%s): "
                                    "not sent", r, step, d.archive(rec["slot"]), why)
                        rec = None
                    send_slot(group, r, d, rec)
                elif mgr.rank == r:
                    if recv_slot(group, src, tier.own, r) is None:
                        raise FormatError(f"the replica of rank {r}'s snapshot of step {step} held by rank {src} "
                                          "is damaged or missing")
            rec = tier.slot_of(tier.own, step)
            if rec is None:
                raise FormatError(f"{tier.own.path}: no complete snapshot of step {step}")
            path = tier.own.archive(rec["slot"])
            why = tier.own.verify(rec) if tier.cfg.verify else None
            if why is not None:
                raise FormatError(f"{path}: snapshot of step {step} is damaged: {why}")
            tier.own.mark_mapped(rec["slot"])  # the next snapshot into this slot takes new pages
            state = _load(path, map_location=map_location, weights_only=weights_only, mmap=True, verify=False)
            if target is not None:  # sharded, or replicated with state=: into the caller's tensors
                try:
                    state = fill_into(target, state)
                except FormatError as e:
                    raise FormatError(f"{path}: {e}") from None
        except failure_types() as e:  # noqa: BLE001 - every rank learns of it
            err = e
        got = mgr._ranks.gather(None if err is None else f"rank {mgr.rank}: {type(err).__name__}: {err}")
        bad = [g for g in got if g is not None]
        if not bad:
            tier.drop_newer(step)
            log.info("fastckpt.MemoryTier: restored step %d from host memory (%s)", step, path)
            from .manager import Restored
            return Restored(step, state, path)
        if err is not None and not isinstance(err, (FormatError, FileNotFoundError)):
            raise err
        warnings.warn(f"fastckpt.CheckpointManager: the memory tier's step {step} could not be restored "
                      f"({'; '.join(bad)}); trying the next one", RuntimeWarning, stacklevel=3)
    if steps:
        tier.drop_newer(-1 if newest_disk is None else newest_disk)  # none restorable: a branch the disk replaces
    return None


# ------------------------------------------------------------------ persist on a signal

def persist_newest(mgr: Any, tier: Any) -> Optional[str]:
    """Rank 0 (or the only rank): the newest snapshot not yet on disk, saved durably and
    ``latest`` moved. Returns the checkpoint's name, or None if there was none to save."""
    if mgr.rank != 0:
        return None
    rec = tier.last
    if rec is None:
        recs = tier.own.records()
        rec = recs[0] if recs else None
    if rec is None:
        return None
    done = mgr.steps()
    if done and max(done) >= rec.step:
        return None
    name = mgr.name_for(rec.step)
    write_from_snapshot(tier, rec, os.fspath(mgr.directory / name))
    mgr._commit(name)
    return name


def install_persist(mgr: Any, tier: Any) -> None:
    """The handler of ``persist_on`` (main thread only; elsewhere a warning)."""
    sig = tier.cfg.persist_on
    if mgr.sharded:
        warnings.warn("fastckpt.MemoryTier: persist_on is not supported with sharded=True (a sharded checkpoint "
                      "is written by every rank together); not installed", RuntimeWarning, stacklevel=4)
        return
    if threading.current_thread() is not threading.main_thread():
        warnings.warn("fastckpt.MemoryTier: persist_on needs the manager made in the main thread; not installed",
                      RuntimeWarning, stacklevel=4)
        return
    previous = signal.getsignal(sig)

    def handler(signum, frame):
        out: List[Any] = []

        def run():
            try:
                out.append(persist_newest(mgr, tier))
            except BaseException as e:  # noqa: BLE001 - logged; the previous handler still runs
                out.append(e)
        t = threading.Thread(target=run, name="fastckpt-persist", daemon=True)
        t.start()
        t.join(tier.cfg.persist_deadline)
        if t.is_alive():
            log.error("fastckpt.MemoryTier: persisting the newest snapshot on signal %d took longer than %.1f s; "
                      "giving up (the previous checkpoint stays)", signum, tier.cfg.persist_deadline)
        elif out and isinstance(out[0], BaseException):
            log.error("fastckpt.MemoryTier: persisting the newest snapshot on signal %d failed: %s", signum, out[0])
        elif out and out[0]:
            log.warning("fastckpt.MemoryTier: signal %d: saved %s from host memory", signum, out[0])
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(sig, handler)
    tier.persist_previous = (sig, previous, handler)


def quiesce(tier: Any) -> None:
    """Wait for the tier's background work (none: nothing to wait for)."""
    if tier is not None:
        tier.wait()


def close_tier(tier: Any) -> None:
    """The job is done: the persist handler uninstalled (the previous one back, if ours is still
    the signal's), the snapshots and replicas freed (none: nothing to do)."""
    if tier is None:
        return
    sig, previous, handler = getattr(tier, "persist_previous", (None, None, None))
    if sig is not None and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(sig) is handler:
        signal.signal(sig, previous)
    tier.persist_previous = (None, None, None)
    tier.clear()
