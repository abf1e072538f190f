"""CheckpointManager's policy: what a checkpoint directory holds and what is done with it.

Names (``step_<8 digits>.pt`` files, or ``step_<8 digits>`` DCP directories in sharded
mode), which checkpoints are complete, the ``latest`` pointer (authoritative: written
atomically by the engine), rollback (checkpoints of an abandoned branch moved into
``abandoned/``), retention (``keep_last``), which checkpoints a restore tries and which
failures count as damage, and temporary names: the engine's and the manager's own (the
directories of sharded saves, of retention and of a re-saved step), whose leftovers only
the host that made them removes. No collective and no process group here: the manager
(fastckpt/manager.py) decides which rank calls what, and fastckpt/_manager_dist.py
coordinates the ranks.
"""

import errno
import logging
import os
import pickle
import shutil
import stat
import warnings
from pathlib import Path
from typing import AbstractSet, Any, List, Optional, Tuple, Union

from .._core.atomic import write_file
from .._core.tempnames import (is_temp, parse_temp, remove_leftovers_in, temp_host, temp_name,
                               writer_gone)
from .._core.owner import check_directory_owner
from .._core.steps import FILE_SUFFIX, parse_step_name, step_name
from .._core.engine import fsync_dir
from .._core.dircommit import commit_directory, restore_aside
from ..errors import FormatError

log = logging.getLogger("fastckpt")

LATEST = "latest"
ABANDONED = "abandoned"               # checkpoints of an abandoned branch (a rollback) are moved here

# ------------------------------------------------------------------ which failures are damage

# What "this checkpoint is missing or incomplete" looks like as an OSError:
# the file or directory is not there (or not of its kind). Every other errno
# (EIO, EACCES, ENOMEM, ESTALE, EUCLEAN, ...) says the machine, the filesystem
# or the caller is in trouble, not the checkpoint: it propagates.
_DAMAGE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})


def failure_kind(e: BaseException) -> str:
    """How :meth:`CheckpointManager.load_latest` treats a failure to load one
    checkpoint: ``"damaged"`` (missing, incomplete or failing its checks: try
    the previous one), ``"refused"`` (the weights-only unpickler refused a
    value: raised, not corruption) or ``"error"`` (anything else: raised)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and type(e).__name__ == "CheckpointException":  # DCP wraps every rank's error
        kinds = {failure_kind(f[0] if isinstance(f, tuple) else f) for f in failures.values()}
        if not kinds or "error" in kinds:
            return "error"
        return "refused" if "refused" in kinds else "damaged"
    if isinstance(e, FormatError):
        return "damaged"
    if isinstance(e, pickle.UnpicklingError):
        return "refused"
    if isinstance(e, OSError):
        return "damaged" if e.errno in _DAMAGE_ERRNOS else "error"
    return "error"


def unwrap(e: BaseException) -> BaseException:
    """DCP's CheckpointException holding exactly one error: that error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and type(e).__name__ == "CheckpointException" and len(failures) == 1:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            e = inner
    return e

def load_report(err: Optional[BaseException]) -> Optional[Tuple[str, str, str]]:
    """What a rank tells the others of its try to load one checkpoint: None
    (loaded), else (error type, message, :func:`failure_kind`)."""
    if err is None:
        return None
    e = unwrap(err)
    return type(e).__name__, str(e), failure_kind(err)


def judge_load(path: Any, err: Optional[BaseException], reports: List[Any]) -> Optional[str]:
    """The verdict on one checkpoint from every rank's :func:`load_report`
    (``err``: this rank's own failure, or None): None when every rank loaded
    it; the reasons, rank by rank, when it is damaged (try the previous one).
    Anything else raises, on every rank alike: this rank's own error (with a
    note naming the checkpoint) where it failed so, a RuntimeError naming the
    ranks that failed elsewhere."""
    bad = [(r, g) for r, g in enumerate(reports) if g is not None]
    if not bad:
        return None
    kind = None if err is None else failure_kind(err)
    for what in ("error", "refused"):
        ranks = [r for r, g in bad if g[2] == what]
        if not ranks:
            continue
        if kind == what:
            e = unwrap(err)
            note = (f"fastckpt.CheckpointManager: raised while loading {path}; " +
                    ("not a damaged checkpoint, so older checkpoints were not tried"
                     if what == "error" else "the weights-only unpickler refused it (not corruption)"))
            if hasattr(e, "add_note"):
                e.add_note(note)
            if e is err:
                raise err
            raise e from err
        first = dict(bad)[ranks[0]]
        if what == "refused":
            raise RuntimeError(f"fastckpt.CheckpointManager: {path}: the weights-only unpickler refused it "
                               f"on rank(s) {ranks}: {first[1]}")
        raise RuntimeError(f"fastckpt.CheckpointManager: loading {path} failed on rank(s) {ranks} "
                           f"({first[0]}: {first[1]}); not a damaged checkpoint, so older checkpoints "
                           "were not tried")
    return "; ".join(f"rank {r}: {g[0]}: {g[1]}" for r, g in bad)


