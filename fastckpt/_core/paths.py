"""What can be checked about a save target before any data is written.

Every writer (``fastckpt.save``, ``fastckpt.async_save``, the DCP
``FastWriter``) calls one of these first, so that a careless path fails at
once, with a message in the user's terms: the path they gave and the cause
("parent directory /ckpt/run3 does not exist"), never only the engine's
temporary name, and never after gigabytes were written.

The errors are ``OSError`` subclasses built from an errno (so
``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError``,
``NotADirectoryError`` arise as usual) whose ``filename`` is the user's path;
a URL raises :class:`fastckpt.errors.UnsupportedURLError`. The checks cannot
rule out every failure (the disk may fill up, another process may remove the
directory meanwhile): errors raised later by the engine are renamed to the
user's path by :func:`raise_named_after_target`.
"""

import errno
import os
import re
import stat
from typing import Optional, Union

from ..errors import UnsupportedURLError

__all__ = ["is_url", "check_save_target", "check_dcp_target", "check_not_url", "open_for_reading", "no_readahead",
           "raise_named_after_target"]

# scheme://... (RFC 3986 scheme). "s3:/x" or "c:x" are ordinary relative paths.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_path(f) -> bool:
    """A filesystem path (str or os.PathLike), as opposed to a file object."""
    return isinstance(f, (str, os.PathLike))


def is_url(s) -> bool:
    """``scheme://...`` (a str): fastckpt.save/load send it to fastckpt.remote."""
    return isinstance(s, str) and _URL.match(s) is not None


def _err(code: int, path: str, why: str) -> OSError:
    """OSError(code) (its subclass for that errno) naming the user's path."""
    return OSError(code, f"cannot save to {path!r}: {why}", path)


def check_not_url(path: str, what: str = "save to") -> None:
    """Refuse ``scheme://...`` strings (fastckpt writes local paths only, for now)."""
    m = _URL.match(path)
    if m:
        raise UnsupportedURLError(
            f"fastckpt cannot {what} {path!r}: URLs ({m.group(1)}://) are not supported yet; "
            "give a local (or mounted) filesystem path")


def _stat(path: str) -> Optional[os.stat_result]:
    """stat() that returns None for a missing path and raises every other error."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _check_dir(d: str, path: str, role: str) -> None:
    """`d` (which the path lookup reached) is a directory we may create files in."""
    try:
        st = os.stat(d)
    except FileNotFoundError:
        raise _err(errno.ENOENT, path, f"{role} {d!r} does not exist") from None
    except NotADirectoryError:
        raise _err(errno.ENOTDIR, path, f"a component of {d!r} is not a directory") from None
    except PermissionError:
        raise _err(errno.EACCES, path, f"permission denied while looking up {role} {d!r}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _err(errno.ENOTDIR, path, f"{role} {d!r} is not a directory")
    eff = os.access in os.supports_effective_ids
    if os.access(d, os.W_OK | os.X_OK, effective_ids=eff):
        return
    try:
        read_only = bool(os.statvfs(d).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise _err(errno.EROFS, path, f"{role} {d!r} is on a read-only filesystem")
    raise _err(errno.EACCES, path, f"no permission to create files in {role} {d!r}")


def check_save_target(f: Union[str, os.PathLike]) -> str:
    """Check that a checkpoint file can be written at ``f``; return it as a str.

    Refused at once: a URL (``UnsupportedURLError``), an existing directory or a
    name ending with ``/`` (``IsADirectoryError``), a missing parent directory
    (``FileNotFoundError``), a parent that is not a directory
    (``NotADirectoryError``), a parent the caller cannot create files in
    (``PermissionError``, or ``OSError(EROFS)`` on a read-only filesystem).
    Each names ``f`` (message and ``filename``) and the cause.
    """
    path = os.fsdecode(os.fspath(f))
    check_not_url(path)
    if not path:
        raise FileNotFoundError(errno.ENOENT, "cannot save to '': empty path", path)
    try:
        st = _stat(path)
    except (PermissionError, NotADirectoryError):
        st = None  # the parent's check below says which component is at fault
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise _err(errno.EISDIR, path, "it is an existing directory (give a file name)")
    if path.endswith(os.sep):
        raise _err(errno.EISDIR, path, "the name ends with '/' (give a file name)")
    _check_dir(os.path.dirname(path) or ".", path, "parent directory")
    return path


def check_dcp_target(d: Union[str, os.PathLike]) -> str:
    """Check that a DCP checkpoint directory can be written at ``d``; return it as a str.

    ``d`` may not exist yet (it is created with its missing parents, as
    torch's FileSystemWriter does); it must not be a file, and the directory
    that will hold the checkpoint's files (``d`` itself, or its nearest
    existing ancestor) must be writable.
    """
    path = os.fsdecode(os.fspath(d))
    check_not_url(path)
    if not path:
        raise FileNotFoundError(errno.ENOENT, "cannot save to '': empty path", path)
    probe = path.rstrip(os.sep) or os.sep
    while True:
        try:
            st = _stat(probe)
        except NotADirectoryError:
            st = None  # a file on the way up: found below
        except PermissionError:
            raise _err(errno.EACCES, path, f"permission denied while looking up {probe!r}") from None
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                what = "it is an existing file, not a directory" if probe == path.rstrip(os.sep) else \
                    f"{probe!r} is not a directory"
                raise _err(errno.ENOTDIR, path, what)
            _check_dir(probe, path, "checkpoint directory" if probe == path.rstrip(os.sep) else "directory")
            return path
        parent = os.path.dirname(probe) or "."
        if parent == probe:
            return path
        probe = parent


def no_readahead(fd: int) -> int:
    """Turn the kernel's readahead off for the open file `fd` (POSIX_FADV_RANDOM;
    advisory, errors ignored) and return `fd`. A checkpoint's metadata (a zip's
    data.pkl and central directory, a safetensors header) is read through such a
    descriptor: with readahead, a 64 KiB read would pull megabytes of tensor data
    into the page cache, which the engine's O_DIRECT reads then read again."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except (AttributeError, OSError):  # not Linux, or a file that takes no advice (a pipe)
        pass
    return fd


def open_for_reading(path: str):
    """``open(path, "rb")`` for a checkpoint whose data the engine reads
    (readahead off: :func:`no_readahead`); a missing path that is a URL says
    URLs are not supported (:class:`UnsupportedURLError`) rather than "no
    such file"."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        check_not_url(os.fsdecode(path), "load")
        raise
    no_readahead(f.fileno())
    return f


def raise_named_after_target(e: OSError, path: str) -> None:
    """Raise ``e`` (raised by the engine while writing ``path`` under a
    temporary name) as an error of the same errno and type whose message and
    ``filename`` name ``path`` (the engine's name stays in the message and in
    ``filename2``); return if ``e`` already names ``path`` (the caller then
    re-raises it). No local holds the new error, so the failed writer in the
    traceback's frames is freed as soon as the error is (no reference cycle)."""
    if e.filename == path or e.errno is None:
        return
    why = e.strerror or str(e)
    if path not in why:
        why = f"cannot save to {path!r}: {why}"
    raise OSError(e.errno, why, path, None, e.filename) from e
