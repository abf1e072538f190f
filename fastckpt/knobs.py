"""fastckpt's tunables, in one place.

The defaults are the C++ engine's own (``csrc/engine/config.h``); each can be
overridden by an environment variable read when the first engine is made, or
for a block of code with :func:`override`::

    with fastckpt.knobs.override(backend="threads", buffer_size=4 << 20):
        fastckpt.save(sd, path)

==================  ===========================  ==========================================
knob                environment variable         meaning
==================  ===========================  ==========================================
buffer_size         FASTCKPT_BUFFER_SIZE         bytes per staging buffer (K/M/G suffixes)
buffer_count        FASTCKPT_BUFFER_COUNT        staging buffers in the pool
queue_depth         FASTCKPT_QUEUE_DEPTH         I/Os in flight per writer or reader
io_threads          FASTCKPT_IO_THREADS          workers of the thread backend
backend             FASTCKPT_BACKEND             auto | uring | threads
direct              FASTCKPT_DIRECT              0 disables O_DIRECT
flush_interval      FASTCKPT_FLUSH_INTERVAL      async fdatasync every N bytes (0 = at the end)
preallocate         FASTCKPT_PREALLOCATE         fallocate when the final size is known
==================  ===========================  ==========================================
"""

import contextlib
import threading
from typing import Dict, Iterator

from . import _C

__all__ = ["NAMES", "config", "override", "as_dict"]

NAMES = ("buffer_size", "buffer_count", "queue_depth", "io_threads", "backend", "direct",
         "flush_interval", "preallocate")

_lock = threading.Lock()
_overrides: Dict[str, object] = {}


def config() -> "_C.EngineConfig":
    """The effective configuration: defaults, then environment, then overrides."""
    with _lock:
        cfg = _C.EngineConfig.from_env()
        for k, v in _overrides.items():
            setattr(cfg, k, v)
    cfg.validate()
    return cfg


def as_dict(cfg=None) -> Dict[str, object]:
    cfg = cfg if cfg is not None else config()
    return {k: getattr(cfg, k) for k in NAMES}


@contextlib.contextmanager
def override(**values) -> Iterator[None]:
    """Override knobs for the duration of a ``with`` block (process-wide)."""
    unknown = set(values) - set(NAMES)
    if unknown:
        raise ValueError(f"unknown fastckpt knob(s): {sorted(unknown)}; known: {list(NAMES)}")
    probe = _C.EngineConfig.from_env()
    for k, v in values.items():
        setattr(probe, k, v)  # type errors surface here, before anything changes
    probe.validate()
    with _lock:
        saved = dict(_overrides)
        _overrides.update(values)
    try:
        yield
    finally:
        with _lock:
            _overrides.clear()
            _overrides.update(saved)
