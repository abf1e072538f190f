"""DeepSpeed checkpoints through fastckpt.

``engine.checkpoint_engine = FastCheckpointEngine()`` (after
``deepspeed.initialize``; DeepSpeed's configuration has no key that names a
third-party checkpoint engine) makes ``engine.save_checkpoint`` /
``load_checkpoint`` write and read every file (model states, ZeRO optimizer
partitions) with :func:`fastckpt.save` / :func:`fastckpt.load`: each file
written with O_DIRECT under a temporary name, fdatasync'd and renamed into
place, with a CRC-32 per storage checked on load. ``commit`` (which DeepSpeed
calls once every file of a tag is written, before it writes ``latest``)
fsyncs the tag's directory and the save directory, so that when ``latest``
names a tag, that tag's files are durable. DeepSpeed itself writes ``latest``
with a plain ``open``/``write`` afterwards (not fsync'd, not atomic): a crash
right after a save may leave ``latest`` naming the previous tag (or, rarely,
empty); pass the tag to ``load_checkpoint`` to be exact.

The files are torch.save archives: DeepSpeed's own ``TorchCheckpointEngine``
(and ``torch.load``) read them, and this engine reads the files it wrote.

Requires ``deepspeed`` (``pip install "fastckpt-io[deepspeed]"``).
"""
import logging
import os
from typing import Any, Set

from ._common import require

require("deepspeed", "deepspeed", "deepspeed")
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine  # noqa: E402

from .. import serialization as _ser  # noqa: E402
from .._core.engine import fsync_dir  # noqa: E402

__all__ = ["FastCheckpointEngine"]

log = logging.getLogger("fastckpt")

ENGINE_NAME = "FastckptCheckpointEngine"


class FastCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` that writes through fastckpt.

    Args:
        config_params: what DeepSpeed passes its engines (unused).
        verify: passed to :func:`fastckpt.load` (``None``: check every storage's CRC-32).
    """

    def __init__(self, config_params: Any = None, verify: Any = None):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.verify = verify
        self._dirs: Set[str] = set()

    def create(self, info: CheckpointCommitInfo) -> None:
        """A tag is about to be saved: start recording the directories written."""
        self._dirs = set()
        log.debug("fastckpt DeepSpeed engine: saving tag %s in %s", info.tag, info.save_dir)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)
        self._dirs.add(os.path.abspath(path))

    def save(self, state_dict: Any, path: str) -> None:
        """:func:`fastckpt.save` ``state_dict`` to ``path`` (durable and atomic on return)."""
        p = os.fspath(path)
        _ser.save(state_dict, p)
        self._dirs.add(os.path.dirname(os.path.abspath(p)))

    def load(self, path: str, map_location: Any = None) -> Any:
        """:func:`fastckpt.load` ``path`` (not weights-only, as DeepSpeed's
        TorchCheckpointEngine: DeepSpeed's files hold its own objects)."""
        return _ser.load(os.fspath(path), map_location=map_location, weights_only=False, verify=self.verify)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of ``info.tag`` is written: fsync the directories that
        received files (their entries), the tag's directory and ``info.save_dir``."""
        tag_dir = os.path.abspath(os.path.join(os.fspath(info.save_dir), str(info.tag)))
        dirs = set(self._dirs)
        if os.path.isdir(tag_dir):
            dirs.add(tag_dir)
        for d in sorted(dirs, key=len, reverse=True):  # deepest first, then their parents
            fsync_dir(d)
        fsync_dir(os.path.abspath(os.fspath(info.save_dir)))
        self._dirs = set()
        return True
