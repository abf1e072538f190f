"""The one staging component: host buffers and the device-copy interface.

Every copy between a device (CUDA, or the simulated device of the tests) and
host memory goes through a :class:`DeviceCopier`:

* ``to_host_async(dst_host, src_dev)`` issues the copy on a copy stream *of
  the source's device*, ordered after that device's current stream, and
  returns an event recorded on the stream that did the copy;
* ``to_device_async(dst_dev, src_host)`` likewise on the destination's device
  (whose current stream then waits for the copy, so later kernels see it);
* ``alloc_host(nbytes)`` returns a :class:`HostBuffer` of exactly that size
  (4 KiB aligned), page-locked once (``cudaHostRegister``; no power-of-two
  rounding, nothing cached behind the caller's back) and unlocked when it
  goes;
* ``check_ready(view)`` / ``check_idle(view)``: hooks that the pipeline calls
  where host bytes are handed to the engine and where a buffer is given back
  for reuse (no-ops on CUDA; the simulated device checks them).

On top of it, one host-staging face used by every path:

* :class:`ToHost`: the host bytes of many tensors, in order, through a
  bounded :class:`HostPool` (``fastckpt.save`` of device storages, FastWriter's
  synchronous path): copies run ahead of the consumer, small tensors are
  packed into one buffer, nothing synchronizes per tensor, and the consumer
  waits only for the event of the buffer it is about to write;
* :func:`snapshot_into`: copies into caller-owned exact-size buffers and
  waits (async_save's snapshot, FastWriter.stage);
* :func:`load_into_device`: file ranges read in chunks into the pool and
  copied to device storages while the next chunks are read (``fastckpt.load``
  with a device ``map_location``).

Only CUDA is real here; no GPU ever ran this module's CUDA class in the
project's CI: the pipeline is tested on the simulated device
(tests/python/sim_device.py).
"""

import contextlib
import logging
import threading
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from .. import _C

log = logging.getLogger("fastckpt")

__all__ = ["DeviceCopier", "CudaCopier", "HostBuffer", "HostPool", "ToHost", "copier_for", "copier_for_location",
           "register", "pool_for", "clear_pools", "snapshot_into", "load_into_device"]

