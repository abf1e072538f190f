"""What the integrations share: importing a framework with a useful error,
and committing a whole checkpoint *directory* atomically and durably.
"""
import errno
import importlib
import os
import shutil
from typing import Callable, Optional, TypeVar, Union

from .._manager_policy import _replace_dir, _temp_name
from .._paths import check_dcp_target
from ..engine import fsync_dir

__all__ = ["require", "atomic_directory", "fsync_tree"]

T = TypeVar("T")


def require(module: str, pip_name: str, extra: str):
    """``importlib.import_module(module)``; if it is missing, an ImportError that
    names the pip package (and the fastckpt-io extra that pins it)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"fastckpt.integrations.{extra} needs {pip_name!r}, which is not installed "
            f"({e}): pip install {pip_name}  (or: pip install \"fastckpt-io[{extra}]\" for the tested version)",
            name=module) from e


def fsync_tree(root: str) -> None:
    """fsync every regular file under ``root`` (what the framework wrote with
    plain ``open``/``torch.save``; fastckpt's own files are durable already,
    an fsync of them is then cheap), then every directory, deepest first."""
    dirs = []
    for dirpath, _dirnames, filenames in os.walk(root):
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


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2 = None


def _exchange(a: str, b: str) -> bool:
    """Swap the directories ``a`` and ``b`` in one atomic step (Linux
    ``renameat2(RENAME_EXCHANGE)``): at every instant ``b`` names a complete
    directory, the old one or the new. False where the C library or the
    filesystem does not offer it (the caller then renames in two steps)."""
    global _renameat2
    if _renameat2 is None:
        try:
            import ctypes
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            _renameat2 = fn
        except (OSError, AttributeError):
            _renameat2 = False
    if not _renameat2:
        return False
    import ctypes
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # not offered here
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}", b)


def _commit_dir(content: str, final: str) -> None:
    """Put the finished directory ``content`` at ``final``, durably. Over an
    existing ``final``: an atomic exchange where the system offers one (the old
    directory, now at ``content``, is then removed), else the checkpoint
    manager's two renames (``_replace_dir``: a crash between them leaves
    ``final`` missing, its old and new versions under temporary names)."""
    if os.path.isdir(final) and not os.path.islink(final) and _exchange(content, final):
        fsync_dir(os.path.dirname(os.path.abspath(final)))
        shutil.rmtree(content, ignore_errors=True)
        return
    _replace_dir(content, final)


def atomic_directory(final: Union[str, os.PathLike], write: Callable[[str], T], inner: Optional[str] = None) -> T:
    """Run ``write(tmp)`` to fill a new temporary sibling directory of
    ``final`` (with ``inner``: to fill ``tmp/inner``, for a framework that
    names the checkpoint directory itself inside a directory it is given),
    make every file in it durable, then rename it to ``final`` (an existing
    ``final`` is replaced as a whole, see below) and fsync the parent. If ``write`` (or the commit) fails, the temporary directory is
    removed and ``final`` is untouched; the error is re-raised (an OSError
    that names a temporary path is renamed to name ``final``). A crash leaves
    ``final`` as it was or complete, plus possibly a temporary directory that
    ``fastckpt.CheckpointManager.clean_temporaries`` (or ``rm``) removes.

    The temporary name is the checkpoint manager's (``.<name>.fastckpt-tmp.<pid>.<host>....dcp``).
    A new ``final`` is one rename (the manager's ``_replace_dir``); an existing one is swapped
    atomically with ``renameat2(RENAME_EXCHANGE)`` where Linux offers it, so that ``final`` names a
    complete directory at every instant (else ``_replace_dir``'s two renames).
    """
    path = check_dcp_target(final).rstrip(os.sep)
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, _temp_name(name, "dcp"))
    os.mkdir(tmp)
    try:
        result = write(tmp)
        content = os.path.join(tmp, inner) if inner else tmp
        if not os.path.isdir(content):
            raise FileNotFoundError(errno.ENOENT, f"cannot save checkpoint directory {path!r}: nothing was written", path)
        fsync_tree(content)
        _commit_dir(content, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.filename and tmp in str(e.filename):
            raise OSError(e.errno, f"cannot save checkpoint directory {path!r}: {e.strerror or e} "
                          f"(while writing {e.filename!r}; {path!r} was left as it was)", path) from e
        raise
    if inner:
        shutil.rmtree(tmp, ignore_errors=True)  # what is left of it: the empty staging directory
    return result
