"""The host bytes a collective save (fastckpt/collective/save.py) reads.

A rank of a collective save needs on the host only some byte ranges of the
storages: its share of the records (to write), the next rank's share (to
checksum), the sampled blocks of every storage (to agree) and, on a copy's
lead, the small records and record tails it writes besides. It reads them
through the staging component's :class:`fastckpt.staging.tohost.Storages`
(host storages as they are, device storages copied ahead through the bounded
staging pool); this module adds what is the collective save's own: which
blocks are sampled, and the smaller pool of the share checker.

A failed device copy raises a RuntimeError that names the user's path, the
storage and the range (the device's error chained); the collective save then
fails on every rank as for any other error.
"""

from typing import List, Tuple

from .._core import engine as _engine
from ..staging import device as _staging
from ..staging.tohost import Range, Storages

__all__ = ["Range", "Storages", "check_chunk", "sample_ranges", "sample_crcs"]

# Sampled CRCs: a storage of up to SAMPLE_WHOLE bytes is checksummed whole,
# a larger one in SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes spread evenly
# (first and last included): at most 64 KiB read per storage.
SAMPLE_WHOLE = 64 << 10
SAMPLE_BLOCK = 4096
SAMPLE_BLOCKS = 16


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


def sample_crcs(src: Storages) -> List[int]:
    """Per storage of `src`, the CRC-32 of its sampled blocks (chained)."""
    out = [0] * len(src.sizes)
    ranges = [(k, start, n) for k, size in enumerate(src.sizes) for start, n in sample_ranges(size)]
    it = src.ranges(ranges)
    try:
        for r, views in it:
            for v in views:
                out[r[0]] = _engine.crc32(v, out[r[0]])
    finally:
        it.close()
    return out
