"""Snapshots: host copies of many tensors taken at one moment, in memory kept for reuse.

The one snapshot component of the staging layer. ``async_save`` (its
storages), ``FastWriter.stage`` (DCP's async staging of a state dict) and,
later, an in-memory tier all take their copies here:

* :meth:`Snapshotter.take` copies every source (tensor or UntypedStorage, on
  the host or a device) into one :class:`Arena` (one block of host memory,
  4 KiB aligned, each source on a 64-byte boundary and those of
  ``formats.zip.DIRECT_MIN`` bytes or more on a 4 KiB one, as their records
  are in a fastckpt file, so that the writer sends their bodies to the disk
  straight from the arena; rounded up to 1 MiB so
  that a state that grows a little reuses it) and returns a :class:`Snapshot`
  whose ``views`` are the copies, one per source (same shape and dtype);
* device sources are copied by :func:`snapshot_into`: each copy on its
  device's copy stream (:mod:`fastckpt.staging.device`), all issued before
  any is waited for, each then waited for on its own event; ``take`` returns
  once every copy is complete, so the caller may change its tensors;
* the arena is page-locked once through the device's copier when a source
  lives on a device (``cudaHostRegister`` of exactly its size: no
  power-of-two rounding, nothing of torch's caching host allocator);
* ``take(sources, defer_over=n)`` copies only the device sources and the
  host sources of at most ``n`` bytes before it returns; the larger host
  sources are copied by :meth:`Snapshot.complete`, which the caller runs
  later (on another thread: the background staging of ``async_save``). Until
  then the snapshot keeps those sources alive, and they must not change;
* :meth:`Snapshot.release` gives the arena back, once: a second release of
  the same snapshot (a late finalizer, an error path) is a no-op, so an arena
  that a newer snapshot took is never freed under it. Free arenas are kept
  for reuse (at most ``keep`` of them, and only those large enough for the
  last snapshot): taking the same state again allocates nothing.
"""

import logging
import threading
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from .. import _C
from ..formats.zip import DIRECT_MIN
from .device import ALIGN as PAGE, DeviceCopier, HostBuffer, arena_huge_pages, copier_for

log = logging.getLogger("fastckpt")

__all__ = ["Arena", "Snapshot", "Snapshotter", "snapshot_into", "copy_with_crcs", "flat", "fusable", "nbytes_of", "ALIGN",
           "ARENA_ROUND"]

ALIGN = 64               # each source starts on a cache line
ARENA_ROUND = 1 << 20    # arenas are rounded up to 1 MiB so small growth reuses them

Source = Union[torch.Tensor, torch.UntypedStorage]


