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


def atomic_directory(final: Union[str, os.PathLike], write: Callable[[str], T], inner: Optional[str] = None) -> T:
    """Run ``write(tmp)`` to fill a new temporary sibling directory of
    ``final`` (with ``inner``: to fill ``tmp/inner``, for a framework that
    names the checkpoint directory itself inside a directory it is given),
    make every file in it durable, then rename it to ``final``
    (an existing ``final`` is first moved aside, then removed) and fsync the
    parent. If ``write`` (or the commit) fails, the temporary directory is
    removed and ``final`` is untouched; the error is re-raised (an OSError
    that names a temporary path is renamed to name ``final``). A crash leaves
    ``final`` as it was or complete, plus a temporary directory that
    ``fastckpt.CheckpointManager.clean_temporaries`` (or ``rm``) removes.

    The temporary name is the checkpoint manager's (``.<name>.fastckpt-tmp.<pid>.<host>....dcp``),
    and the rename is its ``_replace_dir``: one directory commit for the whole project.
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
        _replace_dir(content, path)
        if inner:
            shutil.rmtree(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.filename and tmp in str(e.filename):
            raise OSError(e.errno, f"cannot save checkpoint directory {path!r}: {e.strerror or e} "
                          f"(while writing {e.filename!r}; {path!r} was left as it was)", path) from e
        raise
    return result
