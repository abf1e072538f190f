"""Lightning checkpoints through fastckpt.

``Trainer(plugins=[FastCheckpointIO()])`` (or ``Fabric(plugins=[...])``) makes
every checkpoint Lightning writes (``ModelCheckpoint``, ``trainer.save_checkpoint``,
``fabric.save``) a :func:`fastckpt.save` file: written with O_DIRECT under a
temporary name, fdatasync'd, renamed into place, the directory fsync'd, with a
CRC-32 per storage. Lightning's default (``TorchCheckpointIO``) serializes the
whole checkpoint into memory and writes it without fsync. The files are
ordinary torch.save archives: ``torch.load`` and ``Trainer.fit(ckpt_path=...)``
with the default plugin read them too, and this plugin reads files the default
one wrote.

:class:`AsyncFastCheckpointIO` saves in the background with
:func:`fastckpt.async_save`: the call returns once the checkpoint is pickled and
its tensors are copied into reused staging memory (that copy is the only one:
Lightning's ``AsyncCheckpointIO`` clones every tensor and then its wrapped
plugin serializes the clones into memory again).

Requires ``lightning`` (``pip install "fastckpt-io[lightning]"``).
"""
import errno
import logging
import os
import shutil
from typing import Any, Dict, Optional

from ._common import require

require("lightning", "lightning", "lightning")
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402

from .. import serialization as _ser  # noqa: E402
from ..saver import AsyncSaver, SaveFuture  # noqa: E402
from .._core import paths as _paths  # noqa: E402
from .._core.engine import fsync_dir  # noqa: E402

__all__ = ["FastCheckpointIO", "AsyncFastCheckpointIO"]

log = logging.getLogger("fastckpt")


URL_MODES = ("torch", "error")


def _is_url(path: Any) -> bool:
    p = os.fsdecode(os.fspath(path))
    return "://" in p and not p.startswith("file://")


def _local_path(path: Any) -> str:
    p = os.fsdecode(os.fspath(path))
    return p[len("file://"):] if p.startswith("file://") else p


def _no_storage_options(plugin: CheckpointIO, storage_options: Any) -> None:
    if storage_options is not None:  # as TorchCheckpointIO
        raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                        f"{type(plugin).__name__} (fastckpt has no storage options)")


