"""The ``fastckpt`` command (inspect, verify, convert, doctor, clean-memory, bench). The
library never imports it."""

from .command import main

__all__ = ["main"]
