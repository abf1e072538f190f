"""Exceptions raised by fastckpt.

I/O failures are plain ``OSError`` subclasses (``FileNotFoundError``,
``PermissionError``, ...) carrying ``errno`` and ``filename``; their message
names the operation, path, offset and length. A file that is not a valid
checkpoint raises :class:`FormatError`.
"""

__all__ = ["FormatError"]


class FormatError(ValueError):
    """The file is truncated, corrupt or not in the expected format."""
