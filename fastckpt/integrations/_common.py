"""What the integrations share: importing a framework with a useful error,
and committing a whole checkpoint *directory* atomically and durably.
"""
import errno
import importlib
import os
import shutil
from typing import Any, Callable, Iterable, Optional, TypeVar, Union

from ..manager.ranks import PeerFailed, Ranks, failure_types
from ..manager.policy import _replace_dir
from .._core.tempnames import temp_name
from .._core.paths import check_dcp_target
from .._core.engine import fsync_dir

__all__ = ["require", "atomic_directory", "fsync_tree", "process_ranks", "agree", "LostContact"]

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


def process_ranks(world_size: int) -> Optional[Ranks]:
    """The processes of a data-parallel job that save one checkpoint directory
    together (torch.distributed's default group), or None for a job of one
    process. ``world_size`` is the framework's count; torch.distributed must
    agree with it."""
    if world_size <= 1:
        return None
    ranks = Ranks()
    if not ranks.dist or ranks.world_size != world_size:
        raise RuntimeError(f"fastckpt: the framework reports {world_size} processes but torch.distributed "
                           f"{'reports ' + str(ranks.world_size) if ranks.dist else 'is not initialized'}")
    return ranks


class LostContact(RuntimeError):
    """A collective of a checkpoint save or load failed: another process died or stopped answering."""


def agree(ranks: Ranks, err: Optional[BaseException], path: str, stage: str, payload: Any = None,
          action: str = "save") -> Any:
    """Collective: every process learns whether any failed while ``stage``
    (a barrier; the wait is bounded by the process group's timeout, and a
    process that died is noticed at once on gloo). Raises ``err`` on the
    process that failed, :class:`~fastckpt.manager.ranks.PeerFailed` (a
    RuntimeError naming that rank and its error) on the others, and a
    :class:`LostContact` (a RuntimeError naming ``path``) when the collective
    itself fails (a process died or stopped answering). Returns rank 0's
    ``payload``."""
    what = f"{'saving' if action == 'save' else 'loading'} checkpoint directory {path!r} ({stage})"
    try:
        return ranks.agree(err, what, payload, who="fastckpt")
    except BaseException as e:
        if e is err or isinstance(e, PeerFailed):
            raise
        if err is not None:
            raise err from e
        raise LostContact(f"fastckpt: cannot {action} checkpoint directory {path!r}: lost contact with the other "
                           f"processes while {stage} ({type(e).__name__}: {e})") from e


def _naming_final(e: BaseException, tmp: str, path: str) -> BaseException:
    """``e``, or for an OSError that names the temporary directory, one that names ``path``."""
    if isinstance(e, OSError) and e.filename and tmp in str(e.filename):
        out = OSError(e.errno, f"cannot save checkpoint directory {path!r}: {e.strerror or e} "
                      f"(while writing {e.filename!r}; {path!r} was left as it was)", path)
        out.__cause__ = e
        return out
    return e


