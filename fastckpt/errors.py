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
