"""The memory tier: snapshots of a rank's state in host memory, replicated to peers on other nodes.

:class:`MemoryTier` is the user's configuration; a :class:`CheckpointManager`
binds it (:meth:`MemoryTier.bind`) to its directory, rank and groups as a
:class:`BoundTier`, which owns:

* the rank's slot directory ``<memory dir>/<namespace>/rank<R>`` and one
  ``replica<S>`` directory per rank S whose replicas it keeps
  (:mod:`fastckpt.memory.slots`); the namespace is derived from the manager's
  directory, so a restarted job finds its own;
* :meth:`BoundTier.snapshot`, which pickles the state and writes the archive
  into a reused slot in the caller's thread (device tensors through the
  staging pool), then queues the CRC-32, the commit record and the
  replication for one background thread;
* the replication (:mod:`fastckpt.memory.replicas`), on a gloo group reserved for it.

Restoring (choosing the step every rank can restore, fetching what a rank
lacks) is the manager's business (fastckpt/manager/memory.py), over the
methods here.
"""

import collections
import errno
import hashlib
import json
import logging
import os
import pickle
import socket
import threading
import time
from typing import Any, Dict, List, Optional

from torch.serialization import DEFAULT_PROTOCOL

from .._core import engine as _engine
from .._core.atomic import write_file
from .._core.units import human
from ..formats import torch_rules as _torch_rules
from ..formats.pickler import pickle_with_storages
from ..formats.archive import plan_archive
from ..torchsave.writer import write_archive
from .replicas import Peers, exchange
from .slots import RECORD_VERSION, MappedFile, Record, SlotDir

log = logging.getLogger("fastckpt")

__all__ = ["MemoryTier", "BoundTier", "memory_root", "namespace_of", "OWNER_FILE"]

OWNER_FILE = "owner.json"
_DEFAULT_ROOT = "/dev/shm/fastckpt"


def memory_root(directory: Optional[str] = None) -> str:
    """The memory directory: `directory`, else ``FASTCKPT_MEMORY_DIR``, else /dev/shm/fastckpt."""
    return os.path.abspath(directory or os.environ.get("FASTCKPT_MEMORY_DIR") or _DEFAULT_ROOT)


def namespace_of(ckpt_dir: str) -> str:
    """The namespace of a checkpoint directory: its name and a hash of its real path."""
    real = os.path.realpath(os.fspath(ckpt_dir))
    base = "".join(c if c.isalnum() or c in "-_." else "_" for c in os.path.basename(real))[:40] or "root"
    return f"{base}-{hashlib.sha256(real.encode()).hexdigest()[:16]}"


class MemoryTier:
    """Snapshots in host memory, replicated to peer nodes (for :class:`fastckpt.CheckpointManager`).

    Args:
        keep: snapshots kept per rank (at least 1; 2, the default, keeps the
            previous one complete while a new one is written).
        replicas: ranks on other nodes that keep a copy of each of this
            rank's snapshots (0: none). Nodes come from torchrun's
            ``GROUP_RANK`` (else the host name); rank r's replicas go to the
            same local rank on the next ``replicas`` nodes.
        persist_on: a signal (``signal.SIGTERM``) on which the newest snapshot
            not yet on disk is saved durably through the manager (``latest``
            moved), before the previous handler runs.
        persist_deadline: seconds the persist on that signal may take.
        directory: the memory directory (default ``FASTCKPT_MEMORY_DIR``, else
            ``/dev/shm/fastckpt``); it should be a tmpfs.
        verify: check a snapshot's CRC-32 before restoring it.
    """

    def __init__(self, keep: int = 2, replicas: int = 1, *, persist_on: Optional[int] = None,
                 persist_deadline: float = 60.0, directory: Optional[str] = None, verify: bool = True):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"MemoryTier: keep must be an int >= 1 (got {keep!r})")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ValueError(f"MemoryTier: replicas must be an int >= 0 (got {replicas!r})")
        if persist_deadline is not None and persist_deadline <= 0:
            raise ValueError(f"MemoryTier: persist_deadline must be positive (got {persist_deadline!r})")
        self.keep, self.replicas = keep, replicas
        self.persist_on, self.persist_deadline = persist_on, persist_deadline
        self.directory, self.verify = directory, verify
        self.bound: Optional["BoundTier"] = None

    def bind(self, ckpt_dir: str, rank: int, peers: Peers, group: Any) -> "BoundTier":
        """Made by the manager (once per tier)."""
        if self.bound is not None:
            raise ValueError("MemoryTier: this tier already serves a CheckpointManager; make one per manager")
        self.bound = BoundTier(self, ckpt_dir, rank, peers, group)
        return self.bound

    def clear(self) -> None:
        """Free this rank's snapshots and the replicas it keeps (after its background work)."""
        if self.bound is not None:
            self.bound.clear()


