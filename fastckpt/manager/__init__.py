"""CheckpointManager: steps, retention, ``latest``, several ranks, async saves
and the remote tier."""

from .manager import CheckpointManager, Restored, TMP_MARK

__all__ = ["CheckpointManager", "Restored", "TMP_MARK"]
