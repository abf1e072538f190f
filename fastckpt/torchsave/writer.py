"""Writing a torch.save archive: to a path through the engine (temporary
file, O_DIRECT writes, fdatasync, rename, directory fsync), or to a caller's
file object."""

import ctypes
import io
import os
import zlib
from typing import Any, List, Optional

import torch

from .. import _C
from .._core import paths as _paths
from .._core.atomic import AtomicFile
from ..formats import torch_rules as _torch_rules, zip as _zip
from ..formats.archive import plan_archive
from ..staging.tohost import DeviceStorages
from ..formats.torch_rules import FileLike


def as_bytes_tensor(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class FileSink:
    """Writes to a caller's file object (buffered; durability is the caller's)."""

    def __init__(self, f, crc: bool = True):
        self.f = f
        self.crc = crc

    def write(self, b, borrow: bool = False) -> None:  # borrow: nothing to spare here
        if isinstance(b, torch.Tensor):
            b = memoryview(b.numpy()) if b.numel() else b""
        self.f.write(b)

    def write_parts(self, parts: List[Any]) -> None:
        if parts:
            self.f.write(b"".join(parts))

    def write_crc(self, t: torch.Tensor, crc: int, borrow: bool = False) -> int:  # borrow: nothing to spare here
        mv = memoryview(t.numpy()) if t.numel() else memoryview(b"")
        self.f.write(mv)
        if not self.crc:
            return 0
        return _C.crc32(t, crc) if t.numel() else crc

    def write_zeros(self, n: int) -> None:
        seekable = getattr(self.f, "seekable", None)
        if seekable is not None and seekable():  # a hole, as torch's writer leaves
            self.f.seek(n, io.SEEK_CUR)
            return
        zeros = bytes(min(n, 1 << 20))
        while n > 0:
            k = min(n, len(zeros))
            self.f.write(zeros[:k] if k < len(zeros) else zeros)
            n -= k

    def commit(self) -> None:
        flush = getattr(self.f, "flush", None)
        if flush:
            flush()

    def abort(self) -> None:
        pass


def save_legacy(obj: Any, f: FileLike, pickle_module: Any, pickle_protocol: int) -> None:
    """torch's legacy format, written by torch's own writer; to a path through
    the engine's atomic, durable commit."""
    if not _paths.is_path(f):
        torch.save(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization=False)
        return
    with AtomicFile(f) as sink:
        torch.save(obj, sink, pickle_module, pickle_protocol, _use_new_zipfile_serialization=False)


# Storage records below this size are copied, with their local headers and
# descriptors, into a list of parts that one engine call writes (about every
# _PARTS_BYTES): no engine call per record, which dominated saves of many small
# tensors. Larger ones are copied into the staging buffers by the engine.
_PACK_BYTES = 64 << 10


_PARTS_BYTES = 4 << 20


def write_archive(f: FileLike, data_pkl: bytes, storages: List[Any], alignment: Optional[int] = None,
                   byteorder: bool = True, skip_data: bool = False, compute_crc32: Optional[bool] = None,
                   direct_min: Optional[int] = _zip.DIRECT_MIN, borrowed: bool = False,
                   crcs: Optional[List[Optional[int]]] = None) -> List[_zip.Entry]:
    """Write the archive of a pickle made by :func:`pickle_with_storages` whose storage i is
    ``storages[i]`` (the storages may be copies of the pickled object's, as
    async_save's snapshots are). A storage may also be any object with
    ``nbytes()`` and ``write_into(sink) -> crc`` that streams its bytes through
    ``sink.write_crc`` (``fastckpt convert``).

    Layout (docs/FORMAT.md 1.3): every record starts on a multiple of
    ``alignment`` (torch's configured storage_alignment, 64 by default), and
    storage records of at least ``direct_min`` bytes on a multiple of it and of
    4096; ``direct_min=None`` writes torch.save's own layout (every record on
    ``alignment``, with a ``.format_version`` record, whose presence lets torch
    predict record offsets from sizes alone: a fastckpt layout leaves it out).
    ``byteorder=False`` leaves out the byteorder record; ``skip_data`` writes no
    storage bytes (zero-filled records, CRC 0); ``compute_crc32`` defaults to
    torch's setting (False: every CRC is 0). ``borrowed=True`` (the storages are a snapshot's
    copies, which nothing changes until this returns): the engine writes the page-aligned bodies of
    large CPU storages straight from their memory, no copy (``AtomicFile.write_crc(borrow=True)``).
    ``crcs[i]``, where given and not None, is the zip CRC-32 of storage i's bytes, taken when they
    were copied (a snapshot's ``crcs``): written as the record's CRC, not computed again.
    Engine errors name ``f`` (see :func:`fastckpt._core.paths.raise_named_after_target`).
    Returns the archive's entries (name, size, CRC-32, offsets), in file order."""
    if alignment is None:
        alignment = _torch_rules.storage_alignment()
    crc_on = _torch_rules.compute_crc32() if compute_crc32 is None else compute_crc32
    plan, entries, pos, expected = plan_archive(data_pkl, storages, alignment, byteorder, direct_min)
    u32 = _zip.U32_MAX

    path = os.fspath(f) if _paths.is_path(f) else None
    stager = DeviceStorages([p[0] for p in plan], skip_data)  # copied ahead through the pool
    owns = stager.owns
    sink = None
    descriptor, desc32 = _zip.descriptor, _zip._descriptor32.pack
    crc32 = zlib.crc32
    string_at = ctypes.string_at
    try:
        sink = AtomicFile(path, expected, checksums=crc_on) if path is not None else FileSink(f, crc_on)
        parts: List[Any] = []  # headers, small records' bytes and descriptors, written in one call
        parts_bytes = 0
        k = -1  # the storage's index in `storages` (plan holds them in order, among the other records)
        for payload, header, entry in plan:
            size = entry.size
            record = isinstance(payload, (bytes, bytearray))  # else a storage
            k += not record
            if record:
                crc = crc32(payload) if crc_on else 0
                parts += (header, payload)
                parts_bytes += size
            elif (size < _PACK_BYTES and not skip_data and type(payload) is torch.UntypedStorage
                  and payload.device.type == "cpu" and not owns(payload)):
                # A small CPU storage: its bytes copied here (no engine call for it).
                data = string_at(payload.data_ptr(), size) if size else b""
                crc = crc32(data) if crc_on and size else 0
                parts += (header, data)
                parts_bytes += size
            else:
                parts.append(header)
                sink.write_parts(parts)
                parts, parts_bytes = [], 0
                known = crcs[k] if crcs is not None and crc_on else None
                crc = write_storage(sink, stager, payload, size, skip_data, borrowed, known)
            entry.crc = crc
            if 0 < size < u32 and entry.header_offset < u32:
                parts.append(desc32(_zip.DESCRIPTOR_SIG, crc, size, size))
            else:
                parts.append(descriptor(crc, size, entry.header_offset))
            if parts_bytes >= _PARTS_BYTES or len(parts) >= 3 * 8192:
                sink.write_parts(parts)
                parts, parts_bytes = [], 0
        parts.append(_zip.central_directory(entries, pos))
        sink.write_parts(parts)
        sink.commit()
        return entries
    except BaseException as e:
        if sink is not None:
            sink.abort()
        if path is not None and isinstance(e, OSError):
            _paths.raise_named_after_target(e, path)
        raise
    finally:
        stager.release()


def write_storage(sink, stager: DeviceStorages, payload, size: int, skip_data: bool, borrowed: bool = False,
                  known: Optional[int] = None) -> int:
    """Write the bytes of one storage record through `sink`; returns its CRC (`borrowed`, `known`
    (its CRC, taken with the copy): see :func:`write_archive`)."""
    if skip_data:
        sink.write_zeros(size)  # torch writes the record's metadata only
        return 0
    if isinstance(payload, torch.UntypedStorage):
        if size == 0:
            return 0
        if stager.owns(payload):  # a device storage: its bytes through the staging pool
            return stager.write(sink, payload, 0)
        t = as_bytes_tensor(payload)
        if t.device.type == "cpu":
            if known is not None:
                sink.write(t, borrow=True) if borrowed else sink.write(t)
                return known
            return sink.write_crc(t, 0, borrow=True) if borrowed else sink.write_crc(t, 0)
        return sink.write_crc(t.cpu(), 0)  # other accelerators: a plain host copy of this storage
    return payload.write_into(sink) if size else 0  # streamed storage

