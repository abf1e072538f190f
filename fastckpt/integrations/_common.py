"""What the integrations share: importing a framework with a useful error,
and committing a whole checkpoint *directory* atomically and durably.
"""
import errno
import importlib
import os
import shutil
from typing import Any, Callable, Iterable, Optional, TypeVar, Union

from ..errors import RanksFailed
from ..manager.ranks import Ranks, failure_types
from .._core.dircommit import commit_directory, fsync_tree, new_directory
from .._core.paths import check_dcp_target

__all__ = ["require", "atomic_directory", "fsync_tree", "process_ranks", "agree"]

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


def agree(ranks: Ranks, err: Optional[BaseException], path: str, stage: str, payload: Any = None,
          action: str = "save") -> Any:
    """Collective: every process learns whether any failed while ``stage``
    (a barrier; the wait is bounded by the process group's timeout, and a
    process that died is noticed at once on gloo). Raises ``err`` on the
    process that failed, and on the others a
    :class:`~fastckpt.errors.RanksFailed` naming ``path``: naming the rank that
    failed and its error, or, when the collective itself failed (a process
    died or stopped answering), saying that contact with the other processes
    was lost (:meth:`Ranks.agree`). Returns rank 0's ``payload``."""
    what = f"{'saving' if action == 'save' else 'loading'} checkpoint directory {path!r} ({stage})"
    return ranks.agree(err, what, payload, who="fastckpt", path=path)


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
    :class:`~fastckpt.errors.RanksFailed` naming it elsewhere): rank 0 removes the temporary
    directory, and the processes raise after a last barrier, once it is gone.
    The waits are bounded by the process group's timeout; a collective that
    fails (a process died) raises a RanksFailed saying that contact was lost, naming ``final``. Every
    process must see the same filesystem at ``final``'s parent (a shared
    checkpoint filesystem): a process that does not see rank 0's temporary
    directory fails the save, saying so.

    The temporary name is the checkpoint manager's (``.fastckpt-tmp.<key>.<pid>.<host>....dcp``).
    The commit is the package's one directory commit
    (:func:`fastckpt._core.dircommit.commit_directory`): a new ``final`` is one rename; an existing
    one is swapped atomically with ``renameat2(RENAME_EXCHANGE)``, so that ``final`` names a
    complete directory at every instant (where the filesystem refuses the exchange, two renames
    whose interruption leaves the old copy aside under a name every cleanup renames back).
    """
    main = ranks is None or ranks.rank == 0
    path = os.path.abspath(os.fsdecode(os.fspath(final)).rstrip(os.sep))
    parent = os.path.dirname(path)
    failed_together = False  # every process is raising an error they agreed on

    def together(err: Optional[BaseException], stage: str, payload: Any = None) -> Any:
        nonlocal failed_together
        try:
            return agree(ranks, err, path, stage, payload)
        except RanksFailed as e:
            failed_together = e is err or not e.lost  # after a lost contact, no last barrier to wait at
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
            tmp = new_directory(path)
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
                commit_directory(content, path)  # fsyncs the tree; an existing one is exchanged atomically
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