class _Job:
    __slots__ = ("slots", "record", "done", "error")

    def __init__(self, slots: SlotDir, record: Optional[Record]):
        self.slots, self.record = slots, record
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


class BoundTier:
    """A :class:`MemoryTier` serving one manager on one rank (see the module's docstring)."""

    def __init__(self, cfg: MemoryTier, ckpt_dir: str, rank: int, peers: Peers, group: Any):
        self.cfg = cfg
        self.rank = rank
        self.peers = peers
        self.group = group if peers.sends or peers.receives else None
        self.root = memory_root(cfg.directory)
        self.ns_path = os.path.join(self.root, namespace_of(ckpt_dir))
        self.ckpt_dir = os.path.realpath(os.fspath(ckpt_dir))
        self.own = SlotDir(os.path.join(self.ns_path, f"rank{rank}"), cfg.keep)
        self.replica_dirs = {s: SlotDir(os.path.join(self.ns_path, f"replica{s}"), cfg.keep) for s in peers.receives}
        self._jobs: "collections.deque[_Job]" = collections.deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._checked = False
        self.last: Optional[Record] = None          # the newest snapshot written by this process
        self.last_error: Optional[BaseException] = None
        self.stats: Dict[str, float] = {}
        os.makedirs(self.own.path, mode=0o700, exist_ok=True)
        self._claim()

    # ------------------------------------------------------------ ownership (for doctor / clean-memory)
    def _claim(self) -> None:
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "directory": self.ckpt_dir, "rank": self.rank,
                 "since": time.time()}
        write_file(os.path.join(self.own.path, OWNER_FILE), json.dumps(owner).encode())

    # ------------------------------------------------------------ memory check
    def check_memory(self, nbytes: int) -> None:
        """Before the first snapshot: room for keep x this state plus the replicas kept
        for peers (taken as large as this one), in the memory directory and in RAM."""
        keep, n_rep = self.cfg.keep, len(self.peers.receives)
        need = keep * nbytes + n_rep * keep * nbytes
        held = self.own.held_bytes() + sum(d.held_bytes() for d in self.replica_dirs.values())
        st = os.statvfs(self.own.path)
        free_dir = st.f_bavail * st.f_frsize + held
        free_ram = _mem_available() + held
        if need > min(free_dir, free_ram):
            raise OSError(errno.ENOMEM,
                          f"fastckpt.MemoryTier: snapshots need {human(need)} of host memory ({keep} x this rank's "
                          f"{human(nbytes)} state + {n_rep} x {keep} replicas of peers' states), but the memory "
                          f"directory has {human(free_dir)} free and the machine {human(free_ram)} available; "
                          f"lower keep= or replicas=, or set FASTCKPT_MEMORY_DIR (or MemoryTier(directory=)) "
                          f"to a larger tmpfs", self.root)

    # ------------------------------------------------------------ snapshots
    def snapshot(self, step: int, state: Any) -> Record:
        """Write `state` as the snapshot of `step` into a slot; returns once its bytes are in
        host memory and the previous snapshot is committed here and on the peers (this
        one's CRC, commit and replication follow in the background: one round at most)."""
        t0 = time.perf_counter()
        data_pkl, storages = pickle_with_storages(state, pickle, DEFAULT_PROTOCOL)
        opts = dict(alignment=_torch_rules.storage_alignment(), byteorder=True)
        try:
            nbytes = plan_archive(data_pkl, storages, opts["alignment"], True)[3]
            if not self._checked:
                self.check_memory(nbytes)
                self._checked = True
            k = self._take_slot(step)
            f = MappedFile(self.own.mapping(k, nbytes))  # each record one memcpy into the slot's pages
            entries = write_archive(f, data_pkl, storages, compute_crc32=False, **opts)
            if f.pos != nbytes:
                raise RuntimeError(f"fastckpt.MemoryTier: wrote {f.pos} bytes of a {nbytes}-byte snapshot")
        except BaseException:
            if self.group is not None:
                self._queue(_Job(self.own, None))  # the peers still get this round (nothing to keep)
            raise
        by_name = {e.name.split("/", 1)[1]: e for e in entries}  # "<archive>/data/3" -> "data/3"
        pkl = by_name["data.pkl"]
        spans = [[by_name[f"data/{i}"].data_offset, by_name[f"data/{i}"].size] for i in range(len(storages))]
        rec = Record(version=RECORD_VERSION, step=step, rank=self.rank, nbytes=nbytes, crc=0, slot=k, pkl=[pkl.data_offset, pkl.size],
                     storages=spans, opts=opts, time=time.time())
        self.last = rec
        self.wait()  # the previous snapshot committed here and on the peers: one round in flight at most
        self.stats["snapshot_s"] = time.perf_counter() - t0
        self._queue(_Job(self.own, rec))
        return rec

    def _take_slot(self, step: int) -> int:
        """A slot for `step`: never one a background job still works on, nor (keep > 1)
        the newest complete one; snapshots of steps >= `step` are dropped (a new branch)."""
        while True:
            with self._cv:
                jobs = [j.record for j in self._jobs if j.slots is self.own and j.record is not None]
            if any(r.step >= step for r in jobs):  # a new branch: the newer snapshot in flight is dropped once done
                self._wait_one()
                continue
            k = self.own.take_for(step, tuple(r["slot"] for r in jobs))
            if k is not None:
                return k
            self._wait_one()

    # ------------------------------------------------------------ the background thread
    def _queue(self, job: _Job) -> None:
        with self._cv:
            self._jobs.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fastckpt-memory", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._jobs:
                    self._thread = None
                    self._cv.notify_all()
                    return
                job = self._jobs[0]
            try:
                self._finish(job)
            except BaseException as e:  # noqa: BLE001 - kept, logged; the snapshot stays incomplete
                job.error = self.last_error = e
                log.error("fastckpt.MemoryTier: snapshot of step %s on rank %d failed: %s",
                          job.record.step if job.record is not None else "?", self.rank, e)
            finally:
                with self._cv:
                    self._jobs.popleft()
                    job.done.set()
                    self._cv.notify_all()

    def _finish(self, job: _Job) -> None:
        rec = job.record
        t0 = time.perf_counter()
        committed = None
        try:
            if rec is None:
                return
            rec["crc"] = _engine.crc32(job.slots.view(rec["slot"], rec["nbytes"])) if rec["nbytes"] else 0
            job.slots.write_record(rec)  # complete from now on
            committed = rec
            self.stats["commit_s"] = time.perf_counter() - t0
        finally:
            if self.group is not None:  # the peers wait for this round, also when this rank's snapshot failed
                t1 = time.perf_counter()
                exchange(self, committed)
                self.stats["replicate_s"] = time.perf_counter() - t1

    def _wait_one(self) -> None:
        with self._cv:
            if self._jobs:
                self._cv.wait(timeout=1.0)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until every snapshot of this process is committed and replicated."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._jobs or self._thread is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(timeout=left)
        return True

    # ------------------------------------------------------------ what this rank holds
    def holdings(self) -> Dict[str, Any]:
        """What this rank can give for a restore: its own steps and, per peer rank, the replicas' steps."""
        return {"own": sorted({r.step for r in self.own.records()}),
                "replicas": {s: sorted({r.step for r in d.records()}) for s, d in self.replica_dirs.items()}}

    def slot_of(self, slots: SlotDir, step: int) -> Optional[Record]:
        return next((r for r in slots.records() if r.step == step), None)

    def drop_newer(self, step: int) -> None:
        """Snapshots of steps above `step` (own and replicas): an abandoned branch after a restore."""
        for d in [self.own, *self.replica_dirs.values()]:
            for r in d.records():
                if r.step > step:
                    d.remove(r["slot"])

    def clear(self) -> None:
        self.wait()
        for d in [self.own, *self.replica_dirs.values()]:
            d.clear()
        try:
            os.unlink(os.path.join(self.own.path, OWNER_FILE))
        except FileNotFoundError:
            pass
        for p in (self.own.path, self.ns_path):
            try:
                os.rmdir(p)
            except OSError:
                pass
        self._checked = False
        self.last = None


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
