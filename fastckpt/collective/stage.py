"""The host bytes a collective save (fastckpt/_collective.py) reads.

A rank of a collective save needs on the host only some byte ranges of the
storages: its share of the records (to write), the next rank's share (to
checksum), the sampled blocks of every storage (to agree) and, on a copy's
lead, the small records and record tails it writes besides. :class:`Storages`
hands out exactly those ranges:

* a CPU storage: a view of its own memory (no copy);
* a storage on a device with a staging copier (CUDA, the tests' simulated
  device): through the one staging pipeline (:class:`fastckpt.staging.device.ToHost`),
  copied ahead into the bounded staging pool on the device's copy stream,
  each piece handed out only after its copy's event fired, the buffer reused
  once the piece is consumed. The device-to-host copies of later pieces run
  while earlier ones are written or checksummed. Host memory: the pool's
  buffers (plus the checker's smaller pool, see :func:`check_chunk`), not a
  host copy of the state;
* a storage on another accelerator (no copier): one plain host copy
  (``.cpu()``), as a single-process save does.

A failed device copy raises a RuntimeError that names the user's path, the
storage and the range (the device's error chained); the collective save then
fails on every rank as for any other error.
"""

from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

from .._core import engine as _engine
from ..staging import device as _staging

# Sampled CRCs: a storage of up to SAMPLE_WHOLE bytes is checksummed whole,
# a larger one in SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes spread evenly
# (first and last included): at most 64 KiB read per storage.
SAMPLE_WHOLE = 64 << 10
SAMPLE_BLOCK = 4096
SAMPLE_BLOCKS = 16

# A range: (storage index, start, length, ...caller's fields).
Range = Tuple[Any, ...]


def check_chunk() -> int:
    """The chunk of the pool that the share checker (a thread of its own)
    stages through: half the default, so that it is a pool of its own (pools
    are keyed by chunk) and never waits for the writes' buffers."""
    return max(_staging.ALIGN, _staging.default_chunk() // 2 // _staging.ALIGN * _staging.ALIGN)


def sample_ranges(n: int) -> List[Tuple[int, int]]:
    """The (start, length) blocks sampled of a storage of `n` bytes."""
    if n == 0:
        return []
    if n <= SAMPLE_WHOLE:
        return [(0, n)]
    last = n - SAMPLE_BLOCK
    return [(last * k // (SAMPLE_BLOCKS - 1), SAMPLE_BLOCK) for k in range(SAMPLE_BLOCKS)]


class Storages:
    """The storages of one collective save, as host bytes on demand."""

    def __init__(self, storages: Sequence[torch.UntypedStorage], path: str):
        self.path = path
        self.sizes = [s.nbytes() for s in storages]
        self._host: List[Optional[torch.Tensor]] = []  # uint8 host bytes, or None (staged)
        self._dev: List[Optional[torch.Tensor]] = []   # uint8 device view (staged), or None
        empty = torch.empty(0, dtype=torch.uint8)
        for s, n in zip(storages, self.sizes):
            if n and _staging.copier_for(s) is not None:
                self._host.append(None)
                self._dev.append(_staging._bytes_view(s))
                continue
            if not n:
                self._host.append(empty)
            elif s.device.type == "cpu":
                self._host.append(torch.empty(0, dtype=torch.uint8).set_(s))
            else:
                self._host.append(_staging._bytes_view(s.cpu()))
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
        pipe = _staging.ToHost(staged, lambda r: self._dev[r[0]][r[1]:r[1] + r[2]], chunk) if staged else None
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
                    raise self._failed(r, e) from e
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
                raise self._failed(None, e) from e

    def _checked(self, r: Range, views: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        while True:
            try:
                v = next(views)
            except StopIteration:
                return
            except Exception as e:
                raise self._failed(r, e) from e
            yield v

    def _failed(self, r: Optional[Range], e: BaseException) -> RuntimeError:
        if r is not None:
            dev = self._dev[r[0]]
            what = f"bytes {r[1]}..{r[1] + r[2]} of storage data/{r[0]} (on {_staging.copier_for(dev).device_key(dev)})"
        else:
            what = "the storages' bytes"
        return RuntimeError(f"cannot save to {self.path!r}: copying {what} to host memory failed: "
                            f"{type(e).__name__}: {e}")

    def sample_crcs(self) -> List[int]:
        """Per storage, the CRC-32 of its sampled blocks (chained)."""
        out = [0] * len(self.sizes)
        ranges = [(k, start, n) for k, size in enumerate(self.sizes) for start, n in sample_ranges(size)]
        it = self.ranges(ranges)
        try:
            for r, views in it:
                for v in views:
                    out[r[0]] = _engine.crc32(v, out[r[0]])
        finally:
            it.close()
        return out
