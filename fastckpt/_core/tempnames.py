"""Temporary names (docs/FORMAT.md 1.6) and their parsing: the engine's files
``.fastckpt-tmp.<key>.<pid>.<host>.<start>.<n>.<r>`` (csrc/engine/temp_file.h)
and the directories made beside a target (the same, then ``.dcp``: a save in
progress, ``.del``: a removal in progress, ``.old``: a replaced directory).

``<key>`` stands for the target's name without spelling it: ``x`` and its
bytes in hex (names up to 64 bytes), else ``h`` and a hash. So no tool that
finds checkpoints by their names (``hpc_ckpt_*``, ``checkpoint-*``,
``step-*``, ``last*``, ``epoch=*``) takes a temporary for a checkpoint. The
name says which process of which host made it, so that a cleanup removes
only what a process of this host that is certainly gone left behind. Names
of the earlier format (``.<name>.fastckpt-tmp.<pid>...``) are still parsed,
so that their leftovers are still cleaned up."""

import os
from typing import List, NamedTuple, Optional

from .. import _C

__all__ = ["TMP_MARK", "TMP_KINDS", "Temp", "temp_name", "temp_key", "parse_temp", "is_temp", "writer_gone",
           "pid_alive", "process_start", "temp_host", "remove_leftovers", "remove_leftovers_in"]

TMP_MARK = ".fastckpt-tmp."
TMP_KINDS = ("dcp", "del", "old")


class Temp(NamedTuple):
    """A parsed temporary name: ``target`` (the base name it stands for;
    None where the name holds only a hash of it: compare :func:`temp_key`
    with ``key``), ``info`` ({"pid", "host", "start"}), ``kind`` (one of
    ``TMP_KINDS``, or None for the engine's files) and ``key``."""
    target: Optional[str]
    info: dict
    kind: Optional[str]
    key: str

    def is_for(self, name: str) -> bool:
        """Whether this is a temporary of the target name ``name``."""
        return self.key == temp_key(name) and self.target in (None, name)


def process_start(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot (/proc/PID/stat
    field 22, as the engine's temporary names hold it); 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # fields from 3 (state) on: 22 is [19]
    except (OSError, ValueError, IndexError):
        return 0


def temp_key(name: str) -> str:
    """The part of a temporary name that stands for the target name ``name``."""
    return _C.temp_key(name)


def temp_name(name: str, kind: Optional[str] = None) -> str:
    """A new temporary name for ``name`` in the engine's format (this
    process's pid, this host, its start time), then ``.kind`` (one of
    ``TMP_KINDS``) for directories, which the engine never touches."""
    if kind is not None and kind not in TMP_KINDS:
        raise ValueError(f"temporary name kind {kind!r}: one of {TMP_KINDS}")
    base = _C.temp_name(name)
    return base if kind is None else f"{base}.{kind}"


def parse_temp(entry: str) -> Optional[Temp]:
    """The :class:`Temp` of a name made by the engine or by :func:`temp_name`
    (either format), or None (not one: older names without a host included)."""
    if TMP_MARK not in entry:
        return None
    for base, kind in [(entry, None)] + [(entry[:-len(k) - 1], k) for k in TMP_KINDS if entry.endswith("." + k)]:
        info = _C.parse_temp(base)
        if info is not None:
            key, target = info.pop("key"), info.pop("target")
            return Temp(target, info, kind, key)
    return None


def is_temp(entry: str) -> bool:
    """Whether a directory entry is a temporary of fastckpt's (either format,
    parsed or not): never a checkpoint, never part of one."""
    return TMP_MARK in entry


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


def remove_leftovers_in(directory: str) -> List[str]:
    """:func:`remove_leftovers` for the engine's temporary files of every
    target in ``directory`` (the same rules); returns the names removed."""
    return _C.remove_leftovers_in(directory)
