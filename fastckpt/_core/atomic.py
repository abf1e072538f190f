"""The one atomic-file helper: every file fastckpt writes to a path is written
through it.

An :class:`AtomicFile` writes through the engine (O_DIRECT where the filesystem
takes it, io_uring or the thread pool) into a temporary file beside the target;
:meth:`AtomicFile.commit` makes it durable (fdatasync), renames it over the
target and fsyncs the directory. Until then the target is untouched, and a crash
leaves the previous file under that name or none. :meth:`AtomicFile.abort`
removes the temporary file. As a context manager it commits when the block ends
normally and aborts when it raises; an ``OSError`` of the engine (which names
the temporary file) is then raised naming the target (see
:func:`fastckpt._core.paths.raise_named_after_target`).
"""

import io
import os
from typing import Any, Dict, List, Optional, Union

from .. import _C
from .engine import get_engine
from .paths import raise_named_after_target

__all__ = ["AtomicFile", "write_file"]


class AtomicFile:
    """A file written under a temporary name and committed over ``path``.

    Args:
        path: the target.
        expected: the file's size when it is known in advance (the engine then
            preallocates it and writes its tail O_DIRECT), else -1.
        checksums: False: :meth:`write_crc` writes without computing a CRC-32
            and returns 0 (torch's ``compute_crc32`` disabled).
    """

    def __init__(self, path: Union[str, os.PathLike], expected: int = -1, checksums: bool = True):
        self.path = os.fspath(path)
        self.checksums = checksums
        self._w: Any = None
        try:
            self._w = _C.Writer(get_engine(), self.path, expected)
        except OSError as e:  # the temporary file could not be made: named after the target
            raise_named_after_target(e, self.path)
            raise

    @property
    def position(self) -> int:
        """Bytes written so far."""
        return self._w.position

    def write(self, b, borrow: bool = False) -> int:
        """Append a bytes-like object or a CPU tensor; returns its size in bytes (``borrow``: see
        :meth:`write_crc`)."""
        self._w.write(b, borrow)
        return b.nbytes if hasattr(b, "nbytes") else memoryview(b).nbytes

    def write_crc(self, t, crc: int, borrow: bool = False) -> int:
        """Append CPU tensor ``t``; returns the CRC-32 of its bytes continued from ``crc``.
        ``borrow=True``: the engine may write ``t``'s aligned body straight from its memory
        (no copy; docs/ENGINE.md), which must then not change until :meth:`commit` or
        :meth:`abort` has returned (the writer holds a reference to ``t`` until then)."""
        if not self.checksums:
            self._w.write(t, borrow)
            return 0
        return self._w.write_crc(t, crc, borrow)

    def write_zeros(self, n: int) -> None:
        self._w.write_zeros(n)

    def drain(self) -> None:
        """Wait until every write in flight has completed: memory lent so far (``borrow=True``) is
        read no more and may change from here. The file stays open for more writes."""
        self._w.drain()

    def write_parts(self, parts: List[Any]) -> None:
        """Append several buffers in one engine call."""
        if parts:
            self._w.write_many(parts)

    def flush(self) -> None:  # writers that flush (torch's legacy one); the commit makes it durable
        pass

    def raw(self) -> io.RawIOBase:
        """A raw binary stream over this file, for writers that want one (DCP's
        stream transforms); closing it leaves the file to be committed or aborted."""
        return _Raw(self)

    def commit(self) -> Dict[str, Any]:
        """fdatasync, rename over the target, fsync the directory; returns the engine's statistics."""
        return self._w.commit()

    def abort(self) -> None:
        """Remove the temporary file. The engine's writer (and its lease of the
        backend) goes now, not with a traceback that still holds this object."""
        if self._w is not None:
            self._w.abort()
            self._w = None

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is None:
            try:
                self.commit()
            except OSError as e:
                self.abort()
                raise_named_after_target(e, self.path)
                raise
            return
        self.abort()
        if isinstance(error, OSError):
            raise_named_after_target(error, self.path)


class _Raw(io.RawIOBase):
    def __init__(self, f: AtomicFile):
        super().__init__()
        self._f = f

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if n:
            self._f.write(b)
        return n

    def close(self) -> None:  # the file is committed or aborted by its AtomicFile
        pass


def write_file(path: Union[str, os.PathLike], data: bytes, name: Optional[str] = None) -> Dict[str, Any]:
    """Write ``data`` as the whole file ``path``, atomically and durably (small
    files: a DCP ``.metadata``, ``latest``, an index, a manifest). An OSError
    names ``name`` (default: ``path``)."""
    f = None
    try:
        f = AtomicFile(path, len(data))
        f.write(data)
        return f.commit()
    except BaseException as e:
        if f is not None:
            f.abort()
        if isinstance(e, OSError):
            raise_named_after_target(e, name or os.fspath(path))
        raise
