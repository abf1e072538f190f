"""fastckpt: fast, durable, atomic PyTorch checkpoint I/O."""

import torch  # noqa: F401  (loads libtorch, which fastckpt._C links against)

from .errors import FormatError, StateMismatchError, UnsupportedURLError
from . import knobs
from ._core.engine import get_engine, reset_engine
from .serialization import load, load_into, save
from .saver import async_save, wait_for_saves, wait_staged

__all__ = ["save", "load", "load_into", "async_save", "wait_for_saves", "wait_staged", "CheckpointManager", "MemoryTier", "FormatError", "StateMismatchError", "UnsupportedURLError", "knobs",
           "get_engine", "reset_engine"]
__version__ = "0.1.0"

# Imported on first use, so that `import fastckpt` (and a process that only
# saves and loads) does not pay for them: the manager, and FastWriter /
# FastReader (torch.distributed); name -> the submodule that defines it. The
# submodules themselves (fastckpt.manager, fastckpt.dcp) load on first access too.
_LAZY = {"CheckpointManager": ".manager", "MemoryTier": ".memory", "FastWriter": ".dcp", "FastReader": ".dcp"}
_LAZY_MODULES = ("manager", "memory", "dcp")


def __getattr__(name):
    import importlib
    if name in _LAZY_MODULES:
        return importlib.import_module("." + name, __name__)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))
