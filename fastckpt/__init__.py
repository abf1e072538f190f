"""fastckpt: fast, durable, atomic PyTorch checkpoint I/O."""

import torch  # noqa: F401  (loads libtorch, which fastckpt._C links against)

from .errors import FormatError, UnsupportedURLError
from . import knobs
from .engine import get_engine, reset_engine
from .serialization import load, save
from .async_save import async_save, wait_for_saves
from .manager import CheckpointManager

__all__ = ["save", "load", "async_save", "wait_for_saves", "CheckpointManager", "FormatError", "UnsupportedURLError", "knobs",
           "get_engine", "reset_engine"]
__version__ = "0.1.0"
from .dcp import __getattr__  # noqa: E402,F401  fastckpt.FastWriter/FastReader, imported on first use (torch.distributed)
