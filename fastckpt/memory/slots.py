"""Snapshot slots: the files of one rank's snapshots (or of the replicas it keeps for a peer) in host memory.

A slot directory (``<memory dir>/<namespace>/rank<R>`` for a rank's own snapshots,
``.../replica<R>`` for the replicas of rank R that this rank keeps) holds at most
``keep`` slots, each two files:

    slot<k>.pt       a torch.save archive (zip, CRC fields 0), exactly its length
    slot<k>.commit   the commit record (JSON): step, rank, length, CRC-32 of the whole
                     archive, the offsets of its pickle and storages; written last,
                     atomically (temporary name, rename)

A slot is complete only while its commit record exists and matches its archive
(length, CRC-32). Taking a slot for a new snapshot removes its commit record
first, so a crash while the archive is rewritten leaves the other slots (the
previous snapshot) as they were, and this one incomplete, never taken for a
snapshot. Rewriting a slot writes over the pages it already has (no fresh
memory per snapshot); space is reserved with ``posix_fallocate`` before any
byte is written, so a full memory directory is ENOSPC, never a SIGBUS.

A slot whose archive this process mapped for a restore (:meth:`SlotDir.map`)
is unlinked and made anew before it is rewritten: the restored tensors keep
their pages and never see the next snapshot's bytes.
"""

import ctypes
import errno
import json
import logging
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._core import engine as _engine
from .._core.atomic import write_file
from ..errors import FormatError

log = logging.getLogger("fastckpt")

__all__ = ["Record", "SlotDir", "MappedFile", "RECORD_VERSION"]

RECORD_VERSION = 1
_SLOT = re.compile(r"^slot(\d+)\.(pt|commit)$")
_TORCH_COPY = 1 << 20   # writes of at least this many bytes are copied by torch (in parallel)
_MAX_RECORD = 1 << 24   # a commit record is small; anything larger is not one (never read whole)


class Record(dict):
    """A slot's commit record: ``step``, ``rank``, ``nbytes``, ``crc``, ``slot``,
    ``pkl`` ([offset, size] of data.pkl), ``storages`` ([[offset, size], ...] in
    key order), ``opts`` (the archive writer's settings)."""

    @property
    def step(self) -> int:
        return self["step"]


def _check_record(raw: Any, where: str) -> Record:
    """A commit record read from `where`, every field checked (it may be damaged
    or hostile like any file): FormatError otherwise."""
    if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
        raise FormatError(f"{where}: not a fastckpt snapshot commit record (version {RECORD_VERSION})")
    ints = ("step", "rank", "nbytes", "crc", "slot")
    if any(not isinstance(raw.get(k), int) or isinstance(raw.get(k), bool) or raw[k] < 0 for k in ints):
        raise FormatError(f"{where}: a commit record field of {ints} is missing or not a non-negative int")
    spans = [raw.get("pkl")] + list(raw.get("storages") or [])
    for s in spans:
        if (not isinstance(s, list) or len(s) != 2 or not all(isinstance(v, int) and v >= 0 for v in s)
                or s[0] + s[1] > raw["nbytes"]):
            raise FormatError(f"{where}: a commit record span {s!r} lies outside the archive of "
                              f"{raw['nbytes']} bytes")
    if not isinstance(raw.get("opts"), dict):
        raise FormatError(f"{where}: the commit record has no writer settings")
    return Record(raw)


class MappedFile:
    """A write-only file object over a mapped slot: each write is one memcpy into the mapping
    (no system call; the pages are the slot's, already there when the slot is reused)."""

    def __init__(self, buf: torch.Tensor):
        self.buf, self.base, self.pos = buf, buf.data_ptr(), 0

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if self.pos + n > self.buf.numel():
            raise OSError(errno.EFBIG, f"snapshot larger than its planned {self.buf.numel()} bytes")
        if n >= _TORCH_COPY and not mv.readonly:  # torch's copy: on every intra-op thread
            self.buf[self.pos:self.pos + n].copy_(torch.frombuffer(mv, dtype=torch.uint8))
        elif n:
            src = b if isinstance(b, bytes) else bytes(mv) if mv.readonly else (ctypes.c_char * n).from_buffer(mv)
            ctypes.memmove(self.base + self.pos, src, n)
        self.pos += n
        return n

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        pass