def _fsync_files(paths: Iterable[str]) -> None:
    for p in paths:
        if os.path.isfile(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def atomic_directory(final: Union[str, os.PathLike], write: Callable[[str], T], inner: Optional[str] = None, *,
                     ranks: Optional[Ranks] = None, own: Iterable[str] = (),
                     after_commit: Optional[Callable[[], None]] = None) -> T:
    """Run ``write(tmp)`` to fill a new temporary sibling directory of
    ``final`` (with ``inner``: to fill ``tmp/inner``, for a framework that
    names the checkpoint directory itself inside a directory it is given),
    make every file in it durable, then rename it to ``final`` (an existing
    ``final`` is replaced as a whole, see below), fsync the parent and run
    ``after_commit()`` (rotation of older checkpoints). If ``write`` (or the
    commit) fails, the temporary directory is removed and ``final`` is
    untouched; the error is re-raised (an OSError that names a temporary path
    is renamed to name ``final``). An error of ``after_commit`` is raised too,
    ``final`` then being committed. A crash leaves ``final`` as it was or
    complete, plus possibly a temporary directory that
    ``fastckpt.CheckpointManager.clean_temporaries`` (or ``rm``) removes.

    With ``ranks`` (the processes of a data-parallel job, :func:`process_ranks`),
    collective: rank 0 makes the temporary directory and every process learns
    its name; every process runs ``write(tmp)`` (each writes its own files into
    the one directory: rank 0 the shared state, the others what is theirs) and
    fsyncs the files named in ``own`` (relative to the checkpoint directory,
    those that exist); a barrier; rank 0 fsyncs every file and directory,
    renames, fsyncs the parent and runs ``after_commit``; a last barrier. A
    failure on any process fails the save on every process (its error there,
    :class:`PeerFailed` naming it elsewhere): rank 0 removes the temporary
    directory, and the processes raise after a last barrier, once it is gone.
    The waits are bounded by the process group's timeout; a collective that
    fails (a process died) raises :class:`LostContact` naming ``final``. Every
    process must see the same filesystem at ``final``'s parent (a shared
    checkpoint filesystem): a process that does not see rank 0's temporary
    directory fails the save, saying so.

    The temporary name is the checkpoint manager's (``.<name>.fastckpt-tmp.<pid>.<host>....dcp``).
    A new ``final`` is one rename (the manager's ``_replace_dir``); an existing one is swapped
    atomically with ``renameat2(RENAME_EXCHANGE)`` where Linux offers it, so that ``final`` names a
    complete directory at every instant (else ``_replace_dir``'s two renames).
    """
    main = ranks is None or ranks.rank == 0
    path = os.path.abspath(os.fsdecode(os.fspath(final)).rstrip(os.sep))
    parent, name = os.path.split(path)
    failed_together = False  # every process is raising an error they agreed on

    def together(err: Optional[BaseException], stage: str, payload: Any = None) -> Any:
        nonlocal failed_together
        try:
            return agree(ranks, err, path, stage, payload)
        except LostContact:
            raise
        except BaseException:
            failed_together = True
            raise

    tmp = None
    if main:
        err = None
        try:
            check_dcp_target(final)  # on the main process only: every process learns what is wrong with it
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, temp_name(name, "dcp"))
            os.mkdir(tmp)
        except failure_types() as e:  # noqa: BLE001
            if ranks is None:
                raise
            err, tmp = e, None
        if ranks is not None:
            agree(ranks, err, path, "making its temporary directory", tmp)
    else:
        tmp = agree(ranks, None, path, "making its temporary directory")
    content = os.path.join(tmp, inner) if inner else tmp
    try:
        if ranks is None:
            try:
                result = write(tmp)
            except BaseException as e:
                named = _naming_final(e, tmp, path)
                if named is e:
                    raise
                raise named
        else:
            err = result = None
            try:
                if not main and not os.path.isdir(tmp):
                    raise FileNotFoundError(
                        errno.ENOENT, f"cannot save checkpoint directory {path!r}: rank {ranks.rank} does not see "
                        f"rank 0's temporary directory {tmp!r} (every process must see the same filesystem there)",
                        path)
                result = write(tmp)
                _fsync_files(os.path.join(content, n) for n in own)
            except failure_types() as e:  # noqa: BLE001
                err = _naming_final(e, tmp, path)
            together(err, "writing its files")
        err = None
        if main:
            try:
                if not os.path.isdir(content):
                    raise FileNotFoundError(errno.ENOENT,
                                            f"cannot save checkpoint directory {path!r}: nothing was written", path)
                fsync_tree(content)
                _commit_dir(content, path)
                if after_commit is not None:
                    after_commit()
            except failure_types() as e:  # noqa: BLE001
                err = _naming_final(e, tmp, path)
                if ranks is None:
                    if err is e:
                        raise
                    raise err
        if ranks is not None:
            together(err, "committing it")
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        if failed_together:  # so that no process returns before the temporary directory is gone
            try:
                ranks.gather(None)
            except Exception:  # noqa: BLE001 - a process died meanwhile: the error raised says enough
                pass
        raise
    if main and inner:
        shutil.rmtree(tmp, ignore_errors=True)  # what is left of it: the empty staging directory
    return result
