"""What the engine can do here, for ``fastckpt doctor``: a small probe engine
(the current knobs with two 64 KiB buffers), the backend it chose and why,
the direct-I/O alignment of a directory, whether a file there takes O_DIRECT
writes, and the CRC-32 implementation compiled in."""

import os
from typing import Dict, Optional, Tuple

from .. import _C, knobs

__all__ = ["uring_compiled", "probe_backend", "dio_alignment", "direct_writes", "crc32_impl", "crc32_kernel"]


def _probe_config(backend: Optional[str] = None) -> "_C.EngineConfig":
    cfg = knobs.config()
    probe = _C.EngineConfig()
    for k in knobs.NAMES:
        setattr(probe, k, getattr(cfg, k))
    probe.buffer_size = 64 << 10  # the probe needs no big buffers
    probe.buffer_count = 2
    probe.queue_depth = 1
    if backend is not None:
        probe.backend = backend
    return probe


def uring_compiled() -> bool:
    """Whether the extension was built with liburing."""
    return bool(_C.uring_compiled())


def probe_backend(backend: Optional[str] = None) -> Tuple[str, str]:
    """(the backend a probe engine of the current knobs, or of ``backend``,
    chose; why io_uring was refused, or ""). OSError where the knobs demand
    io_uring and it is refused."""
    eng = _C.Engine(_probe_config(backend))
    return eng.backend, eng.uring_refusal


def dio_alignment(directory: str) -> Dict[str, int]:
    """The direct-I/O alignment the engine uses for files in ``directory``."""
    return dict(_C.dio_alignment(directory))


def direct_writes(directory: str) -> bool:
    """Whether a temporary file the engine creates in ``directory`` is written
    O_DIRECT (the file is removed again). OSError where none can be created."""
    w = _C.Writer(_C.Engine(_probe_config()), os.path.join(directory, ".fastckpt-doctor-probe"), 4096)
    try:
        return bool(w.direct)
    finally:
        w.abort()  # removes the temporary file


def crc32_impl() -> str:
    """The CRC-32 implementation compiled in."""
    return _C.crc32_impl()


def crc32_kernel() -> str:
    """What the CRC-32 runs on this CPU (the engine's own 256-bit folding, or crc32_impl())."""
    return _C.crc32_kernel()