def snapshot_into(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every (host dst, src) pair; device sources through their copier,
    asynchronously, then wait for all of them (each event on its own copy
    stream) and check the destinations. Host sources are copied directly."""
    events = []
    try:
        for dst, src in pairs:
            c = copier_for(src)
            if c is None:
                host_copy(dst, src if src.device.type == "cpu" else src.cpu())
            else:
                events.append((c, dst, c.to_host_async(dst, src)))
    finally:
        for c, dst, ev in events:
            ev.synchronize()
    for c, dst, _ in events:
        c.check_ready(dst)


SMALL_COPY = 8 << 20  # host copies up to this size: a memcpy on the calling thread


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors; a contiguous pair of the same dtype up to
    :data:`SMALL_COPY` bytes is a plain memcpy on this thread (``_C.copy_bytes``): torch's copy of
    more than 32768 elements wakes its intra-op thread pool, which costs more than a small copy
    (milliseconds where the training loop keeps every CPU busy, tens of them for the pool's start
    in a fresh process)."""
    if (dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()
            and src.device.type == "cpu" and dst.device.type == "cpu" and not src.is_conj() and not src.is_neg()
            and dst.numel() * dst.element_size() <= SMALL_COPY):
        _C.copy_bytes(dst, src)
    else:
        dst.copy_(src)


def fusable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether host `src` is copied into its arena view `dst` as plain bytes (and its CRC-32 taken
    on the way): both contiguous, of one dtype and shape, no lazy conjugate or negation."""
    return (dst.dtype == src.dtype and dst.shape == src.shape and src.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous() and not src.is_conj() and not src.is_neg())


def copy_with_crcs(jobs: Sequence[Tuple[int, torch.Tensor, torch.Tensor]],
                   crcs: Union[List[Optional[int]], Dict[int, int]]) -> None:
    """Copy each (source index, arena view, host source): the byte copies in one call that also
    takes each one's zip CRC-32 (``_C.copy_crc32_many``: 256 KiB copied, then folded from the cache,
    on as many threads as torch's intra-op pool has, no GIL; the CRC costs what the engine's CRC
    kernel takes, no second pass over memory in the writer: docs/ENGINE.md), recorded in
    ``crcs[index]``; the others with torch's copy (CRC None)."""
    fused = []
    for job in jobs:
        if fusable(job[1], job[2]):
            fused.append(job)
        else:
            host_copy(job[1], job[2])
    if fused:
        got = _C.copy_crc32_many([flat(d) for _, d, _ in fused], [flat(s) for _, _, s in fused],
                                 max(1, torch.get_num_threads()))
        for (i, _, _), c in zip(fused, got):
            crcs[i] = c


def _place(off: int, n: int) -> int:
    """Where in an arena a source of `n` bytes goes when the previous one ends at `off`: on a page
    from DIRECT_MIN bytes on (the phase of its record in a fastckpt file), else on a cache line."""
    a = PAGE if n >= DIRECT_MIN else ALIGN
    return (off + a - 1) // a * a


def _layout(sizes: List[int]) -> Tuple[List[int], int]:
    """Each source's offset in the arena (empty ones: -1), and the bytes the arena needs."""
    at, off = [], 0
    for n in sizes:
        if n == 0:
            at.append(-1)
            continue
        off = _place(off, n)
        at.append(off)
        off += n
    return at, off


def nbytes_of(s: Source) -> int:
    return s.nbytes() if isinstance(s, torch.UntypedStorage) else s.numel() * s.element_size()


def flat(t: Union[torch.Tensor, torch.UntypedStorage]) -> torch.Tensor:
    """A flat uint8 view of contiguous `t`."""
    if isinstance(t, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t)
    return t.reshape(-1).view(torch.uint8)


class Arena:
    """One snapshot's host memory: ``capacity`` bytes, 4 KiB aligned, page-locked through
    `copier` when the snapshot holds device sources (a :class:`HostBuffer`,
    unlocked and freed when the arena is dropped)."""
    __slots__ = ("buf", "pinned", "host", "copier")

    def __init__(self, nbytes: int, copier: Optional[DeviceCopier]):
        self.copier = copier
        self.host: Optional[HostBuffer] = copier.alloc_host(nbytes) if copier is not None else None
        self.buf = self.host.tensor if self.host is not None else \
            _C.empty_aligned(nbytes, PAGE, huge=arena_huge_pages(nbytes))
        self.pinned = copier is not None

    @property
    def capacity(self) -> int:
        return self.buf.numel()

    def holds(self, ptr: int) -> bool:
        """Whether host address `ptr` lies in this arena."""
        start = self.buf.data_ptr()
        return start <= ptr < start + self.buf.numel()