class FastCheckpointIO(TorchCheckpointIO):
    """A Lightning ``CheckpointIO`` that writes and reads through fastckpt.

    A subclass of Lightning's default ``TorchCheckpointIO`` (code that checks
    ``isinstance(..., TorchCheckpointIO)`` takes it as the default): local
    paths (and ``file://``) go through fastckpt; a URL (``s3://``,
    ``memory://``, any other fsspec protocol) is Lightning's own
    ``TorchCheckpointIO`` path, as without this plugin (written through
    fsspec, without fastckpt's durable atomic commit; logged once at WARNING
    level), unless ``urls="error"``.

    Args:
        verify: passed to :func:`fastckpt.load` (``None``: check every storage
            against its CRC-32 when the file has them).
        urls: ``"torch"`` (the default): URLs are saved, loaded and removed by
            ``TorchCheckpointIO``; ``"error"``: a URL raises
            :class:`fastckpt.UnsupportedURLError` (a job that must not write
            a checkpoint without fastckpt's guarantees).

    Example:
        >>> trainer = lightning.pytorch.Trainer(plugins=[FastCheckpointIO()],
        ...                                     callbacks=[ModelCheckpoint(save_top_k=2, monitor="val_loss")])
    """

    def __init__(self, verify: Optional[bool] = None, urls: str = "torch"):
        super().__init__()
        if urls not in URL_MODES:
            raise ValueError(f"urls={urls!r}: expected one of {', '.join(map(repr, URL_MODES))}")
        self.verify = verify
        self.urls = urls
        self._warned_url = False

    def _url(self, path: Any, what: str) -> bool:
        """Whether ``path`` is a URL for TorchCheckpointIO (refused with ``urls="error"``)."""
        if not _is_url(path):
            return False
        p = os.fsdecode(os.fspath(path))
        if self.urls == "error":
            from ..errors import UnsupportedURLError
            raise UnsupportedURLError(f"fastckpt's Lightning plugin cannot {what} {p!r}: only local (or mounted) "
                                      "paths are written by fastckpt, and urls='error' refuses the rest "
                                      "(urls='torch' hands them to Lightning's TorchCheckpointIO)")
        if not self._warned_url:
            self._warned_url = True
            log.warning("fastckpt Lightning plugin: %r is a URL: Lightning's TorchCheckpointIO handles it "
                        "(through fsspec, without fastckpt's durable atomic commit); later URLs are not logged", p)
        return True

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """:func:`fastckpt.save` the checkpoint to ``path`` (its parent
        directory is created, as Lightning's default plugin does): durable and
        atomic when this returns."""
        _no_storage_options(self, storage_options)
        if self._url(path, "save to"):
            return TorchCheckpointIO.save_checkpoint(self, checkpoint, path, storage_options)
        p = _local_path(path)
        parent = os.path.dirname(p)
        if parent:
            os.makedirs(parent, exist_ok=True)
        _ser.save(checkpoint, p)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """:func:`fastckpt.load` ``path`` with Lightning's ``map_location`` and
        ``weights_only`` (``None``, what ``Trainer.fit`` passes unless told
        otherwise, means what it means to ``torch.load``: weights-only, which
        reads Lightning's own checkpoints; give ``weights_only=False`` to
        ``fit``/``load`` for checkpoints holding arbitrary objects you trust)."""
        if self._url(path, "load"):
            return TorchCheckpointIO.load_checkpoint(self, path, map_location, weights_only)
        p = _local_path(path)
        if not os.path.exists(p):  # the default plugin's error, naming the path
            raise FileNotFoundError(errno.ENOENT, f"Checkpoint file not found: {p}", p)
        return _ser.load(p, map_location=map_location, weights_only=weights_only, verify=self.verify)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` (a file, or a directory as the default plugin
        allows) and fsync its parent so that the removal is durable too."""
        if self._url(path, "remove"):
            return TorchCheckpointIO.remove_checkpoint(self, path)
        p = _local_path(path)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)
        else:
            return
        fsync_dir(os.path.dirname(os.path.abspath(p)))
        log.debug("fastckpt Lightning plugin: removed checkpoint %s", p)


class AsyncFastCheckpointIO(FastCheckpointIO):
    """:class:`FastCheckpointIO` whose saves run in the background
    (:func:`fastckpt.async_save`, on a saver of this plugin's own).

    ``save_checkpoint`` returns once the checkpoint is snapshotted (pickled,
    tensors copied into staging memory reused from one save to the next);
    training goes on while a writer thread commits the file. At most
    ``max_in_flight`` saves are pending (default: fastckpt's
    ``async_max_in_flight`` knob, 1): a further save first waits for the oldest.

    A background save's failure is never lost: it is raised by the next
    ``save_checkpoint`` (after that save has started, so the newer state is
    still written), or by ``teardown()`` (called by Lightning at the end of
    ``fit``/``validate``/..., and on an exception), which first waits for every
    pending save. ``remove_checkpoint`` and ``load_checkpoint`` wait for pending
    saves first, so that a removed file cannot reappear and a load reads the
    finished file.

    ``teardown()`` also stops the writer thread (as Lightning's own
    ``AsyncCheckpointIO`` shuts its executor down): no thread of the plugin
    outlives it, even when it raises a failed save's error, and a later save
    (the next ``fit``) starts a new writer. The plugin pickles and deep-copies
    (and with it a ``Trainer``) at any time: the copy has no saver and no
    pending saves of its own (those stay the original's to finish); it makes
    a writer when it first saves.
    """

    def __init__(self, verify: Optional[bool] = None, max_in_flight: Optional[int] = None, urls: str = "torch"):
        super().__init__(verify, urls)
        self.max_in_flight = max_in_flight
        self._saver: Optional[AsyncSaver] = None  # made by the first save, closed by teardown()
        self.last_future: Optional[SaveFuture] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_saver"] = None        # a thread and locks: never copied
        state["last_future"] = None   # the original's save, not the copy's
        return state

    def _writer(self) -> AsyncSaver:
        if self._saver is None:
            self._saver = AsyncSaver(self.max_in_flight)
        return self._saver

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        _no_storage_options(self, storage_options)
        if self._url(path, "save to"):  # TorchCheckpointIO's synchronous save (after this plugin's pending ones)
            self.wait()
            return TorchCheckpointIO.save_checkpoint(self, checkpoint, path, storage_options)
        p = _local_path(path)
        parent = os.path.dirname(p)
        if parent:
            os.makedirs(parent, exist_ok=True)
        _paths.check_save_target(p)  # a careless path fails here, before anything is staged
        saver = self._writer()
        earlier: Optional[BaseException] = None
        try:
            saver.raise_unobserved()  # failures of earlier saves, known before this one starts
        except BaseException as e:  # noqa: BLE001 - raised below, once this save is on its way
            earlier = e
        try:
            self.last_future = saver.save(checkpoint, p)
        except BaseException as own:
            if earlier is not None and hasattr(own, "add_note"):
                own.add_note(f"fastckpt: an earlier background save failed too: {type(earlier).__name__}: {earlier}")
            raise
        if earlier is not None:
            raise earlier

    def wait(self) -> None:
        """Wait for every pending save; raise the first failure not yet raised."""
        if self._saver is not None:
            self._saver.wait()

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        self.wait()
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        if self._saver is not None:  # a pending save of `path` must not recreate it afterwards
            self._saver.wait(raise_errors=False)
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        """Wait for every pending save, stop the writer thread, then raise a
        failure nobody has seen yet (the thread is gone in either case). The
        next save makes a new writer."""
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close()
