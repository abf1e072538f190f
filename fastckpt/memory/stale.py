"""Snapshots of jobs that are gone: found (:func:`scan`) and removed (:func:`clean`).

A memory directory (:func:`fastckpt.memory.memory_root`) holds one namespace per
checkpoint directory (:func:`fastckpt.memory.namespace_of`)::

    <root>/<namespace>/rank<R>/      slot<k>.pt, slot<k>.commit, owner.json
    <root>/<namespace>/replica<R>/   slot<k>.pt, slot<k>.commit (rank R's replicas)

``owner.json`` (``pid``, ``host``, ``directory``, ``rank``, ``since``) is written by
the process that uses the rank directory; the replica directories of a namespace
belong to the owners of its rank directories (the same node, the same job). A
namespace is *live* while one of its owners runs on this host (``kill(pid, 0)``,
and the process started before it claimed the directory, so a reused pid is not
taken for the owner), or while an owner is a process of another host (which
cannot be asked: live unless ``force``). A namespace with no owner at all is
stale.

Nothing outside the root is ever reached: every entry is looked at with
``lstat`` / ``O_NOFOLLOW`` and removed through the descriptor of the directory
that holds it, so a symbolic link is never followed (a link is left, and said
so). Only snapshot files (``slot<k>.pt``, ``slot<k>.commit``), ``owner.json`` and
the temporary files of those are removed, and only inside ``rank*`` /
``replica*`` directories; any other file is left and reported. An entry of the
root that holds no ``rank*`` / ``replica*`` directory is not a namespace of
ours: it is listed as foreign and never touched.
"""

import json
import os
import re
import socket
import stat
import time
from typing import Any, Dict, List, Optional

from .._core.tempnames import parse_temp, pid_alive, process_start
from .slots import SlotDir
from .tier import OWNER_FILE, memory_root

__all__ = ["scan", "clean", "clean_report", "is_live"]

_SLOT_DIR = re.compile(r"^(rank|replica)(\d+)$")
_OURS = re.compile(r"^slot\d+\.(pt|commit)$")
_MAX_OWNER = 1 << 16
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _is_ours(name: str) -> bool:
    """A file the memory tier writes into a slot directory (or a temporary of one)."""
    if _OURS.match(name) or name == OWNER_FILE:
        return True
    tmp = parse_temp(name)
    return tmp is not None and tmp.kind is None and tmp.target is not None and (
        bool(_OURS.match(tmp.target)) or tmp.target == OWNER_FILE)


def _boot_time() -> Optional[float]:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _owner_alive(owner: Dict[str, Any]) -> Optional[bool]:
    """True / False for a process of this host, None for one of another host (unknown)."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if owner.get("host") != socket.gethostname():
        return None
    if not pid_alive(pid):
        return False
    since, ticks, btime = owner.get("since"), process_start(pid), _boot_time()
    if isinstance(since, (int, float)) and ticks and btime is not None:
        started = btime + ticks / os.sysconf("SC_CLK_TCK")
        if started > since + 2.0:  # this pid is a later process than the one that claimed the directory
            return False
    return True


def _read_owner(dir_fd: int) -> Optional[Dict[str, Any]]:
    """owner.json of a slot directory (a regular file only), None if none or unreadable."""
    try:
        fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, _MAX_OWNER + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        owner = json.loads(raw) if len(raw) <= _MAX_OWNER else None
    except ValueError:
        return None
    return owner if isinstance(owner, dict) else None


def _lstat(name: str, dir_fd: int) -> Optional[os.stat_result]:
    """lstat of an entry of `dir_fd`, None if it went away meanwhile."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _open_dir(name: str, dir_fd: Optional[int] = None) -> Optional[int]:
    try:
        return os.open(name, _O_DIR, dir_fd=dir_fd)
    except OSError:
        return None


