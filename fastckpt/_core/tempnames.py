"""Temporary names (docs/FORMAT.md 1.6) and their parsing: the engine's files
``.<name>.fastckpt-tmp.<pid>.<host>.<start>.<n>.<r>`` (csrc/engine/temp_file.h)
and the directories made beside a target (the same, then ``.dcp``: a save in
progress, ``.del``: a removal in progress, ``.old``: a replaced directory).
The name says which process of which host made it, so that a cleanup removes
only what a process of this host that is certainly gone left behind."""

import itertools
import os
import re
import uuid
from typing import List, Optional, Tuple

from .. import _C

__all__ = ["TMP_MARK", "TMP_KINDS", "temp_name", "parse_temp", "writer_gone", "pid_alive", "process_start",
           "temp_host", "remove_leftovers"]

TMP_MARK = ".fastckpt-tmp."
TMP_RE = re.compile(r"^\..+\.fastckpt-tmp\.(?:(\d+)\.)?")  # the pid, right after the mark
TMP_KINDS = ("dcp", "del", "old")
_tmp_counter = itertools.count()


def process_start(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot (/proc/PID/stat
    field 22, as the engine's temporary names hold it); 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # fields from 3 (state) on: 22 is [19]
    except (OSError, ValueError, IndexError):
        return 0


def temp_name(name: str, kind: Optional[str] = None) -> str:
    """A temporary name for ``name`` in the engine's format (this process's
    pid, this host, its start time), then ``.kind`` (one of ``TMP_KINDS``)
    for directories, which the engine never touches."""
    pid = os.getpid()
    base = (f".{name}{TMP_MARK}{pid}.{temp_host()}.{process_start(pid)}."
            f"{next(_tmp_counter)}.{uuid.uuid4().hex[:8]}")
    return base if kind is None else f"{base}.{kind}"


def parse_temp(entry: str) -> Optional[Tuple[str, dict, Optional[str]]]:
    """``(target, {"pid", "host", "start"}, kind)`` of a name made by the
    engine or by :func:`temp_name`, or None (not one: older names without a
    host included)."""
    for base, kind in [(entry, None)] + [(entry[:-len(k) - 1], k) for k in TMP_KINDS if entry.endswith("." + k)]:
        i = base.rfind(TMP_MARK)
        if i < 2 or not base.startswith("."):
            continue
        info = _C.parse_temp_name(base, base[1:i])
        if info is not None:
            return base[1:i], info, kind
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def writer_gone(info: dict) -> bool:
    """Whether the process (of this host) that made a temporary name is
    certainly gone: no such pid, or one that started at another time (the
    pid was reused). False when in doubt (the engine's temp_writer_gone)."""
    if not pid_alive(info["pid"]):
        return True
    if not info["start"]:
        return False
    now = process_start(info["pid"])
    return now != 0 and now != info["start"]


def temp_host() -> str:
    """This host's name as temporary names hold it."""
    return _C.temp_host()


def remove_leftovers(target: str) -> List[str]:
    """Remove the engine's temporary files of ``target`` left by processes of
    this host that are gone; returns the names removed."""
    return _C.remove_leftovers(target)
