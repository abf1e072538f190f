"""The one directory commit: every checkpoint that is a directory or a set of
files (a DCP checkpoint, the manager's sharded steps, a sharded safetensors
set, ``fastckpt convert --to dcp``, the framework integrations' checkpoint
directories, a restored remote step) is put in place through it.

The new checkpoint is written complete into a temporary sibling directory
(:func:`new_directory`, a ``.fastckpt-tmp.<key>.<pid>.<host>....dcp`` name of
this process); :func:`commit_directory` then makes every file and directory in
it durable and puts it at the final name:

* no ``final`` yet: one ``rename``, then an fsync of the parent;
* over an existing ``final``: one ``renameat2(RENAME_EXCHANGE)`` (the engine's
  :func:`fastckpt._C.rename_exchange`), then an fsync of the parent. At every
  instant, and after a crash or a power cut at any moment, ``final`` names a
  complete directory: the old one or the new one. Only after the parent's
  fsync (the new one is durable in place) is the old copy, now under the
  temporary name, removed.
* fallback, where the filesystem refuses the exchange (EINVAL/ENOSYS/EOPNOTSUPP:
  some FUSE and NFS mounts): the old directory is renamed aside to
  ``.fastckpt-tmp.<key>.<pid>.<host>....old``, the new one renamed to
  ``final``, the parent fsynced, the old copy removed. Between the two renames
  (two metadata operations, microseconds apart, with nothing written between
  them) ``final`` is missing, and a crash there leaves it missing with the old
  checkpoint complete under the ``.old`` name. That name is recognised:
  :func:`resolve` (what fastckpt's readers call for a checkpoint directory that
  is missing) finds the ``.old`` copy, and every cleanup of temporaries
  (:func:`restore_aside`: the manager's, ``convert``'s, the next commit of the
  same target) renames it back instead of deleting it. A reader that is not
  fastckpt's (the stock DCP reader, transformers) sees ENOENT in that window,
  as it would for a checkpoint not yet written.

Cleanup rule (every cleanup of temporaries follows it, through
:func:`restore_aside`): an ``.old`` directory whose final name is missing is
the only complete copy and is renamed back; one whose final name exists is the
replaced copy and may be removed; a ``.dcp`` directory is either an unfinished
new copy or, after an exchange, the replaced old one, and may be removed once
its process is gone.
"""

import errno
import logging
import os
import shutil
import stat
from typing import Callable, List, Optional, Union

from .. import _C
from .engine import fsync_dir
from .tempnames import is_temp, parse_temp, temp_key, temp_name, writer_gone

__all__ = ["new_directory", "commit_directory", "fsync_tree", "resolve", "restore_aside", "recover",
           "carry_entries"]

log = logging.getLogger("fastckpt")

PathLike = Union[str, "os.PathLike[str]"]


def _split(final: PathLike):
    path = os.path.abspath(os.fsdecode(os.fspath(final)).rstrip(os.sep))
    parent, name = os.path.split(path)
    return path, parent, name


def new_directory(final: PathLike) -> str:
    """Make the temporary sibling directory a new copy of ``final`` is written
    into (this process's temporary name, kind ``.dcp``) and return its path.
    The parent must exist."""
    _path, parent, name = _split(final)
    tmp = os.path.join(parent, temp_name(name, "dcp"))
    os.mkdir(tmp)
    return tmp


def fsync_tree(root: PathLike) -> None:
    """fsync every regular file under ``root`` (what a framework wrote with
    plain ``open``; fastckpt's own files are durable already, an fsync of them
    is then cheap), then every directory, deepest first."""
    dirs = []
    for dirpath, _dirnames, filenames in os.walk(os.fspath(root)):
        dirs.append(dirpath)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        fsync_dir(d)


def carry_entries(old: PathLike, new: PathLike, keep: Callable[[str], bool]) -> List[str]:
    """Give the new copy ``new`` the entries of the old directory ``old`` that
    ``keep(name)`` accepts and ``new`` lacks (files that are not part of the
    checkpoint, such as a model's ``config.json`` beside its shards): hard
    links, or copies where the filesystem refuses links. Returns their names."""
    carried = []
    for entry in sorted(os.listdir(old)):
        if is_temp(entry) or not keep(entry) or os.path.lexists(os.path.join(new, entry)):
            continue
        src, dst = os.path.join(old, entry), os.path.join(new, entry)
        st = os.lstat(src)
        if stat.S_ISDIR(st.st_mode):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISREG(st.st_mode):
            _link_or_copy(src, dst)
        else:
            continue
        carried.append(entry)
    return carried


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EMLINK, errno.EACCES):
            raise
        shutil.copy2(src, dst)