def _scan_namespace(root_fd: int, root: str, name: str) -> Optional[Dict[str, Any]]:
    """The entry of namespace `name` (see :func:`scan`), None if it is not one of ours."""
    path = os.path.join(root, name)
    ns_fd = _open_dir(name, root_fd)
    if ns_fd is None:
        return None
    try:
        subdirs = []
        others = []
        for entry in sorted(os.listdir(ns_fd)):
            st = _lstat(entry, ns_fd)
            m = _SLOT_DIR.match(entry)
            if st is None:
                continue
            if m and stat.S_ISDIR(st.st_mode):
                subdirs.append((entry, m.group(1), int(m.group(2))))
            else:
                others.append(os.path.join(path, entry))
        if not subdirs:
            return None
        ranks, replicas, owners, directories = [], [], [], []
        nbytes, newest, mtime, files = 0, None, 0.0, 0
        for entry, kind, r in subdirs:
            (ranks if kind == "rank" else replicas).append(r)
            sub_fd = _open_dir(entry, ns_fd)
            if sub_fd is None:
                others.append(os.path.join(path, entry))
                continue
            try:
                mtime = max(mtime, os.fstat(sub_fd).st_mtime)
                regular = set()
                for f in os.listdir(sub_fd):
                    st = _lstat(f, sub_fd)
                    if st is None:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        regular.add(f)
                        nbytes += st.st_blocks * 512
                        mtime = max(mtime, st.st_mtime)
                        files += 1
                    if not (stat.S_ISREG(st.st_mode) and _is_ours(f)):
                        others.append(os.path.join(path, entry, f))
                if kind == "rank" and OWNER_FILE in regular:
                    owner = _read_owner(sub_fd)
                    if owner is not None:
                        owner = {k: owner.get(k) for k in ("pid", "host", "directory", "rank", "since")}
                        owner["alive"] = _owner_alive(owner)
                        owners.append(owner)
                        if isinstance(owner["directory"], str) and owner["directory"] not in directories:
                            directories.append(owner["directory"])
                sd = SlotDir(os.path.join(path, entry), keep=1)
                for k in sd.slots():  # only slots whose two files are regular files (no link is followed)
                    if f"slot{k}.pt" in regular and f"slot{k}.commit" in regular:
                        rec = sd.read_record(k)
                        if rec is not None and (newest is None or rec.step > newest):
                            newest = rec.step
            finally:
                os.close(sub_fd)
        if not files:
            mtime = max(mtime, os.fstat(ns_fd).st_mtime)
    finally:
        os.close(ns_fd)
    alive = [o["alive"] for o in owners]
    return {"kind": "namespace", "path": path, "name": name, "directories": directories,
            "ranks": sorted(ranks), "replicas": sorted(replicas), "bytes": nbytes, "newest_step": newest,
            "owners": owners, "owner_alive": True if True in alive else None if None in alive else False,
            "age": max(0.0, time.time() - mtime), "live": True in alive or None in alive, "other_files": others}


def is_live(entry: Dict[str, Any], force: bool = False) -> bool:
    """Whether a namespace entry of :func:`scan` is held by a process: one of this host
    that runs, or (unless `force`) one of another host, which cannot be asked."""
    return entry["owner_alive"] is True or (entry["owner_alive"] is None and bool(entry["owners"]) and not force)


def scan(root: Optional[str] = None) -> List[Dict[str, Any]]:
    """What the memory directory `root` (default :func:`memory_root`) holds: one entry per
    entry of the root, sorted by name.

    A namespace of ours is ``{"kind": "namespace", "path", "name", "directories"
    (the checkpoint directories its owner files name), "ranks", "replicas" (the
    numbers of its rank* / replica* directories), "bytes" (st_blocks x 512 of
    their files), "newest_step" (the newest complete snapshot, None: none),
    "owners" ([{"pid", "host", "directory", "rank", "since", "alive"}]; alive None:
    a process of another host), "owner_alive" (True: one runs; None: unknown;
    False: none), "age" (seconds since its newest file was written), "live"
    (held by a process, unknown counted as live), "other_files" (what is not the
    memory tier's: never removed)}``. Anything else is ``{"kind": "foreign",
    "path", "why"}``.

    Raises:
        FileNotFoundError: `root` does not exist.
    """
    root = memory_root(root)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        out = []
        for name in sorted(os.listdir(root_fd)):
            st = _lstat(name, root_fd)
            if st is None:
                continue
            entry = _scan_namespace(root_fd, root, name) if stat.S_ISDIR(st.st_mode) else None
            if entry is None:
                why = ("a symbolic link (not followed)" if stat.S_ISLNK(st.st_mode)
                       else "not a directory" if not stat.S_ISDIR(st.st_mode)
                       else "no rank*/replica* directories")
                entry = {"kind": "foreign", "path": os.path.join(root, name), "why": why}
            out.append(entry)
        return out
    finally:
        os.close(root_fd)


def _rmdir(name: str, dir_fd: int, dry_run: bool, left: List[Dict[str, str]], path: str) -> bool:
    if dry_run:
        return True
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as e:
        left.append({"path": path, "why": f"not removed: {os.strerror(e.errno)}"})  # something new in it
        return False
    return True


