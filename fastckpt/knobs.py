"""fastckpt's tunables, in one place.

The defaults are the C++ engine's own (``csrc/engine/config.h``); each can be
overridden by an environment variable read when the first engine is made, or
for a block of code with :func:`override`::

    with fastckpt.knobs.override(backend="threads", buffer_size=4 << 20):
        fastckpt.save(sd, path)

========================  =================================  =======================================================
knob                      environment variable               meaning
========================  =================================  =======================================================
buffer_size               FASTCKPT_BUFFER_SIZE               bytes per staging buffer (K/M/G suffixes)
buffer_count              FASTCKPT_BUFFER_COUNT              staging buffers in the pool
queue_depth               FASTCKPT_QUEUE_DEPTH               I/Os in flight per writer or reader
io_threads                FASTCKPT_IO_THREADS                workers of the thread backend
backend                   FASTCKPT_BACKEND                   auto | uring | threads
direct                    FASTCKPT_DIRECT                    0 disables O_DIRECT
flush_interval            FASTCKPT_FLUSH_INTERVAL            async fdatasync every N bytes (0 = at the end)
preallocate               FASTCKPT_PREALLOCATE               fallocate when the final size is known
prefault                  FASTCKPT_PREFAULT                  0: no helper thread faulting in a load's memory ahead of its reads
async_max_in_flight       FASTCKPT_ASYNC_MAX_IN_FLIGHT       async saves in flight, each holding a host snapshot (1)
async_background_staging  FASTCKPT_ASYNC_BACKGROUND_STAGING  1: async saves copy large host tensors after returning;
                                                             optimizer steps and wait_staged() wait for those copies (0)
async_writer_nice         FASTCKPT_ASYNC_WRITER_NICE         the async save thread's nice value, 0-19 (0: as the
                                                             caller): a background write yields the CPU to training
async_write_through       FASTCKPT_ASYNC_WRITE_THROUGH       1: background staging writes page-aligned host tensors
                                                             straight from their memory until the fence, which copies
                                                             only what is unwritten by then; 0: copy them all; 2:
                                                             write through when the saver's last background save
                                                             was written before its first fence and that fence
                                                             came, else copy (2)
async_caller_copy         FASTCKPT_ASYNC_CALLER_COPY         percent, 0-100: of the large host tensors that background
                                                             staging copies, the share the caller copies before
                                                             returning (the staging thread copies the rest) (0)
snapshot_huge_pages       FASTCKPT_SNAPSHOT_HUGE_PAGES       1: snapshot arenas of 32 MiB (_C.HUGE_JUDGE_MIN) or more
                                                             on transparent huge pages (1); 0: small pages (see
                                                             docs/ENGINE.md)
load_huge_pages           FASTCKPT_LOAD_HUGE_PAGES           storages of 2 MiB or more that a load returns (or
                                                             stages for a device), and the blocks that storages
                                                             close together in the file share: 1 on transparent
                                                             huge pages, 0 on small pages, 2 on huge pages for a
                                                             load of 32 MiB or more unless this process's reads
                                                             found them faulting in slowly in the last minute
                                                             (2; see docs/ENGINE.md)
allow_foreign_owner       FASTCKPT_ALLOW_FOREIGN_OWNER       1: use checkpoint directories another user owns or can write (0)
remote_part_size          FASTCKPT_REMOTE_PART_SIZE          bytes per part of a remote upload or ranged read (16 MiB)
remote_parallelism        FASTCKPT_REMOTE_PARALLELISM        parts in flight per remote transfer (8): memory <= parts x part size
remote_attempts           FASTCKPT_REMOTE_ATTEMPTS           tries of a remote request before its error is raised (5)
remote_bandwidth          FASTCKPT_REMOTE_BANDWIDTH          bytes/s cap of a remote transfer (0: no cap)
remote_peer_timeout       FASTCKPT_REMOTE_PEER_TIMEOUT       seconds without a sign of life before a rank of a shared
                                                             upload is taken for dead (120)
========================  =================================  =======================================================

The first nine configure the C++ engine (:func:`config`); the others are read
by the Python side with :func:`get`.
"""

import contextlib
import os
import threading
from typing import Dict, Iterator

