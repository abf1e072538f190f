"""File -> host -> device: the staging of loads onto devices.

:func:`load_into_device` reads file ranges into the pool's buffers and copies
each piece to its device storage while the next buffer is read (``fastckpt.load``
and the safetensors loader with a device ``map_location``); :class:`RoundRing`
hands out host buffers round by round (the collective load onto devices).
Both follow the discipline of :mod:`fastckpt.staging.device`: a buffer is read
into again only after the events of its copies fired.
"""

from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import _C
from .device import PACK_ALIGN, Buf, DeviceCopier, HostPool, bytes_view, pool_for

__all__ = ["LoadJob", "load_into_device", "RoundRing"]


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
    ring: List[Buf] = []
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
                    b = Buf(hb, pool, id(copier))
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
                dst = bytes_view(j.dst)[at:at + v.numel()]
                b.events.append(j.copier.to_device_async(dst, v))
    finally:
        for b in ring:
            for ev in b.events:
                ev.synchronize()
            b.pool.release(b.hb)


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
        self._slots: List[List[Buf]] = []
        self._n = 0

    def next(self, on_error: Optional[Callable[[BaseException], None]] = None) -> List[Buf]:
        """The next round's buffers (``b.hb.tensor``: the host memory; append
        the event of every copy issued from it to ``b.events``). With
        `on_error`, a failure while waiting for the slot's copies (a copy
        that failed on the device) goes to it and the slot is handed out
        anyway: the caller still needs memory to take part in a collective,
        and must copy nothing more from it."""
        if len(self._slots) < self.depth:
            bufs: List[Buf] = []
            self._slots.append(bufs)
            for _ in range(self.nbuf):
                bufs.append(Buf(self.pool.acquire(block=True), self.pool, None))
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