# ------------------------------------------------------------------ the directory

class StepDirectory:
    """The checkpoints of one directory and what is done with them. Never
    collective; the methods that change the directory are called on rank 0
    only (the manager sees to it). ``busy``: the final names of saves in
    flight, which rollback and retention never touch."""

    def __init__(self, directory: Union[str, os.PathLike], keep_last: Optional[int], sharded: bool):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (got {keep_last})")
        self.path = Path(directory)
        self.keep_last = keep_last
        self.sharded = sharded

    # ------------------------------------------------------------ names
    def name_for(self, step: int) -> str:
        return step_name(step, "" if self.sharded else FILE_SUFFIX)

    def parse(self, name: str) -> Optional[int]:
        return parse_step_name(name, "" if self.sharded else FILE_SUFFIX)

    def complete(self) -> List[Tuple[int, str]]:
        """Complete checkpoints as (step, name), oldest first."""
        found = []
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        for name in names:
            step = self.parse(name)
            if step is None:
                continue
            p = self.path / name
            if self.sharded and not (p.is_dir() and (p / ".metadata").is_file()):
                continue
            if not self.sharded and not p.is_file():
                continue
            found.append((step, name))
        return sorted(found)

    def latest_name(self, stacklevel: int = 2) -> Optional[str]:
        """The checkpoint the ``latest`` pointer names, or None."""
        try:
            text = (self.path / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        if self.parse(text) is None:
            warnings.warn(f"fastckpt.CheckpointManager: {self.path / LATEST} holds {text[:80]!r}, "
                          "which is not a checkpoint name; ignoring it", RuntimeWarning, stacklevel=stacklevel + 1)
            return None
        return text

    # ------------------------------------------------------------ preparing
    def prepare(self, clean: bool) -> None:
        """Rank 0, when the manager is made: check who owns the directory, make
        it if missing (durably), and remove the leftovers of crashed saves."""
        check_directory_owner(self.path)
        if not self.path.is_dir():
            self.path.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.path.parent)
        if clean:
            self.clean_temporaries()

    def new_temp_dir(self, name: str) -> str:
        """Rank 0: the temporary directory a sharded save of ``name`` is written into; returns its name."""
        tmp_name = temp_name(name, "dcp")
        (self.path / tmp_name).mkdir()
        return tmp_name

    # ------------------------------------------------------------ commit, rollback, retention
    def commit(self, name: str, busy: AbstractSet[str]) -> None:
        """The checkpoint ``name`` is complete and durable: point ``latest`` at
        it (atomically), then move an abandoned branch aside and apply
        retention."""
        data = (name + "\n").encode()
        write_file(self.path / LATEST, data)  # temporary file, fdatasync, rename over `latest`, directory fsync
        self.abandon_newer(self.parse(name), busy)
        self.prune(busy)

    def abandon_newer(self, step: int, busy: AbstractSet[str]) -> List[str]:
        """``latest`` now names ``step``: move the complete checkpoints of
        higher steps (an abandoned branch, see fastckpt/manager.py's docs) into
        ``abandoned/``. Returns their new paths."""
        newer = [n for s, n in self.complete() if s > step and n not in busy]
        if not newer:
            return []
        where = self.path / ABANDONED
        if not where.is_dir():
            where.mkdir(exist_ok=True)
            fsync_dir(self.path)
        moved = []
        for name in newer:
            dest, n = where / name, 0
            while dest.exists() or dest.is_symlink():
                n += 1
                dest = where / f"{name}.{n}"
            try:
                os.rename(self.path / name, dest)
            except FileNotFoundError:
                continue
            moved.append(str(dest))
        fsync_dir(where)
        fsync_dir(self.path)
        if moved:
            log.warning("fastckpt.CheckpointManager: step %d is older than %d checkpoint(s) in %s (a rollback): "
                        "that branch is abandoned; moved %s (never loaded, never deleted by retention)",
                        step, len(moved), self.path, ", ".join(moved))
        return moved

    def prune(self, busy: AbstractSet[str]) -> List[str]:
        """Retention: remove the complete checkpoints beyond the newest
        ``keep_last``, except the one ``latest`` names and those in ``busy``."""
        if self.keep_last is None:
            return []
        complete = self.complete()
        keep = {n for _, n in complete[-self.keep_last:]}
        latest = self.latest_name()
        protected = keep | set(busy) | ({latest} if latest else set())
        removed = []
        for step, name in complete:
            if name in protected:
                continue
            p = self.path / name
            try:
                if p.is_dir():  # rename first, so that a crash never leaves half a checkpoint under its name
                    doomed = self.path / temp_name(name, "del")
                    os.rename(p, doomed)
                    shutil.rmtree(doomed)
                else:
                    os.unlink(p)
                removed.append(name)
            except FileNotFoundError:
                pass
        if removed:
            fsync_dir(self.path)
            log.debug("fastckpt.CheckpointManager: retention removed %s", removed)
        return removed

    def publish_dir(self, tmp: Path, name: str) -> None:
        """Every rank's files and DCP's .metadata are written in ``tmp``: make
        the directory durable and put it at its final name (the one directory
        commit: a re-saved step is exchanged with the old one atomically, see
        fastckpt/_core/dircommit.py)."""
        commit_directory(tmp, self.path / name)

    # ------------------------------------------------------------ leftovers
    def clean_temporaries(self) -> List[str]:
        """Delete the leftovers of crashed saves of this host (see
        :meth:`CheckpointManager.clean_temporaries`). Returns the names removed."""
        removed: List[str] = []
        restored: List[str] = []
        foreign: List[str] = []
        unknown: List[str] = []
        engine_files = False
        me, uid = temp_host(), os.geteuid()
        for name in sorted(os.listdir(self.path)):
            if not is_temp(name):
                continue
            parsed = parse_temp(name)
            if parsed is None:
                unknown.append(name)
                continue
            info, kind = parsed.info, parsed.kind
            if info["host"] != me:
                foreign.append(name)
                continue
            p = self.path / name
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and kind is None:
                engine_files = True  # the engine's own files: its checks (lock included) decide
                continue
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)) or st.st_uid != uid:
                continue
            if not writer_gone(info):
                log.debug("fastckpt.CheckpointManager: keeping %s (process %d is alive)", name, info["pid"])
                continue
            try:
                kept = restore_aside(self.path, name) if stat.S_ISDIR(st.st_mode) else None
                if kept is not None:  # the only complete copy of a re-saved step: renamed back (or kept)
                    restored.append(os.path.basename(kept))
                    continue
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(p)
                else:
                    os.unlink(p)
                removed.append(name)
            except FileNotFoundError:
                pass
        if engine_files:
            removed.extend(remove_leftovers_in(str(self.path)))
        removed.sort()
        if restored:
            log.warning("fastckpt.CheckpointManager: renamed back %s in %s: a re-save was interrupted after "
                        "moving the old copy aside", ", ".join(restored), self.path)
        if removed:
            fsync_dir(self.path)
            log.warning("fastckpt.CheckpointManager: removed %d leftover temporary file(s) of interrupted saves "
                        "in %s: %s", len(removed), self.path, ", ".join(removed))
        if foreign:
            log.warning("fastckpt.CheckpointManager: kept %d temporary file(s) of other hosts in %s (never removed "
                        "from here: another node may be writing them; delete them by hand once no job there "
                        "writes to this directory): %s", len(foreign), self.path, ", ".join(foreign))
        if unknown:
            log.warning("fastckpt.CheckpointManager: kept %d temporary file(s) in %s whose name does not say which "
                        "host wrote them (an older fastckpt's): %s", len(unknown), self.path, ", ".join(unknown))
        return removed

    # ------------------------------------------------------------ restoring
    def candidates(self) -> List[Tuple[int, str]]:
        """The checkpoints a restore tries, in order: the one ``latest`` names,
        then the older complete ones, newest first (warnings: at the caller's
        caller, i.e. the user's call of load_latest)."""
        complete = self.complete()
        latest = self.latest_name()
        if latest is None:
            if complete:
                warnings.warn(f"fastckpt.CheckpointManager: {self.path / LATEST} is missing; trying the "
                              "complete checkpoints newest first", RuntimeWarning, stacklevel=3)
            return [(s, n) for s, n in reversed(complete)]
        top = self.parse(latest)
        newer = [n for s, n in complete if s > top]
        if newer:
            warnings.warn(f"fastckpt.CheckpointManager: not loading {', '.join(newer)} in {self.path}: "
                          f"newer than {latest}, which {LATEST} names (an abandoned branch after a rollback, or a "
                          "save that never committed)", RuntimeWarning, stacklevel=3)
        if latest not in {n for _, n in complete}:
            warnings.warn(f"fastckpt.CheckpointManager: {self.path / LATEST} names {latest}, "
                          "which is missing or incomplete; trying older checkpoints", RuntimeWarning, stacklevel=3)
        return [(s, n) for s, n in reversed(complete) if s <= top]
