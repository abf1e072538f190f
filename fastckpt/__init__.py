"""fastckpt: fast, durable, atomic PyTorch checkpoint I/O."""

import torch  # noqa: F401  (loads libtorch, which fastckpt._C links against)

from .errors import FormatError
from . import knobs
from .engine import get_engine, reset_engine
from .serialization import load, save

__all__ = ["save", "load", "FormatError", "knobs", "get_engine", "reset_engine"]
__version__ = "0.1.0"
from .dcp import __getattr__  # noqa: E402,F401  fastckpt.FastWriter/FastReader, imported on first use (torch.distributed)