ALIGN = 4096        # host buffers start on a page
PACK_ALIGN = 64     # small tensors packed into one buffer start on a cache line
POOL_BUFFERS = 4    # buffers in a pool (x chunk bytes: the host memory one pool may hold)
LOOKAHEAD = 256     # items a ToHost resolves ahead of its consumer


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of contiguous `t` (a tensor or an UntypedStorage)."""
    if isinstance(t, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t)
    if t.dtype != torch.uint8 or t.dim() != 1:
        t = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
    return t


# ---------------------------------------------------------------- the interface

class HostBuffer:
    """`nbytes` of host memory, 4 KiB aligned, page-locked by `copier` while
    this object lives (or until :meth:`free`). ``tensor`` is the uint8 view;
    views of it stay valid after the buffer is freed (the memory then is
    plain pageable memory, released when the last view goes)."""

    __slots__ = ("tensor", "nbytes", "copier", "_fin", "__weakref__")

    def __init__(self, nbytes: int, copier: "DeviceCopier"):
        self.tensor = _C.empty_aligned(nbytes, ALIGN)
        self.nbytes = nbytes
        self.copier = copier
        unpin = copier._lock_pages(self.tensor)
        self._fin = weakref.finalize(self, unpin) if unpin is not None else None

    def free(self) -> None:
        """Unlock the pages now (the copier checks that no copy uses them)."""
        self.copier.check_idle(self.tensor)
        if self._fin is not None:
            self._fin()


class DeviceCopier:
    """What the staging pipeline asks of a device. Subclasses: CudaCopier,
    and the simulated device of the tests."""

    def owns(self, t) -> bool:
        """Whether tensor or storage `t` lives on one of this copier's devices."""
        raise NotImplementedError

    def device_for(self, location: Any) -> Optional[Any]:
        """The device a ``map_location`` value or storage location tag names,
        if it is one of this copier's (else None)."""
        return None

    def empty_device(self, nbytes: int, device: Any) -> torch.UntypedStorage:
        raise NotImplementedError

    def device_key(self, t) -> Any:
        """A hashable name of `t`'s device (copies into one buffer share it)."""
        raise NotImplementedError

    def contiguous(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, or a contiguous copy of it on the same device."""
        return t.contiguous()

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor):
        raise NotImplementedError

    def to_device_async(self, dst: torch.Tensor, src: torch.Tensor):
        raise NotImplementedError

    def alloc_host(self, nbytes: int) -> HostBuffer:
        return HostBuffer(nbytes, self)

    def _lock_pages(self, t: torch.Tensor) -> Optional[Callable[[], None]]:
        """Page-lock `t`'s memory; returns the undo (or None)."""
        return None

    def check_ready(self, view: torch.Tensor) -> None:
        """Called on every host view just before it is handed to the engine."""

    def check_idle(self, view: torch.Tensor) -> None:
        """Called when a host buffer is given back for reuse or freed."""


class CudaCopier(DeviceCopier):
    """CUDA: one copy stream per device; events recorded on it."""

    def __init__(self):
        self._streams: Dict[int, Any] = {}
        self._lock = threading.Lock()
        self._register_ok = True

    def owns(self, t) -> bool:
        return t.device.type == "cuda"

    def device_key(self, t) -> Any:
        return t.device

    def device_for(self, location: Any) -> Optional[Any]:
        try:
            dev = torch.device(location)
        except (TypeError, RuntimeError, ValueError):
            return None
        if dev.type != "cuda" or not torch.cuda.is_available():
            return None  # torch's own path raises torch's error
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())

    def empty_device(self, nbytes: int, device: Any) -> torch.UntypedStorage:
        return torch.UntypedStorage(nbytes, device=device)

    def _stream(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            s = self._streams.get(idx)
            if s is None:
                s = self._streams[idx] = torch.cuda.Stream(device=idx)
        return s

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor):
        s = self._stream(src.device)
        s.wait_stream(torch.cuda.current_stream(src.device))  # after the kernels that made the data
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)  # the stream that did the copy, on the source's device
        src.record_stream(s)  # the allocator keeps src's memory until the copy is done
        return ev

    def to_device_async(self, dst: torch.Tensor, src: torch.Tensor):
        s = self._stream(dst.device)
        cur = torch.cuda.current_stream(dst.device)
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)
        cur.wait_event(ev)  # the caller's later kernels see the data
        dst.record_stream(s)
        return ev

    def _lock_pages(self, t: torch.Tensor) -> Optional[Callable[[], None]]:
        if not self._register_ok or t.numel() == 0 or not torch.cuda.is_available():
            return None
        cudart = torch.cuda.cudart()
        ptr = t.data_ptr()
        rc = int(cudart.cudaHostRegister(ptr, t.numel(), 1))  # cudaHostRegisterPortable
        if rc != 0:  # e.g. RLIMIT_MEMLOCK: pageable memory still works, the copies just do not overlap
            self._register_ok = False
            log.warning("fastckpt: cudaHostRegister of %d bytes failed (cudaError %d); "
                        "staging through pageable memory", t.numel(), rc)
            return None
        return lambda: cudart.cudaHostUnregister(ptr)


# ---------------------------------------------------------------- which copier

_cuda = CudaCopier()
_extra: List[DeviceCopier] = []


@contextlib.contextmanager
def register(copier: DeviceCopier):
    """Make `copier` own its devices' tensors for the duration (the simulated device)."""
    _extra.insert(0, copier)
    try:
        yield copier
    finally:
        _extra.remove(copier)


def copier_for(t) -> Optional[DeviceCopier]:
    """The copier of tensor or storage `t`'s device; None for host memory
    (and for other accelerators, which are copied with a plain ``.cpu()``)."""
    for c in _extra:
        if c.owns(t):
            return c
    if t.device.type == "cuda":
        return _cuda
    return None


def copier_for_location(location: Any) -> Optional[Tuple[DeviceCopier, Any]]:
    for c in _extra + [_cuda]:
        dev = c.device_for(location)
        if dev is not None:
            return c, dev
    return None


# ---------------------------------------------------------------- the pool

