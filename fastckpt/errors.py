"""Exceptions raised by fastckpt.

I/O failures are plain ``OSError`` subclasses (``FileNotFoundError``,
``PermissionError``, ...) carrying ``errno`` and ``filename``; their message
names the operation, path, offset and length. A file that is not a valid
checkpoint raises :class:`FormatError`.
"""

__all__ = ["FormatError"]


class FormatError(ValueError):
    """The file is truncated, corrupt or not in the expected format."""


class UnsupportedURLError(NotImplementedError, ValueError):
    """A save target is a URL (``s3://...``) where only local paths are
    written (``async_save``, the DCP ``FastWriter``; ``fastckpt.save`` and
    ``fastckpt.load`` take URLs through :mod:`fastckpt.remote`). Both a
    ``NotImplementedError`` and a ``ValueError``; strings that merely look
    alike (``s3:/x``, a relative local path) are paths."""


__all__ += ["UnsupportedURLError"]


class MissingDependencyError(ImportError):
    """A URL's scheme needs an optional dependency that is not installed
    (``s3://`` needs s3fs: ``pip install 'fastckpt-io[s3]'``). The message names
    the pip extra (or package) to install."""


__all__ += ["MissingDependencyError"]


class RanksFailed(OSError, RuntimeError):
    """Other ranks of a group failed, died or stopped answering, so a
    collective operation (a collective save or load, the checkpoint
    manager's agreement, a step's remote replication) did not complete.

    The one error for "rank r failed": ``failures`` maps each failed rank
    to what happened there, in that rank's words (empty when the group
    broke and no rank could say which one died). It is an ``OSError``
    (``errno`` EIO unless the failing rank's own error had another;
    ``filename`` the user's path or URL when there is one) and a
    ``RuntimeError``, so callers written against either keep working."""

    def __init__(self, code: int, message: str, filename=None, failures=None):
        if filename is None:
            super().__init__(code, message)
        else:
            super().__init__(code, message, filename)
        self.failures = dict(failures or {})

    @property
    def lost(self) -> bool:
        """True when the group itself broke (a rank died or did not answer in
        time) and no rank could say which: ``failures`` is empty."""
        return not self.failures


__all__ += ["RanksFailed"]


class StateMismatchError(ValueError):
    """``fastckpt.load_into``: the state to fill and the checkpoint do not match
    (keys missing from the file or unexpected in it under ``strict=True``,
    tensors of another shape or dtype, a tensor where the other side holds a
    plain value, a placement that cannot be read). Raised before any byte of the
    state was changed. ``path`` is the checkpoint; ``missing_keys``,
    ``unexpected_keys`` and ``mismatched`` (one line per key) say what differs."""

    def __init__(self, message: str, path=None, missing_keys=(), unexpected_keys=(), mismatched=()):
        super().__init__(message)
        self.path = path
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)
        self.mismatched = list(mismatched)


__all__ += ["StateMismatchError"]
