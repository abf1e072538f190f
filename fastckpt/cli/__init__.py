"""The ``fastckpt`` command (inspect, verify, convert, doctor, bench). The
library never imports it."""

from .main import main

__all__ = ["main"]
