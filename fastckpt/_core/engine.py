"""The process-wide I/O engine.

An engine owns the staging-buffer pool and the I/O backends (io_uring rings
with registered buffers, or worker threads), so every save and load after the
first reuses warm memory. All of it grows at first use: making an engine
touches no buffer and starts no thread, a small load backs a buffer or two
and pins none (``buffers_touched``, ``buffers_registered``,
``buffers_resident_bytes``; docs/ENGINE.md, "Fixed costs"). Engines are
cached per configuration (see :mod:`fastckpt.knobs`).

After ``os.fork()`` (including multiprocessing's "fork" start method) the
child starts with no cached engine: the parent's I/O threads do not exist in
the child and its io_uring rings must not be shared, so the child's first save
or load makes an engine of its own. An engine object carried over from the
parent refuses to work in the child (ValueError) instead of hanging.
"""

import logging
import os
import threading
from typing import Dict, Tuple

from .. import _C, knobs

__all__ = ["get_engine", "reset_engine", "fsync_dir", "read_ranges", "region_file", "crc32", "crc32_combine",
           "empty_aligned"]

log = logging.getLogger("fastckpt")
_lock = threading.Lock()
_engines: Dict[Tuple, "_C.Engine"] = {}
_logged: set = set()  # engines whose backend choice was logged


def get_engine() -> "_C.Engine":
    """The engine for the current knobs, created on first use. Its backend (an
    io_uring ring or a thread pool) is made by the first I/O that needs one
    (a read served from the page cache needs none); an io_uring refusal is
    logged by the first call after it happened."""
    cfg = knobs.config()
    key = tuple(sorted(knobs.as_dict(cfg).items()))
    with _lock:
        eng = _engines.get(key)
        if eng is None:
            eng = _C.Engine(cfg)
            _engines[key] = eng
            log.debug("fastckpt: engine %r", cfg)
        elif key not in _logged and eng.backends_created:
            _logged.add(key)
            if eng.uring_refusal:
                log.warning("fastckpt: io_uring refused (%s); using the %s backend", eng.uring_refusal, eng.backend)
            else:
                log.debug("fastckpt: engine %r uses the %s backend", cfg, eng.backend)
        return eng


def reset_engine() -> None:
    """Drop cached engines (their buffers are freed once no writer uses them)."""
    with _lock:
        _engines.clear()
        _logged.clear()


def fsync_dir(path) -> None:
    """fsync a directory (its entries: a rename, create or unlink in it) through
    the engine's syscall checker: an OSError subclass naming the path on failure.
    The one directory fsync of the package (save, FastWriter, the manager, convert);
    the test-only FASTCKPT_TEST_SKIP_SYNC=dir|all switch (tests/powerloss) turns it off."""
    _C.fsync_dir(os.fspath(path))


# read_ranges reads through a gap of up to this many bytes between two ranges it reads from the disk
# (csrc/engine/reader.h, kCoalesceGap).
READ_COALESCE_GAP: int = _C.READ_COALESCE_GAP


def read_ranges(path: str, ranges, fd: int = -1, crc: bool = False, engine: "_C.Engine" = None,
                fresh_huge: bool = False) -> dict:
    """Fill each (destination, file offset[, crc]) of ``ranges`` from ``path``
    (or from the open descriptor ``fd``) in one parallel batch of engine reads;
    returns the engine's statistics, with each range's CRC-32 under ``"crcs"``
    where one was asked for (computed during the reads). ``engine``: default, the
    current knobs' one. ``fresh_huge``: the destinations were allocated for
    this read on huge pages (``_C.read_ranges``)."""
    return _C.read_ranges(engine or get_engine(), path, ranges, fd, crc, (), fresh_huge)


def region_file(target: str, tmp: str = "", create: bool = False, size: int = 0) -> "_C.RegionWriter":
    """A writer of byte ranges at any offset of one temporary file committed over
    ``target`` (``create``: a new temporary file of ``size`` bytes; else the
    temporary file ``tmp`` that another process created): each of several
    processes or threads writes its share, one commits."""
    return _C.RegionWriter(get_engine(), target, tmp, create, size)


def crc32(data, crc: int = 0) -> int:
    """The CRC-32 of a bytes-like object or CPU tensor, continued from ``crc`` (ISA-L or zlib; no GIL)."""
    return _C.crc32(data, crc)


def copy_crc32_many(dsts, srcs, threads: int = 1) -> list:
    """Copy each bytes-like object or contiguous CPU tensor of ``srcs`` into the one of ``dsts`` of the same
    size and return the CRC-32 of each, taken during the copy (one pass over memory; no GIL)."""
    return _C.copy_crc32_many(dsts, srcs, threads)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of two pieces laid end to end, from theirs (zlib's crc32_combine)."""
    return _C.crc32_combine(crc1, crc2, len2)


def empty_aligned(nbytes: int, alignment: int = 4096):
    """Page-aligned host memory as a uint8 tensor (a destination of O_DIRECT reads)."""
    return _C.empty_aligned(nbytes, alignment)


def _after_fork_in_child() -> None:
    # Another thread of the parent may have held _lock at fork(): a new lock,
    # and no engine of the parent's (the C++ engine refuses to run in another
    # process and never joins the parent's threads when it is destroyed).
    global _lock, _engines, _logged
    _lock = threading.Lock()
    _engines = {}
    _logged = set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
