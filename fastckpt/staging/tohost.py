"""Host bytes of many tensors or storage ranges, streamed through bounded staging.

:class:`ToHost` is the pipeline: copies of later tensors run ahead of the
consumer into the pool's buffers (small ones packed into one buffer), nothing
synchronizes per tensor, and the consumer waits only for the event of the
buffer it is about to write. Its faces:

* :class:`Storages`: the storages of one save as host bytes on demand, whole
  or by range (a host storage: its own memory; a device storage: through
  ToHost; another accelerator's: one plain host copy); used by collective
  saves and, through :class:`DeviceStorages`, by ``fastckpt.save``;
* FastWriter's synchronous path uses ToHost directly (planner items).
"""

from collections import deque
from typing import Any, Callable, Deque, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from .device import PACK_ALIGN, Buf, bytes_view, copier_for, nbytes, pool_for

__all__ = ["ToHost", "Storages", "DeviceStorages", "LOOKAHEAD"]

LOOKAHEAD = 256     # items a ToHost resolves ahead of its consumer


class _Job:
    __slots__ = ("item", "src", "copier", "copied", "segs")

    def __init__(self, item, src, copier):
        self.item, self.src, self.copier = item, src, copier
        self.copied = 0
        self.segs: Deque[Tuple[Buf, int, int]] = deque()


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
        self._bufs: List[Buf] = []  # buffers this pipeline holds
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
        if c is not None and nbytes(t):
            self._to_copy.append(job)
        elif c is None and t is not None:
            self._host_queued += 1
        return True

    def _buffer_for(self, job: _Job, block: bool) -> Optional[Buf]:
        key = (job.copier, job.copier.device_key(job.src))
        if self._bufs:
            last = self._bufs[-1]
            if not last.closed and last.key == key and last.fill + PACK_ALIGN <= last.pool.chunk:
                return last
        pool = pool_for(job.copier, self._chunk)
        hb = pool.acquire(block=block and not any(b.pool is pool for b in self._bufs))
        if hb is None:
            return None
        b = Buf(hb, pool, key)
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
            src = bytes_view(job.src)
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
        n = nbytes(job.src)
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
                yield job.item, host, [bytes_view(host.contiguous())] if nbytes(host) else []
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


# A range of a storage: (storage index, start, length, ...the caller's fields).
Range = Tuple[Any, ...]