class HostPool:
    """At most `count` host buffers of `chunk` bytes, page-locked by `copier`
    once and reused across saves and loads. ``held_bytes`` is what the pool
    holds (allocated, free or lent); it never exceeds ``chunk * count``."""

    def __init__(self, copier: DeviceCopier, chunk: int, count: int):
        self.copier, self.chunk, self.count = copier, chunk, count
        self._cv = threading.Condition()
        self._free: List[HostBuffer] = []
        self._made = 0
        self.held_bytes = 0
        self.peak_lent = 0
        self._lent = 0

    def acquire(self, block: bool) -> Optional[HostBuffer]:
        with self._cv:
            while True:
                if self._free:
                    hb = self._free.pop()
                    break
                if self._made < self.count:
                    self._made += 1
                    self.held_bytes += self.chunk
                    hb = None
                    break
                if not block:
                    return None
                self._cv.wait()
            self._lent += 1
            self.peak_lent = max(self.peak_lent, self._lent)
        return hb if hb is not None else self.copier.alloc_host(self.chunk)

    def release(self, hb: HostBuffer) -> None:
        try:
            self.copier.check_idle(hb.tensor)
        finally:
            with self._cv:
                self._free.append(hb)
                self._lent -= 1
                self._cv.notify()

    def clear(self) -> None:
        """Free the buffers no pipeline holds."""
        with self._cv:
            free, self._free = self._free, []
            self._made -= len(free)
            self.held_bytes -= len(free) * self.chunk
        for hb in free:
            hb.free()


_pools: Dict[Tuple[int, int, int], HostPool] = {}
_pools_lock = threading.Lock()


def default_chunk() -> int:
    from .. import knobs
    return 4 * knobs.config().buffer_size


def pool_for(copier: DeviceCopier, chunk: Optional[int] = None, count: Optional[int] = None) -> HostPool:
    chunk = chunk or default_chunk()
    count = count or POOL_BUFFERS
    key = (id(copier), chunk, count)
    with _pools_lock:
        p = _pools.get(key)
        if p is None or p.copier is not copier:
            p = _pools[key] = HostPool(copier, chunk, count)
        return p


def clear_pools() -> None:
    """Free the pools' buffers that no save or load holds (page-locked memory
    is unlocked and returned); the next device save or load makes new ones."""
    with _pools_lock:
        pools = list(_pools.values())
    for p in pools:
        p.clear()


def _after_fork_in_child() -> None:
    global _pools_lock
    _pools_lock = threading.Lock()
    _pools.clear()
    _cuda._lock = threading.Lock()
    _cuda._streams.clear()


import os as _os  # noqa: E402
if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------- device -> host, many tensors

class _Buf:
    __slots__ = ("hb", "pool", "key", "fill", "events", "pending", "closed")

    def __init__(self, hb: HostBuffer, pool: HostPool, key: Any):
        self.hb, self.pool, self.key = hb, pool, key
        self.fill = 0
        self.events: List[Any] = []
        self.pending = 0     # segments copied into it, not yet consumed
        self.closed = False  # the consumer reached it: nothing more is packed in


class _Job:
    __slots__ = ("item", "src", "copier", "copied", "segs")

    def __init__(self, item, src, copier):
        self.item, self.src, self.copier = item, src, copier
        self.copied = 0
        self.segs: Deque[Tuple[_Buf, int, int]] = deque()