class Snapshot:
    """The copies of one :meth:`Snapshotter.take`: ``views`` (one per source,
    like it: an UntypedStorage for a storage, a tensor of the same shape and
    dtype for a tensor), ``nbytes`` (the sources' bytes), ``crcs`` (one per
    source: the zip CRC-32 of its copy's bytes, taken in the same pass as the
    copy, for host sources whose bytes are contiguous; None for the others,
    device sources among them) and the ``arena`` that holds them until
    :meth:`release`."""
    __slots__ = ("views", "nbytes", "arena", "pending", "crcs", "_owner", "_at", "__weakref__")

    def __init__(self, owner: "Snapshotter", arena: Optional[Arena], views: List[Source], nbytes: int):
        self._owner, self.arena, self.views, self.nbytes = owner, arena, views, nbytes
        self.pending: List[Tuple[int, torch.Tensor, torch.Tensor]] = []  # (source, copy, live source): not copied yet
        self.crcs: List[Optional[int]] = []
        self._at: Optional[Dict[int, Tuple[int, int]]] = None  # view address -> (bytes, index)

    def crc_of(self, t: torch.Tensor) -> Optional[int]:
        """The CRC-32 taken with the copy of the view that `t` is whole (contiguous, from the view's
        first byte to its last); None for any other tensor, or before the copy is complete."""
        if self.pending or not t.is_contiguous():
            return None
        if self._at is None:
            self._at = {v.data_ptr(): (nbytes_of(v), i) for i, v in enumerate(self.views) if nbytes_of(v)}
        hit = self._at.get(t.data_ptr())
        if hit is None or hit[0] != t.numel() * t.element_size():
            return None
        return self.crcs[hit[1]]

    def complete(self) -> None:
        """Copy the sources that ``take(..., defer_over=...)`` left for later
        (host sources: one pass of copy and CRC-32 without the GIL, see
        :func:`copy_with_crcs`), then forget them. Raises what a copy raised
        (the copies stay incomplete: the snapshot must then be released, not
        written)."""
        pending, self.pending = self.pending, []
        copy_with_crcs(pending, self.crcs)

    def copy_share(self, share: float) -> int:
        """Copy now, as :meth:`complete` does, the first of the pending sources
        that together make up at most ``share`` (0 to 1) of their bytes; the
        others stay pending. Returns the bytes copied. Raises what a copy
        raised (as :meth:`complete`)."""
        budget = share * sum(nbytes_of(src) for _, _, src in self.pending)
        n = done = 0
        while n < len(self.pending) and done + nbytes_of(self.pending[n][2]) <= budget:
            done += nbytes_of(self.pending[n][2])
            n += 1
        now, self.pending = self.pending[:n], self.pending[n:]
        copy_with_crcs(now, self.crcs)
        return done

    def release(self, keep: Optional[int] = 1) -> bool:
        """Give the arena back for reuse (see :meth:`Snapshotter.release`);
        returns whether this call did (False when released already)."""
        return self._owner.release(self, keep)