class Storages:
    """The storages of one save, as host bytes on demand.

    A rank of a collective save needs on the host only some byte ranges of
    the storages (its share, the next rank's share to checksum, sampled
    blocks, a lead's small records); ``fastckpt.save`` needs every device
    storage whole, in plan order. :meth:`ranges` hands out exactly those:

    * a CPU storage: a view of its own memory (no copy);
    * a storage on a device with a staging copier (CUDA, the tests' simulated
      device): through :class:`ToHost`, copied ahead into the bounded staging
      pool on the device's copy stream, each piece handed out only after its
      copy's event fired, the buffer reused once the piece is consumed. Host
      memory: the pool's buffers, not a host copy of the state;
    * a storage on another accelerator (no copier): one plain host copy
      (``.cpu()``), as a single-process save does.

    With `path` (the user's target), a failed device copy raises a
    RuntimeError that names the path, the storage and the range (the
    device's error chained); without, the device's error itself.
    """

    def __init__(self, storages: Sequence[torch.UntypedStorage], path: Optional[str] = None):
        self.path = path
        self.sizes = [s.nbytes() for s in storages]
        self._host: List[Optional[torch.Tensor]] = []  # uint8 host bytes, or None (staged)
        self._dev: List[Optional[torch.Tensor]] = []   # uint8 device view (staged), or None
        empty = torch.empty(0, dtype=torch.uint8)
        for s, n in zip(storages, self.sizes):
            if n and copier_for(s) is not None:
                self._host.append(None)
                self._dev.append(bytes_view(s))
                continue
            if not n:
                self._host.append(empty)
            elif s.device.type == "cpu":
                self._host.append(torch.empty(0, dtype=torch.uint8).set_(s))
            else:
                self._host.append(bytes_view(s.cpu()))
            self._dev.append(None)
        self.staged = any(d is not None for d in self._dev)

    def ranges(self, ranges: Sequence[Range],
               chunk: Optional[int] = None) -> Iterator[Tuple[Range, Iterator[torch.Tensor]]]:
        """(range, views) for every range of non-zero length, in order:
        `views` iterates the range's bytes as host uint8 views (one for a host
        storage). Each view is valid until the next one is taken, and the
        views of a range must be taken before the next range. Close the
        generator (``contextlib.closing``) when done or on error: that waits
        for the copies in flight and gives the staging buffers back."""
        staged = [r for r in ranges if r[2] and self._dev[r[0]] is not None]
        pipe = ToHost(staged, lambda r: self._dev[r[0]][r[1]:r[1] + r[2]], chunk) if staged else None
        stream = iter(pipe) if pipe is not None else None
        try:
            for r in ranges:
                k, start, n = r[0], r[1], r[2]
                if not n:
                    continue
                host = self._host[k]
                if host is not None:
                    yield r, iter((host if n == self.sizes[k] else host[start:start + n],))
                    continue
                try:
                    got, _, views = next(stream)
                except Exception as e:
                    self._raise(r, e)
                if got is not r:
                    raise RuntimeError("fastckpt: staged ranges out of order")
                yield r, self._checked(r, views)
        except BaseException:
            if pipe is not None:
                try:
                    pipe.close()
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
            raise
        if pipe is not None:
            try:
                pipe.close()
            except Exception as e:
                self._raise(None, e)

    def _checked(self, r: Range, views: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        while True:
            try:
                v = next(views)
            except StopIteration:
                return
            except Exception as e:
                self._raise(r, e)
            yield v

    def _raise(self, r: Optional[Range], e: BaseException) -> None:
        """Raise `e`, named after the user's path when there is one."""
        if self.path is None:
            raise e
        if r is not None:
            dev = self._dev[r[0]]
            what = f"bytes {r[1]}..{r[1] + r[2]} of storage data/{r[0]} (on {copier_for(dev).device_key(dev)})"
        else:
            what = "the storages' bytes"
        raise RuntimeError(f"cannot save to {self.path!r}: copying {what} to host memory failed: "
                           f"{type(e).__name__}: {e}") from e


class DeviceStorages:
    """fastckpt.save's use of :class:`Storages`: the device storages among a
    plan's payloads, copied ahead in plan order; ``write(sink, storage, crc)``
    writes the next one's bytes through ``sink.write_crc``."""

    def __init__(self, payloads: Iterable[Any], skip_data: bool = False):
        staged = [] if skip_data else [p for p in payloads if isinstance(p, torch.UntypedStorage) and p.nbytes()
                                       and copier_for(p) is not None]
        self._index = {id(p): k for k, p in enumerate(staged)}
        self._it = Storages(staged).ranges([(k, 0, p.nbytes()) for k, p in enumerate(staged)]) if staged else None
        self._left = len(staged)

    def owns(self, payload: Any) -> bool:
        return id(payload) in self._index

    def write(self, sink, payload, crc: int) -> int:
        (k, _, _), pieces = next(self._it)
        if k != self._index.get(id(payload)):  # the archive writes storages in plan order
            raise RuntimeError("fastckpt: device storages written out of order")
        for p in pieces:
            crc = sink.write_crc(p, crc)
        self._left -= 1
        return crc

    def release(self) -> None:
        """Wait for copies in flight and give the buffers back (after an error too)."""
        it, self._it = self._it, None
        if it is None:
            return
        if self._left == 0:
            next(it, None)  # every storage written: the pipeline's close raises what it found
        it.close()