class ToHost:
    """The host bytes of many tensors, in order, through bounded staging.

    ``ToHost(items, tensor_of)``: ``tensor_of(item)`` is the item's tensor
    (or None). Iterating yields ``(item, tensor, pieces)`` in order, where
    ``pieces`` iterates the tensor's bytes as ready host uint8 views (one for a
    host tensor: the tensor itself; for a device tensor, views of pool
    buffers, each handed out only after its copy's event fired). Pieces must be
    consumed before the next item. Copies of later tensors run while earlier
    ones are written; at most the pool's buffers are used. :meth:`close` (also
    on error) waits for copies in flight and returns every buffer."""

    def __init__(self, items: Iterable[Any], tensor_of: Callable[[Any], Optional[torch.Tensor]] = lambda t: t,
                 chunk: Optional[int] = None):
        self._src = iter(items)
        self._tensor_of = tensor_of
        self._chunk = chunk
        self._jobs: Deque[_Job] = deque()      # pulled, not yet handed to the consumer
        self._to_copy: Deque[_Job] = deque()   # device jobs not yet copied in full, in order
        self._bufs: List[_Buf] = []  # buffers this pipeline holds
        self._host_queued = 0        # host tensors pulled, not yet handed out
        self._exhausted = False

    # -- copying ahead

    def _pull(self) -> bool:
        # Host tensors are not resolved more than one ahead (a planner may
        # materialize them, e.g. `fastckpt convert`); device ones up to LOOKAHEAD.
        if self._exhausted or len(self._jobs) >= LOOKAHEAD or self._host_queued >= 2:
            return False
        try:
            item = next(self._src)
        except StopIteration:
            self._exhausted = True
            return False
        t = self._tensor_of(item)
        c = copier_for(t) if t is not None else None
        job = _Job(item, t, c)
        self._jobs.append(job)
        if c is not None and _nbytes(t):
            self._to_copy.append(job)
        elif c is None and t is not None:
            self._host_queued += 1
        return True

    def _buffer_for(self, job: _Job, block: bool) -> Optional[_Buf]:
        key = (job.copier, job.copier.device_key(job.src))
        if self._bufs:
            last = self._bufs[-1]
            if not last.closed and last.key == key and last.fill + PACK_ALIGN <= last.pool.chunk:
                return last
        pool = pool_for(job.copier, self._chunk)
        hb = pool.acquire(block=block and not any(b.pool is pool for b in self._bufs))
        if hb is None:
            return None
        b = _Buf(hb, pool, key)
        self._bufs.append(b)
        return b

    def _fill(self, need: Optional[_Job] = None) -> None:
        """Issue copies ahead while buffers are free; blocks only when `need`
        (the job the consumer waits for) has nothing copied and this pipeline
        holds no buffer of its pool."""
        while True:
            while not self._to_copy:
                if not self._pull():
                    return
            job = self._to_copy[0]
            b = self._buffer_for(job, block=job is need and not job.segs)
            if b is None:
                return
            if job.copied == 0 and isinstance(job.src, torch.Tensor) and not job.src.is_contiguous():
                job.src = job.copier.contiguous(job.src)  # a device temporary only once its copy starts
            src = _bytes_view(job.src)
            n = min(src.numel() - job.copied, b.pool.chunk - b.fill)
            dst = b.hb.tensor[b.fill:b.fill + n]
            b.events.append(job.copier.to_host_async(dst, src[job.copied:job.copied + n]))
            job.segs.append((b, b.fill, n))
            b.pending += 1
            job.copied += n
            b.fill = min(b.pool.chunk, b.fill + n + (-n) % PACK_ALIGN)
            if job.copied == src.numel():
                self._to_copy.popleft()

    def _pieces(self, job: _Job) -> Iterator[torch.Tensor]:
        n = _nbytes(job.src)
        done = 0
        while done < n:
            if not job.segs:
                self._fill(need=job)
            b, off, k = job.segs.popleft()
            b.closed = True
            for ev in b.events:  # one device's stream: these are all this buffer's copies so far
                ev.synchronize()
            b.events = [e for e in b.events if not e.query()]
            view = b.hb.tensor[off:off + k]
            job.copier.check_ready(view)
            yield view
            done += k
            b.pending -= 1
            if b.pending == 0:
                self._bufs.remove(b)
                b.pool.release(b.hb)
            self._fill()

    def __iter__(self):
        self._fill()
        while True:
            if not self._jobs and not self._pull():
                return
            job = self._jobs[0]
            if job.src is None:
                self._jobs.popleft()
                yield job.item, None, None
                continue
            if job.copier is None:
                self._jobs.popleft()
                self._host_queued -= 1
                host = job.src
                yield job.item, host, [_bytes_view(host.contiguous())] if _nbytes(host) else []
                continue
            pieces = self._pieces(job)
            yield job.item, job.src, pieces
            for _ in pieces:  # the consumer did not take every piece (e.g. an empty record)
                pass
            self._jobs.popleft()

    def close(self) -> None:
        """Wait for every copy in flight and give the buffers back."""
        bufs, self._bufs = self._bufs, []
        self._jobs.clear()
        self._to_copy.clear()
        self._host_queued = 0
        error = None
        for b in bufs:
            try:
                for ev in b.events:
                    ev.synchronize()
            finally:
                try:
                    b.pool.release(b.hb)
                except BaseException as e:  # every buffer goes back; the first error is raised
                    error = error or e
        if error is not None:
            raise error