def _remove_namespace(root_fd: int, entry: Dict[str, Any], dry_run: bool) -> Dict[str, Any]:
    removed: List[str] = []
    left: List[Dict[str, str]] = []
    path = entry["path"]
    ns_fd = _open_dir(entry["name"], root_fd)
    if ns_fd is None:
        return {"path": path, "removed": removed, "left": [{"path": path, "why": "cannot be opened"}]}
    try:
        for sub in sorted(os.listdir(ns_fd)):
            st = _lstat(sub, ns_fd)
            if st is None:
                continue
            if not (_SLOT_DIR.match(sub) and stat.S_ISDIR(st.st_mode)):
                left.append({"path": os.path.join(path, sub),
                             "why": "a symbolic link (not followed)" if stat.S_ISLNK(st.st_mode)
                             else "not a memory tier directory"})
                continue
            sub_fd = _open_dir(sub, ns_fd)
            if sub_fd is None:
                left.append({"path": os.path.join(path, sub), "why": "cannot be opened"})
                continue
            kept = 0
            try:
                names = sorted(os.listdir(sub_fd))
                # commit records first: a slot without its record is incomplete, never taken for a snapshot
                names.sort(key=lambda n: 0 if n.endswith(".commit") else 1)
                for f in names:
                    fp = os.path.join(path, sub, f)
                    fst = _lstat(f, sub_fd)
                    if fst is None:
                        continue
                    if not stat.S_ISREG(fst.st_mode):
                        left.append({"path": fp, "why": "a symbolic link (not followed)" if stat.S_ISLNK(fst.st_mode)
                                     else "not a regular file"})
                        kept += 1
                    elif not _is_ours(f):
                        left.append({"path": fp, "why": "not a memory tier file"})
                        kept += 1
                    else:
                        if not dry_run:
                            try:
                                os.unlink(f, dir_fd=sub_fd)
                            except FileNotFoundError:
                                continue
                        removed.append(fp)
            finally:
                os.close(sub_fd)
            if not kept and _rmdir(sub, ns_fd, dry_run, left, os.path.join(path, sub)):
                removed.append(os.path.join(path, sub))
    finally:
        os.close(ns_fd)
    if not left and _rmdir(entry["name"], root_fd, dry_run, left, path):
        removed.append(path)
    return {"path": path, "removed": removed, "left": left}


def clean_report(root: Optional[str] = None, older_than: Optional[float] = None, dry_run: bool = False,
                 force: bool = False) -> List[Dict[str, Any]]:
    """:func:`clean`, per namespace: ``[{"path", "bytes", "newest_step", "directories",
    "removed" (paths, in removal order; the namespace's own path last when it is gone),
    "left" ([{"path", "why"}]: what was not the memory tier's, left in place)}]``."""
    if older_than is not None and older_than < 0:
        raise ValueError(f"older_than must be >= 0 seconds (got {older_than!r})")
    root = memory_root(root)
    out = []
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for entry in scan(root):
            if entry["kind"] != "namespace":
                continue
            entry = _scan_namespace(root_fd, root, entry["name"])  # afresh, just before removing
            if entry is None or is_live(entry, force) or (older_than is not None and entry["age"] < older_than):
                continue
            rep = _remove_namespace(root_fd, entry, dry_run)
            if not rep["removed"]:  # only what is not ours is left in it (reported by scan's other_files)
                continue
            rep.update(bytes=entry["bytes"], newest_step=entry["newest_step"], directories=entry["directories"])
            out.append(rep)
    finally:
        os.close(root_fd)
    return out


def clean(root: Optional[str] = None, older_than: Optional[float] = None, dry_run: bool = False,
          force: bool = False) -> List[str]:
    """Remove the namespaces of the memory directory `root` (default :func:`memory_root`)
    that no live process holds (see :func:`is_live`; `force`: owners of other hosts
    count as gone) and, with `older_than` (seconds), only those not written to for
    that long.

    Returns:
        The paths removed (or, `dry_run`, that would be), in removal order: files,
        then their directories; a namespace's path is in it when the namespace is
        gone, not when files that are not the memory tier's were left in it.

    Raises:
        FileNotFoundError: `root` does not exist.
        ValueError: a negative `older_than`.
    """
    return [p for rep in clean_report(root, older_than, dry_run, force) for p in rep["removed"]]
