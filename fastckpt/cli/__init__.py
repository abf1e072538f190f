"""The ``fastckpt`` command (inspect, verify, convert, doctor, bench). The
library never imports it."""

from .command import main

__all__ = ["main"]