class SlotDir:
    """One directory of snapshot slots (see the module's docstring)."""

    def __init__(self, path: str, keep: int):
        self.path = path
        self.keep = keep
        self._mapped: set = set()   # slot numbers whose archive this process mapped for a restore
        self._maps: Dict[int, Tuple[int, int, torch.Tensor]] = {}  # slot -> (inode, size, its writable mapping)

    # ------------------------------------------------------------ names
    def archive(self, k: int) -> str:
        return os.path.join(self.path, f"slot{k}.pt")

    def record_path(self, k: int) -> str:
        return os.path.join(self.path, f"slot{k}.commit")

    def slots(self) -> List[int]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted({int(m.group(1)) for m in map(_SLOT.match, names) if m})

    # ------------------------------------------------------------ records
    def read_record(self, k: int) -> Optional[Record]:
        """Slot k's commit record, None if it has none or it is damaged (logged)."""
        path = self.record_path(k)
        try:
            with open(path, "rb") as f:
                raw = f.read(_MAX_RECORD + 1)
            if len(raw) > _MAX_RECORD:
                raise FormatError(f"{path}: too large for a commit record")
            rec = _check_record(json.loads(raw), path)
            if rec["slot"] != k:
                raise FormatError(f"{path}: the record names slot {rec['slot']}")
            if os.stat(self.archive(k)).st_size != rec["nbytes"]:
                raise FormatError(f"{self.archive(k)}: its length is not the {rec['nbytes']} bytes its record says")
            return rec
        except FileNotFoundError:
            return None
        except (ValueError, OSError) as e:  # FormatError is a ValueError; json's errors too
            log.warning("fastckpt: ignoring snapshot slot %s: %s", path, e)
            return None

    def records(self) -> List[Record]:
        """The complete slots' records (checked for form, not yet for their CRC), newest step first."""
        recs = [r for r in map(self.read_record, self.slots()) if r is not None]
        return sorted(recs, key=lambda r: r.step, reverse=True)

    def write_record(self, rec: Dict[str, Any]) -> None:
        """Commit slot ``rec['slot']``: its record written atomically (the slot is complete from now on)."""
        rec = dict(rec, version=RECORD_VERSION)
        write_file(self.record_path(rec["slot"]), json.dumps(rec, sort_keys=True).encode())

    # ------------------------------------------------------------ slots
    def take_for(self, step: int, busy: Tuple[int, ...] = ()) -> Optional[int]:
        """A slot for the snapshot of `step`, or None while every slot it may take is `busy` (a
        background job still works on it). Snapshots of steps >= `step` are dropped (a new
        branch; busy ones stay); the newest older one is kept while keep > 1; a free slot is
        taken first, else the one holding the oldest step; its commit record is removed now."""
        os.makedirs(self.path, exist_ok=True)
        recs = self.records()
        for r in recs:
            if r.step >= step and r["slot"] not in busy:
                self.remove(r["slot"])
        older = [r for r in recs if r.step < step]
        avoid = set(busy) | ({older[0]["slot"]} if older and self.keep > 1 else set())
        if len(avoid) >= self.keep:
            return None
        held = {r["slot"]: r.step for r in older}
        free = [k for k in range(self.keep) if k not in held and k not in avoid]
        k = free[0] if free else min((st, k) for k, st in held.items() if k not in avoid)[1]
        try:
            os.unlink(self.record_path(k))
        except FileNotFoundError:
            pass
        for extra in self.slots():  # slots beyond `keep` (a smaller keep than last time): freed
            if extra >= self.keep and extra != k:
                self.remove(extra)
        return k

    def _kept(self, k: int, nbytes: int) -> Optional[torch.Tensor]:
        """This process's kept mapping of slot k, if it still maps the slot's file at `nbytes`."""
        got = self._maps.get(k)
        if got is None or got[1] != nbytes:
            return None
        try:
            return got[2] if os.stat(self.archive(k)).st_ino == got[0] else None
        except FileNotFoundError:
            return None

    def mapping(self, k: int, nbytes: int) -> torch.Tensor:
        """Slot k's archive resized to exactly `nbytes` (space reserved first: ENOSPC now, never
        a SIGBUS) and mapped writable; the mapping is kept for the next write into this slot."""
        path = self.archive(k)
        if k in self._mapped:  # a restore maps the old pages: new ones for this snapshot
            self._mapped.discard(k)
            self._maps.pop(k, None)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        kept = self._kept(k, nbytes)
        if kept is not None:
            return kept
        self._maps.pop(k, None)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
            os.ftruncate(fd, nbytes)
            ino = os.fstat(fd).st_ino
        except OSError as e:
            raise OSError(e.errno, f"reserving {nbytes} bytes of host memory for a snapshot: {os.strerror(e.errno)}",
                          path) from None
        finally:
            os.close(fd)
        buf = self.map(k, nbytes)
        self._maps[k] = (ino, nbytes, buf)
        return buf

    def view(self, k: int, nbytes: int) -> torch.Tensor:
        """Slot k's first `nbytes` for reading: the kept mapping of this process's snapshot
        (its pages already mapped) where there is one, else a new mapping."""
        kept = self._kept(k, nbytes)
        return kept if kept is not None else self.map(k, nbytes)

    def mark_mapped(self, k: int) -> None:
        """Slot k's archive is mapped by a restore: it is made anew before it is rewritten."""
        self._mapped.add(k)

    def map(self, k: int, nbytes: int) -> torch.Tensor:
        """Slot k's archive as a flat uint8 tensor (a shared mapping of its first `nbytes`)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        st = torch.UntypedStorage.from_file(self.archive(k), True, nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(st)

    def verify(self, rec: Record) -> Optional[str]:
        """Why slot ``rec['slot']`` does not match its record (None: it does)."""
        try:
            if os.stat(self.archive(rec["slot"])).st_size != rec["nbytes"]:
                return "its length does not match its commit record"
            crc = _engine.crc32(self.view(rec["slot"], rec["nbytes"])) if rec["nbytes"] else 0
        except OSError as e:
            return f"{type(e).__name__}: {e}"
        if crc != rec["crc"]:
            return f"CRC-32 mismatch (recorded {rec['crc']:#010x}, found {crc:#010x})"
        return None

    def remove(self, k: int) -> None:
        """Slot k gone: its commit record first, then its archive."""
        self._mapped.discard(k)
        self._maps.pop(k, None)
        for p in (self.record_path(k), self.archive(k)):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def clear(self) -> None:
        for k in self.slots():
            self.remove(k)
        try:
            os.rmdir(self.path)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
                raise

    def held_bytes(self) -> int:
        """Bytes the slots' archives hold (what a new snapshot may reuse)."""
        total = 0
        for k in self.slots():
            try:
                total += os.stat(self.archive(k)).st_blocks * 512
            except FileNotFoundError:
                pass
        return total