from . import _C

__all__ = ["NAMES", "PY_NAMES", "config", "get", "override", "as_dict"]

NAMES = ("buffer_size", "buffer_count", "queue_depth", "io_threads", "backend", "direct",
         "flush_interval", "preallocate", "prefault")

# Knobs of the Python side: name -> (environment variable, default, smallest allowed value). Integers.
PY_NAMES = {"async_max_in_flight": ("FASTCKPT_ASYNC_MAX_IN_FLIGHT", 1, 1),
            "async_background_staging": ("FASTCKPT_ASYNC_BACKGROUND_STAGING", 0, 0),
            "async_writer_nice": ("FASTCKPT_ASYNC_WRITER_NICE", 0, 0),
            "async_write_through": ("FASTCKPT_ASYNC_WRITE_THROUGH", 2, 0),
            "async_caller_copy": ("FASTCKPT_ASYNC_CALLER_COPY", 0, 0),
            "snapshot_huge_pages": ("FASTCKPT_SNAPSHOT_HUGE_PAGES", 1, 0),
            "load_huge_pages": ("FASTCKPT_LOAD_HUGE_PAGES", 2, 0),
            "allow_foreign_owner": ("FASTCKPT_ALLOW_FOREIGN_OWNER", 0, 0),
            # fastckpt.remote (object stores and shared filesystems)
            "remote_part_size": ("FASTCKPT_REMOTE_PART_SIZE", 16 << 20, 1 << 10),
            "remote_parallelism": ("FASTCKPT_REMOTE_PARALLELISM", 8, 1),
            "remote_attempts": ("FASTCKPT_REMOTE_ATTEMPTS", 5, 1),
            "remote_bandwidth": ("FASTCKPT_REMOTE_BANDWIDTH", 0, 0),
            "remote_peer_timeout": ("FASTCKPT_REMOTE_PEER_TIMEOUT", 120, 1)}

# Largest allowed values, where there is one.
_PY_HIGH = {"async_write_through": 2, "async_caller_copy": 100, "load_huge_pages": 2}

_lock = threading.Lock()
_overrides: Dict[str, object] = {}


def _after_fork_in_child() -> None:
    global _lock  # a thread of the parent may have held it at fork()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def config() -> "_C.EngineConfig":
    """The effective configuration: defaults, then environment, then overrides."""
    with _lock:
        cfg = _C.EngineConfig.from_env()
        for k, v in _overrides.items():
            if k in NAMES:
                setattr(cfg, k, v)
    cfg.validate()
    return cfg


def _py_value(name: str, value: object, source: str) -> int:
    low, high = PY_NAMES[name][2], _PY_HIGH.get(name)
    try:
        n = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        n = low - 1
    if n < low or (high is not None and n > high) or (isinstance(value, float) and value != n):
        within = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"fastckpt knob {name} ({source}) must be an integer {within}, got {value!r}")
    return n


def get(name: str) -> int:
    """The effective value of a Python-side knob (see ``PY_NAMES``):
    its default, then its environment variable, then overrides."""
    if name not in PY_NAMES:
        raise ValueError(f"unknown fastckpt Python-side knob {name!r}; known: {list(PY_NAMES)}")
    with _lock:
        if name in _overrides:
            return _overrides[name]  # type: ignore[return-value]
    env, default, _ = PY_NAMES[name]
    raw = os.environ.get(env)
    return default if raw is None or raw == "" else _py_value(name, raw, env)


def as_dict(cfg=None) -> Dict[str, object]:
    cfg = cfg if cfg is not None else config()
    return {k: getattr(cfg, k) for k in NAMES}


@contextlib.contextmanager
def override(**values) -> Iterator[None]:
    """Override knobs for the duration of a ``with`` block (process-wide)."""
    unknown = set(values) - set(NAMES) - set(PY_NAMES)
    if unknown:
        raise ValueError(f"unknown fastckpt knob(s): {sorted(unknown)}; known: {list(NAMES) + list(PY_NAMES)}")
    values = {k: _py_value(k, v, "override") if k in PY_NAMES else v for k, v in values.items()}
    probe = _C.EngineConfig.from_env()
    for k, v in values.items():
        if k in NAMES:
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
