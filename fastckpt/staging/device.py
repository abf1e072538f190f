"""The device-copy interface and the host buffers it copies through.

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
* ``check_ready(view)`` / ``check_idle(view)``: hooks that the pipelines call
  where host bytes are handed to the engine and where a buffer is given back
  for reuse (no-ops on CUDA; the simulated device checks them).

The one stream/event discipline every user follows: a copy's host bytes are
read (``check_ready``) only after the event of that copy, or of a later copy
on the same copy stream, has been synchronized; a host buffer is reused or
freed (``check_idle``) only after the events of every copy into or out of it
have been synchronized. The pipelines that apply it:

* :mod:`fastckpt.staging.snapshot`: copies taken at one moment into host
  memory kept for reuse (async_save, DCP's async staging);
* :mod:`fastckpt.staging.tohost`: host bytes of many tensors or storage
  ranges, streamed through a bounded :class:`HostPool` (``fastckpt.save``,
  FastWriter's synchronous path, collective saves);
* :mod:`fastckpt.staging.todevice`: file ranges read into the pool and copied
  to device storages (device loads, the collective load).

Only CUDA is real here; no GPU ever ran this module's CUDA class in the
project's CI: the pipelines are tested on the simulated device
(tests/support/sim_device.py).
"""

import contextlib
import logging
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _C, knobs

log = logging.getLogger("fastckpt")

__all__ = ["DeviceCopier", "CudaCopier", "HostBuffer", "HostPool", "Buf", "copier_for", "copier_for_location",
           "register", "pool_for", "clear_pools", "default_chunk", "bytes_view", "nbytes", "arena_huge_pages"]

ALIGN = 4096        # host buffers start on a page
PACK_ALIGN = 64     # small tensors packed into one buffer start on a cache line
POOL_BUFFERS = 4    # buffers in a pool (x chunk bytes: the host memory one pool may hold)


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of contiguous `t` (a tensor or an UntypedStorage)."""
    if isinstance(t, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t)
    if t.dtype != torch.uint8 or t.dim() != 1:
        t = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
    return t


# ---------------------------------------------------------------- the interface

def arena_huge_pages(nbytes: int) -> bool:
    """Whether a snapshot arena (or a page-locked host buffer) of `nbytes` goes on transparent
    huge pages: knob ``snapshot_huge_pages`` (default 1) and at least ``_C.HUGE_JUDGE_MIN``
    bytes. A smaller arena's writes gain a few ms at most from huge pages, while its first
    touch pays for whole 2 MiB pages, zeroed and perhaps compacted for (one took 25-90 ms to
    fault in on a VM host that reclaims free memory, against about 1 ms for a 1 MiB state)."""
    return bool(knobs.get("snapshot_huge_pages")) and nbytes >= _C.HUGE_JUDGE_MIN


class HostBuffer:
    """`nbytes` of host memory, 4 KiB aligned, page-locked by `copier` while
    this object lives (or until :meth:`free`). ``tensor`` is the uint8 view;
    views of it stay valid after the buffer is freed (the memory then is
    plain pageable memory, released when the last view goes)."""

    __slots__ = ("tensor", "nbytes", "copier", "_fin", "__weakref__")

    def __init__(self, nbytes: int, copier: "DeviceCopier"):
        self.tensor = _C.empty_aligned(nbytes, ALIGN, huge=arena_huge_pages(nbytes))
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
        if hb is not None:
            return hb
        try:
            return self.copier.alloc_host(self.chunk)
        except BaseException:
            # the slot taken for this buffer is given back: a failed allocation (out of memory,
            # pinning refused) must not shrink the pool and leave a later acquire waiting forever
            with self._cv:
                self._made -= 1
                self.held_bytes -= self.chunk
                self._lent -= 1
                self._cv.notify()
            raise

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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------- a lent buffer

class Buf:
    """A pool buffer lent to one pipeline, with the events of the copies
    issued into or out of it since it was last waited for."""

    __slots__ = ("hb", "pool", "key", "fill", "events", "pending", "closed")

    def __init__(self, hb: HostBuffer, pool: HostPool, key: Any):
        self.hb, self.pool, self.key = hb, pool, key
        self.fill = 0
        self.events: List[Any] = []
        self.pending = 0     # segments copied into it, not yet consumed
        self.closed = False  # the consumer reached it: nothing more is packed in


def nbytes(t) -> int:
    """The bytes of tensor or storage `t` (0 for None)."""
    if t is None:
        return 0
    if isinstance(t, torch.UntypedStorage):
        return t.nbytes()
    return t.numel() * t.element_size()
