"""The process-wide I/O engine.

An engine owns the staging-buffer pool (allocated and touched once) and the
I/O backends (io_uring rings with registered buffers, or worker threads), so
every save and load after the first reuses warm memory. Engines are cached
per configuration (see :mod:`fastckpt.knobs`).
"""

import logging
import threading
from typing import Dict, Tuple

from . import _C, knobs

__all__ = ["get_engine", "reset_engine"]

log = logging.getLogger("fastckpt")
_lock = threading.Lock()
_engines: Dict[Tuple, "_C.Engine"] = {}


def get_engine() -> "_C.Engine":
    """The engine for the current knobs, created on first use."""
    cfg = knobs.config()
    key = tuple(sorted(knobs.as_dict(cfg).items()))
    with _lock:
        eng = _engines.get(key)
        if eng is None:
            eng = _C.Engine(cfg)
            _engines[key] = eng
            backend = eng.backend
            if eng.uring_refusal:
                log.warning("fastckpt: io_uring refused (%s); using the %s backend", eng.uring_refusal, backend)
            else:
                log.debug("fastckpt: engine %r uses the %s backend", cfg, backend)
        return eng


def reset_engine() -> None:
    """Drop cached engines (their buffers are freed once no writer uses them)."""
    with _lock:
        _engines.clear()
