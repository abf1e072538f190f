"""Writing a snapshot's large host sources straight from the live tensors, up to a fence.

Background staging (``async_save(..., background_staging=True)``) returns before the large host
tensors are copied, and they must not change until the *fence*: the next ``optimizer.step()``
(a global step pre-hook) or :func:`fastckpt.wait_staged`. A source whose memory already sits at
the phase of its record in the file (page-aligned: torch allocates tensors of 2 MiB and more so
under ``THP_MEM_ALLOC_ENABLE=1``) need not be copied at all while the loop's forward and backward
passes leave it unchanged: the writer thread sends it to the disk from where it lies (O_DIRECT,
lent to the engine) and takes its CRC-32 on the way. Only what the writer has not taken when the
fence comes is copied, by the fence, into the snapshot's arena (with its CRC-32, as every snapshot
copy): the sources it has not started and the rest of the one it is sending, from the first piece
not yet handed to a write. The fence then waits until no write in flight reads the live memory, and
the writer goes on from the arena, joining the CRC-32 of the pieces it sent with the fence's CRC-32
of the rest (``crc32_combine``). A checkpoint whose write ends before the fence copies nothing.

:class:`Through` is that hand-over for one snapshot. The writer sends each such source with
:meth:`Through.source`'s ``write_into(sink)`` (in pieces of :data:`PIECE` bytes; before each one
it checks for the fence), then :meth:`Through.finish` once the archive is written or has failed.
:meth:`Through.fence` is the fence's side. ``done`` is set once nothing of this mechanism reads
the live tensors any more: every source sent and drained, or the fence's copies made and the
writer's live requests drained, or the writer stopped.
"""

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import _C
from .snapshot import copy_with_crcs, flat, fusable, nbytes_of
from .device import ALIGN as PAGE

__all__ = ["Through", "Waited", "eligible", "PIECE"]

PIECE = 16 << 20  # bytes sent from live memory between two looks for the fence

Item = Tuple[int, torch.Tensor, torch.Tensor]  # (source index, arena view, live host source)