def _nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, torch.UntypedStorage):
        return t.nbytes()
    return t.numel() * t.element_size()


class DeviceStorages:
    """fastckpt.save's use of :class:`ToHost`: the device storages among a
    plan's payloads, copied ahead in plan order; ``write(sink, storage, crc)``
    writes the next one's bytes through ``sink.write_crc``."""

    def __init__(self, payloads: Iterable[Any], skip_data: bool = False):
        staged = [] if skip_data else [p for p in payloads if isinstance(p, torch.UntypedStorage) and p.nbytes()
                                       and copier_for(p) is not None]
        self._ids = {id(p) for p in staged}
        self._pipe = ToHost(staged) if staged else None
        self._it = iter(self._pipe) if staged else None

    def owns(self, payload: Any) -> bool:
        return id(payload) in self._ids

    def write(self, sink, payload, crc: int) -> int:
        item, _, pieces = next(self._it)
        if item is not payload:  # the archive writes storages in plan order
            raise RuntimeError("fastckpt: device storages written out of order")
        for p in pieces:
            crc = sink.write_crc(p, crc)
        return crc

    def release(self) -> None:
        """Wait for copies in flight and give the buffers back (after an error too)."""
        if self._pipe is not None:
            self._it.close()
            self._pipe.close()
            self._pipe = self._it = None


# ---------------------------------------------------------------- copies into caller-owned buffers