class Snapshotter:
    """Takes snapshots into host arenas that are reused across snapshots.

    ``allocations`` and ``allocated_bytes`` count what was ever allocated;
    ``free_bytes`` what is kept free for reuse; :meth:`clear` drops it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free: List[Arena] = []
        self._last_need = 0
        self._held: List[Snapshot] = []   # the snapshots not yet released (each holds its arena)
        self.allocations = 0
        self.allocated_bytes = 0

    # -- arenas

    def _acquire(self, need: int, copier: Optional[DeviceCopier]) -> Arena:
        with self._lock:
            self._last_need = need
            fits = [a for a in self._free if a.copier is copier and a.capacity >= need]
            if fits:
                arena = min(fits, key=lambda a: a.capacity)
                self._free.remove(arena)
                return arena
            # The state grew (or changed kind): smaller free arenas will not fit it again.
            self._free = [a for a in self._free if a.copier is not copier or a.capacity >= need]
        size = max(ARENA_ROUND, (need + ARENA_ROUND - 1) // ARENA_ROUND * ARENA_ROUND)
        arena = Arena(size, copier)
        with self._lock:
            self.allocations += 1
            self.allocated_bytes += size
        log.debug("fastckpt: new %s snapshot arena of %d bytes", "pinned" if copier is not None else "host", size)
        return arena

    def release(self, snap: Snapshot, keep: Optional[int] = 1) -> bool:
        """Give `snap`'s arena back, if `snap` still holds it (else a no-op,
        returning False). At most `keep` free arenas are kept (None: all),
        and only those large enough for the last snapshot."""
        with self._lock:
            arena, snap.arena = snap.arena, None
            if arena is None:
                return False
            self._held = [h for h in self._held if h is not snap]
            if arena.capacity >= self._last_need:
                self._free.insert(0, arena)
            if keep is not None:
                del self._free[max(keep, 0):]
            return True

    def owner_of(self, t: Source) -> Optional[Snapshot]:
        """The unreleased snapshot whose copy `t` is (or views), if any."""
        with self._lock:
            if not self._held:
                return None
            try:
                ptr = t.data_ptr()
            except Exception:  # a tensor without storage (meta, wrapper subclasses)
                return None
            return next((h for h in self._held if h.arena is not None and h.arena.holds(ptr)), None) if ptr else None

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(a.capacity for a in self._free)

    def clear(self) -> None:
        """Drop the free arenas (their memory goes once no snapshot uses them)."""
        with self._lock:
            self._free.clear()

    # -- snapshots

    def take(self, sources: Sequence[Source], defer_over: Optional[int] = None) -> Snapshot:
        """Copies of `sources` (see the module's docstring); returns once
        every copy is complete, but for the host sources of more than
        `defer_over` bytes, left to :meth:`Snapshot.complete`. Raises what a
        copy raised (the arena is given back)."""
        sizes = [nbytes_of(s) for s in sources]
        where, need = _layout(sizes)
        copier = next((c for c in map(copier_for, sources) if c is not None), None) if need else None
        arena = self._acquire(need, copier) if need else None
        snap = Snapshot(self, arena, [], sum(sizes))
        snap.crcs = [0 if n == 0 else None for n in sizes]
        try:
            snap.views = self._copy(arena, sources, sizes, where, defer_over, snap.pending, snap.crcs)
        except BaseException:
            self.release(snap, keep=None)
            raise
        if arena is not None:
            with self._lock:
                self._held.append(snap)
        return snap

    @staticmethod
    def _copy(arena: Optional[Arena], sources: Sequence[Source], sizes: List[int], where: List[int],
              defer_over: Optional[int], later: List[Tuple[int, torch.Tensor, torch.Tensor]],
              crcs: List[Optional[int]]) -> List[Source]:
        views: List[Source] = []
        pairs = []   # device sources: through their copiers
        host = []    # host sources now: (index, copy, source)
        whole = arena.buf.untyped_storage() if arena is not None else None
        base = arena.buf.storage_offset() if arena is not None else 0
        for i, (src, n, at) in enumerate(zip(sources, sizes, where)):
            storage = isinstance(src, torch.UntypedStorage)
            if n == 0:
                views.append(torch.UntypedStorage(0) if storage else torch.empty(src.shape, dtype=src.dtype))
                continue
            deferred = defer_over is not None and n > defer_over and src.device.type == "cpu"
            if storage:
                dst = whole[base + at:base + at + n]  # a storage viewing the arena, exactly n bytes
                views.append(dst)
                if deferred:
                    later.append((i, flat(dst), flat(src)))
                elif copier_for(src) is None and src.device.type == "cpu":
                    host.append((i, flat(dst), flat(src)))
                else:
                    pairs.append((flat(dst), flat(src)))
                continue
            view = arena.buf[at:at + n].view(src.dtype).view(src.shape)  # a tensor on the arena's storage
            views.append(view)
            c = copier_for(src)
            if deferred:
                later.append((i, view, src))  # host, any strides: later
            elif c is None:
                host.append((i, view, src))  # host (any strides) or another accelerator: synchronous
            else:
                pairs.append((flat(view), flat(c.contiguous(src))))
        copy_with_crcs(host, crcs)
        snapshot_into(pairs)  # returns once every copy is complete
        return views