def eligible(view: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether host source `src` can be written straight from its memory in place of its arena copy
    `view`: plain contiguous bytes of the same dtype and shape, on the host, and at the same phase
    within a page as the view (which sits at its record's phase in the file)."""
    if not isinstance(src, torch.Tensor) or not fusable(view, src):
        return False
    return src.data_ptr() % PAGE == view.data_ptr() % PAGE


class _Source:
    """One source as the archive writer takes it: ``nbytes()`` and ``write_into(sink) -> crc``."""
    __slots__ = ("_h", "_i", "_n")

    def __init__(self, h: "Through", i: int, n: int):
        self._h, self._i, self._n = h, i, n

    def nbytes(self) -> int:
        return self._n

    def write_into(self, sink) -> int:
        return self._h._send(self._i, sink)


class Through:
    """The hand-over of one snapshot's `items` between the writer thread and the fence (see the
    module's docstring)."""

    def __init__(self, items: Sequence[Item]):
        self._cv = threading.Condition()
        self._items = {i: (view, src) for i, view, src in items}
        self._taken: Dict[int, int] = {}    # source -> bytes the writer has handed to writes
        self._rest_crcs: Dict[int, int] = {}  # source -> CRC-32 of the part the fence copied
        self._left = set(self._items)       # sources not yet wholly sent
        self._switched = False              # the fence came: from here the writer sends arena copies only
        self._copied = threading.Event()    # the fence's copies are made (or failed)
        self._copy_error: Optional[BaseException] = None
        self._fencing = False               # the fence is copying (it reads the live tensors)
        self._lent = False                  # live memory lent to writes that may still be in flight
        self._stopped = False               # the writer is done with this snapshot
        self.done = threading.Event()       # nothing here reads the live tensors any more
        self.live_bytes = 0                 # bytes sent straight from the live tensors
        self.copied_bytes = 0               # bytes the fence copied into the arena

    @property
    def fenced(self) -> bool:
        """Whether the fence came before every source was sent and drained (it copied what was left,
        if anything, and waited for the writes in flight)."""
        return self._switched

    def source(self, i: int) -> _Source:
        """What the archive writer writes for source `i` (its ``write_into`` sends the bytes)."""
        view, _ = self._items[i]
        return _Source(self, i, view.numel() * view.element_size())

    # -- the writer's side

    def _send(self, i: int, sink) -> int:
        view, src = self._items[i]
        live, copy = flat(src), flat(view)
        n, off, crc = live.numel(), 0, 0
        while off < n:
            k = min(PIECE, n - off)
            with self._cv:
                go = not self._switched
                if go:  # taken: the fence copies only what follows this piece
                    self._lent = True
                    self._taken[i] = off + k
            if go:
                crc = sink.write_crc(live[off:off + k], crc, borrow=True)
                off += k
                self.live_bytes += k
                continue
            # The fence came: it copied this source from `off` on (every piece before it was handed
            # to a write). Once no write reads the live memory any more, the rest goes from the arena.
            self._release(sink)
            self._copied.wait()
            if self._copy_error is not None:
                raise self._copy_error
            rest = self._rest_crcs.get(i)
            if rest is None or not getattr(sink, "checksums", True):
                crc = sink.write_crc(copy[off:], crc, borrow=True)
            else:
                # The fence took the CRC-32 of the rest with its copy: joined to the pieces' CRC-32,
                # no second pass over memory here.
                sink.write(copy[off:], borrow=True)
                crc = rest if off == 0 else _C.crc32_combine(crc, rest, n - off)
            off = n
        with self._cv:
            self._left.discard(i)
            last = not self._left
        if last:  # every source sent: once drained, nothing reads the live tensors
            self._release(sink)
        return crc

    def wait_beside(self, ready: threading.Event, sink) -> None:
        """Wait for `ready` (the staging thread's copy of the source the writer writes next); if the
        fence comes meanwhile (or came), let go of the live memory first, so that the fence waits
        neither for that copy nor for that source's writes."""
        while True:
            with self._cv:
                fenced = self._switched and self._lent
            if fenced:
                self._release(sink)
            if ready.wait(0 if fenced else 0.01) or (fenced and ready.wait()):
                return

    def _release(self, sink) -> None:
        with self._cv:
            if not self._lent:
                return
        sink.drain()  # every write in flight completed: the live memory is read no more
        with self._cv:
            self._lent = False
            self._settle()
            self._cv.notify_all()

    def finish(self) -> None:
        """The writer is done with this snapshot (written, failed or never started): its requests
        are reaped by then (a failed write reaps every request before it raises). The tensors are
        let go here, on the writer's thread while the process still waits for the save: a tensor
        viewing a storage that a daemon thread lets go of during the interpreter's finalization
        aborts the process (torch takes the GIL to drop the storage's Python object)."""
        with self._cv:
            self._stopped = True
            self._lent = False
            self._items = {}  # a fence copying now holds its own references
            self._settle()
            self._cv.notify_all()

    def _settle(self) -> None:  # under the lock
        if self._fencing or self._lent:
            return
        if self._stopped or not self._left or self._copied.is_set():
            self.done.set()

    # -- the fence's side

    def fence(self) -> None:
        """Copy what the writer has not handed to a write into the arena, then wait until no write
        reads the live tensors; returns at once when that is so already. A failed copy is raised to the
        writer (the save fails); the fence itself returns, as the state may change either way."""
        with self._cv:
            if self.done.is_set() or self._switched:
                todo: List[Item] = []
                first = False
            else:
                self._switched = first = True
                self._fencing = True
                todo = []  # each source from its first byte not taken by the writer (final: it sees the switch)
                for i in sorted(self._left):
                    view, src = self._items[i]
                    at = self._taken.get(i, 0)
                    if at < view.numel() * view.element_size():
                        todo.append((i, flat(view)[at:], flat(src)[at:]))
        if first:
            try:
                copy_with_crcs(todo, self._rest_crcs)
                self.copied_bytes = sum(v.numel() for _, v, _ in todo)
            except BaseException as e:  # noqa: BLE001 - the writer raises it: that save fails
                self._copy_error = e
            finally:
                with self._cv:
                    self._fencing = False
                    self._copied.set()
                    self._cv.notify_all()
        with self._cv:
            while not self.done.is_set():
                self._settle()
                if self.done.is_set():
                    break
                self._cv.wait()


class Waited:
    """A source that the staging thread copies into the arena (one not written straight from live
    memory) as the archive writer takes it, once `copied` is set: its arena copy, lent to the
    engine, with the CRC-32 the copy took. ``error()`` returns the staging thread's failure."""
    __slots__ = ("_view", "_i", "_crcs", "_copied", "_error", "_through")

    def __init__(self, view: torch.UntypedStorage, i: int, crcs: List[Optional[int]], copied: threading.Event,
                 error, through: Optional[Through] = None):
        self._view, self._i, self._crcs, self._copied, self._error = view, i, crcs, copied, error
        self._through = through  # the snapshot's live sources: let go of at a fence before this is written

    def nbytes(self) -> int:
        return nbytes_of(self._view)

    def write_into(self, sink) -> int:
        if self._through is not None:
            self._through.wait_beside(self._copied, sink)
        else:
            self._copied.wait()
        e = self._error()
        if e is not None:
            raise e
        t = flat(self._view)
        crc = self._crcs[self._i]
        if crc is None or not getattr(sink, "checksums", True):
            return sink.write_crc(t, 0, borrow=True)
        sink.write(t, borrow=True)
        return crc