def snapshot_into(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every (host dst, src) pair; device sources through their copier,
    asynchronously, then wait for all of them (each event on its own copy
    stream) and check the destinations. Host sources are copied directly."""
    events = []
    try:
        for dst, src in pairs:
            c = copier_for(src)
            if c is None:
                dst.copy_(src if src.device.type == "cpu" else src.cpu())
            else:
                events.append((c, dst, c.to_host_async(dst, src)))
    finally:
        for c, dst, ev in events:
            ev.synchronize()
    for c, dst, _ in events:
        c.check_ready(dst)


# ---------------------------------------------------------------- file -> host -> device

class LoadJob:
    """One record to load: `nbytes` at file offset `offset` into device storage `dst`."""
    __slots__ = ("name", "offset", "nbytes", "dst", "copier", "crc")

    def __init__(self, name: str, offset: int, nbytes: int, dst: torch.UntypedStorage, copier: DeviceCopier):
        self.name, self.offset, self.nbytes, self.dst, self.copier = name, offset, nbytes, dst, copier
        self.crc = 0


def load_into_device(read: Callable[[List[Tuple[torch.Tensor, int]], bool], Optional[List[int]]],
                     jobs: List[LoadJob], crc: bool = False, chunk: Optional[int] = None) -> None:
    """Fill every job's device storage from the file: ``read(ranges, crc)``
    reads (host view, file offset) ranges into pool buffers (one buffer's worth
    per call, small records packed into one buffer) and, with `crc`, returns
    the CRC-32 of each range (the engine computes them during the reads, on
    its thread); each piece is then copied to its device asynchronously while
    the next buffer is read. A buffer is read into again only after its copies'
    events fired. With `crc`, each job's ``crc`` is the CRC-32 of its bytes
    (its pieces' CRCs combined). Host memory: the pool's buffers, whatever the
    file's size."""
    jobs = sorted((j for j in jobs if j.nbytes), key=lambda j: j.offset)
    if not jobs:
        return
    ring: List[_Buf] = []
    pools: Dict[int, HostPool] = {}
    try:
        pos = 0  # bytes of jobs[ji] already read
        ji = 0
        turn = 0
        while ji < len(jobs):
            copier = jobs[ji].copier
            pool = pools.setdefault(id(copier), pool_for(copier, chunk))
            mine = [x for x in ring if x.pool is pool]
            b = None
            if len(mine) < pool.count:
                hb = pool.acquire(block=not mine)
                if hb is not None:
                    b = _Buf(hb, pool, id(copier))
                    ring.append(b)
            if b is None:  # reuse the oldest of this pipeline's buffers once its copies are done
                b = mine[turn % len(mine)]
                turn += 1
                for ev in b.events:
                    ev.synchronize()
                b.events = []
                b.pool.copier.check_idle(b.hb.tensor)
            fill = 0
            pieces = []  # (host view, file offset, job, offset in record)
            while ji < len(jobs) and fill < b.pool.chunk and jobs[ji].copier is b.pool.copier:
                j = jobs[ji]
                n = min(j.nbytes - pos, b.pool.chunk - fill)
                pieces.append((b.hb.tensor[fill:fill + n], j.offset + pos, j, pos))
                fill += n + (-n) % PACK_ALIGN
                pos += n
                if pos == j.nbytes:
                    ji, pos = ji + 1, 0
            crcs = read([(v, off) for v, off, _, _ in pieces], crc)
            for i, (v, _, j, at) in enumerate(pieces):
                if crc:
                    j.crc = crcs[i] if at == 0 else _C.crc32_combine(j.crc, crcs[i], v.numel())
                dst = _bytes_view(j.dst)[at:at + v.numel()]
                b.events.append(j.copier.to_device_async(dst, v))
    finally:
        for b in ring:
            for ev in b.events:
                ev.synchronize()
            b.pool.release(b.hb)


# ---------------------------------------------------------------- round by round (the collective load)

class RoundRing:
    """Host staging for a pipeline that goes round by round (the collective
    load onto devices): ``depth`` slots of ``nbuf`` buffers each, from one
    :class:`HostPool` of `copier` (page-locked once, reused across loads).
    :meth:`next` hands out the slot for the next round; a slot comes back
    round after round, each time only after every copy issued from it (the
    events its buffers carry) has completed and the copier found it idle.
    Host memory: ``depth * nbuf * chunk`` bytes, whatever the checkpoint's
    size. :meth:`close` (also on error) waits for copies in flight and gives
    every buffer back."""

    def __init__(self, copier: DeviceCopier, nbuf: int, depth: int, chunk: Optional[int] = None):
        self.depth, self.nbuf = depth, nbuf
        self.pool = pool_for(copier, chunk, count=depth * nbuf)
        self.chunk = self.pool.chunk
        self._slots: List[List[_Buf]] = []
        self._n = 0

    def next(self, on_error: Optional[Callable[[BaseException], None]] = None) -> List[_Buf]:
        """The next round's buffers (``b.hb.tensor``: the host memory; append
        the event of every copy issued from it to ``b.events``). With
        `on_error`, a failure while waiting for the slot's copies (a copy
        that failed on the device) goes to it and the slot is handed out
        anyway: the caller still needs memory to take part in a collective,
        and must copy nothing more from it."""
        if len(self._slots) < self.depth:
            bufs: List[_Buf] = []
            self._slots.append(bufs)
            for _ in range(self.nbuf):
                bufs.append(_Buf(self.pool.acquire(block=True), self.pool, None))
        else:
            bufs = self._slots[self._n % self.depth]
            try:
                for b in bufs:
                    for ev in b.events:
                        ev.synchronize()
                    b.events = []
                    self.pool.copier.check_idle(b.hb.tensor)
            except Exception as e:
                if on_error is None:
                    raise
                on_error(e)
        self._n += 1
        return bufs

    def close(self) -> None:
        """Wait for every copy in flight and give the buffers back (the first error is raised)."""
        slots, self._slots = self._slots, []
        error = None
        for bufs in slots:
            for b in bufs:  # every buffer goes back; the first error is raised
                try:
                    for ev in b.events:
                        ev.synchronize()
                    b.events = []
                except BaseException as e:
                    error = error or e
                try:
                    self.pool.release(b.hb)
                except BaseException as e:
                    error = error or e
        if error is not None:
            raise error
