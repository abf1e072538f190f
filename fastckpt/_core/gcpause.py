"""Python's cyclic garbage collector paused while a load builds many small objects that all live
on (a DCP checkpoint's metadata, its load plan, a record per tensor): the collections they trigger
find no garbage, yet each one walks every object the process holds (torch's alone are about
250,000), which cost a fifth to a third of a ``dcp.load`` of a thousand tensors here. Reference
counting still frees everything at once; cycles made meanwhile wait for the next collection.

Process-wide, as the collector is: paused by the first of any number of concurrent callers, and
switched back on by the last one only if it was on when the first one came (a program that keeps
it off keeps it off). A child forked while another thread was inside starts afresh: the collector
as it was before the pause, a new lock, no caller inside (the one that would have switched the
collector back on does not exist there)."""

import gc
import os
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def _after_fork_in_child() -> None:
    global _lock, _depth
    _lock = threading.Lock()
    if _depth and _was_enabled:
        gc.enable()
    _depth = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