def commit_directory(tmp: PathLike, final: PathLike, keep: Optional[Callable[[str], bool]] = None) -> str:
    """Put the finished directory ``tmp`` (a sibling of ``final``, see
    :func:`new_directory`) at ``final``, durably and atomically (see the
    module's doc). ``keep``: over an existing ``final``, the names of its
    entries that the new copy inherits (:func:`carry_entries`); by default none
    (the directory is replaced as a whole). Returns how: ``"rename"`` (no
    ``final`` before), ``"exchange"`` or ``"fallback"`` (two renames: the
    filesystem refused the exchange).

    Raises:
        NotADirectoryError: ``final`` exists and is not a directory (nothing is changed).
        OSError: of the renames or fsyncs, naming the paths; ``final`` then
            still names the old copy or the new one, never neither (a failure
            of the fallback's second rename renames the old copy back).
    """
    tmp = os.path.abspath(os.fspath(tmp))
    path, parent, name = _split(final)
    recover(path)  # an old copy left aside by a crashed fallback goes back first
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
        raise NotADirectoryError(errno.ENOTDIR, f"cannot replace {path!r} with a checkpoint directory: it exists "
                                 "and is not a directory", path)
    if not os.path.lexists(path):
        fsync_tree(tmp)
        _C.rename(tmp, path)
        fsync_dir(parent)
        return "rename"
    if keep is not None:
        carry_entries(path, tmp, keep)
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))  # the replaced directory's permissions
    except OSError:
        pass
    fsync_tree(tmp)
    if _C.rename_exchange(tmp, path):
        fsync_dir(parent)  # the new copy is durable in place: only now may the old one go
        shutil.rmtree(tmp, ignore_errors=True)  # the old copy, under the temporary name
        log.debug("fastckpt: committed %s (renameat2 exchange)", path)
        return "exchange"
    aside = os.path.join(parent, temp_name(name, "old"))
    _C.rename(path, aside)
    try:
        _C.rename(tmp, path)
    except BaseException:
        try:
            _C.rename(aside, path)
        except OSError:
            pass  # left aside: resolve() and every cleanup recognise it
        raise
    fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)
    log.debug("fastckpt: committed %s (two renames: the filesystem refused renameat2 RENAME_EXCHANGE)", path)
    return "fallback"


def _asides(parent: str, name: str) -> List[str]:
    """The ``.old`` copies of ``name`` in ``parent``, newest first."""
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    found = []
    for e in entries:
        if not e.endswith(".old"):
            continue
        parsed = parse_temp(e)
        if parsed is None or parsed.kind != "old" or not parsed.is_for(name):
            continue
        p = os.path.join(parent, e)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                found.append((os.lstat(p).st_mtime_ns, p))
        except OSError:
            continue
    return [p for _, p in sorted(found, reverse=True)]


def _final_name(parent: str, parsed) -> Optional[str]:
    """The final name an ``.old`` copy stands for: spelled out in its name,
    or, where the name holds only a hash, the entry of ``parent`` with that
    hash (None when there is none: its final name is missing and unknown)."""
    if parsed.target is not None:
        return parsed.target
    try:
        entries = os.listdir(parent)
    except OSError:
        return None
    for e in entries:
        if not is_temp(e) and temp_key(e) == parsed.key:
            return e
    return None


def resolve(final: PathLike) -> str:
    """Where a reader finds the checkpoint directory ``final``: ``final``
    itself, or, where it is missing because a fallback commit was interrupted
    between its two renames, the complete old copy left aside (``.old``);
    ``final`` when there is neither (the caller's open then fails naming it).
    Never changes anything."""
    path, parent, name = _split(final)
    if os.path.lexists(path):
        return os.fspath(final)
    asides = _asides(parent, name)
    if asides:
        log.warning("fastckpt: %s is missing; reading the complete copy %s that an interrupted commit left "
                    "aside (the next cleanup of temporaries renames it back)", path, asides[0])
        return asides[0]
    return os.fspath(final)


def restore_aside(parent: PathLike, entry: str) -> Optional[str]:
    """For every cleanup of temporaries, before it removes the directory
    ``entry`` of ``parent``: if ``entry`` is an ``.old`` copy whose final name
    is missing (the only complete copy: a fallback commit was interrupted
    between its renames), rename it back, fsync ``parent`` and return the final
    path. None: ``entry`` may be removed. A path that is not renamed back is
    also returned (``entry``'s own) where the final name is missing and the
    name of ``entry`` holds only its hash: it must stay, for :func:`recover`
    of that final name to put it back."""
    parsed = parse_temp(entry)
    if parsed is None or parsed.kind != "old":
        return None
    parent = os.fspath(parent)
    name = _final_name(parent, parsed)
    if name is None:
        log.warning("fastckpt: keeping %s: the complete copy of a checkpoint whose name is missing after an "
                    "interrupted commit (the next save or load of that name puts it back)",
                    os.path.join(parent, entry))
        return os.path.join(parent, entry)
    final = os.path.join(parent, name)
    if os.path.lexists(final):
        return None
    return _put_back(parent, entry, final)


def _put_back(parent: str, entry: str, final: str) -> str:
    _C.rename(os.path.join(parent, entry), final)
    fsync_dir(parent)
    log.warning("fastckpt: %s was missing after an interrupted commit; renamed its complete copy %s back",
                final, entry)
    return final


def recover(final: PathLike) -> Optional[str]:
    """Where ``final`` is missing and an ``.old`` copy of a process that is
    gone sits beside it, rename the newest such copy back (see
    :func:`restore_aside`); returns ``final``'s path then, else None."""
    path, parent, name = _split(final)
    if os.path.lexists(path):
        return None
    for p in _asides(parent, name):
        parsed = parse_temp(os.path.basename(p))
        if parsed is not None and writer_gone(parsed.info):
            return _put_back(parent, os.path.basename(p), path)
    return None
