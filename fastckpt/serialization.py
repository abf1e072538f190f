"""fastckpt.save / fastckpt.load: torch.save and torch.load at disk speed.

The file is a standard torch.save zip archive (stock ``torch.load`` reads it,
with ``mmap=True`` too) whose storage records of 64 KiB or more start on 4 KiB
boundaries and whose other records are packed as torch.save packs them; see
docs/FORMAT.md 1.3. Saving to a path streams every storage through the C++
engine (O_DIRECT, io_uring, staging buffers reused across saves) into a
temporary file that is made durable and renamed over the target: a crash
leaves the previous file or the complete new one. Loading from a path reads
all storages in parallel through the engine, then unpickles with PyTorch's
own loader (and its ``weights_only`` unpickler).
"""

import collections
import contextlib
import ctypes
import io
import logging
import os
import pickle
import re
import sys
import threading
import types
import uuid
import warnings
import zlib
from typing import Any, Callable, Dict, IO, Iterator, List, Optional, Tuple, Union

import torch
import torch.serialization as ts

from . import _C
from ._core import paths as _paths
from .staging import device as _staging
from .formats import torch_rules as _torch_rules, unpickler as _unpickle, zip as _zip
from ._core.engine import get_engine
from .errors import FormatError

__all__ = ["save", "load"]

log = logging.getLogger("fastckpt")

FileLike = Union[str, os.PathLike, IO[bytes]]
MapLocation = Union[None, str, torch.device, Dict[str, str], Callable]

DEFAULT_PROTOCOL = 2  # torch.save's
ARCHIVE_NAME = "archive"
FORMAT_VERSION = b"3\n"  # the archive's "version" record, as torch 2.x writes it
# torch's legacy (non-zip) format starts with this pickled magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def _is_path(f) -> bool:
    return isinstance(f, (str, os.PathLike))


# ---------------------------------------------------------------- saving

# Types that are never storages (exact types: a subclass goes through persistent_id).
# Classes and functions (the rebuild functions, storage classes) are never storages either.
_PLAIN_TYPES = frozenset([str, int, float, bool, type(None), tuple, list, dict, bytes, torch.Size, torch.dtype,
                          torch.device, torch.Tensor, torch.nn.Parameter, collections.OrderedDict,
                          type, type(torch.FloatStorage), types.FunctionType, types.BuiltinFunctionType])


def _pickle(obj, pickle_module, pickle_protocol, skip_data: bool = False) -> Tuple[bytes, List[torch.UntypedStorage]]:
    """Pickle `obj` the way torch.save does: storages become persistent ids
    ("storage", storage type, key, location, numel) and are returned in key order.
    With ``skip_data`` (torch.serialization.skip_data) storages without data
    (meta, fake tensors) are allowed: their bytes will not be written."""
    storages: List[torch.UntypedStorage] = []
    keys: Dict[int, str] = {}
    storage_dtypes: Dict[int, torch.dtype] = {}

    def persistent_id(o):
        if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
            if isinstance(o, torch.storage.TypedStorage):
                storage = o._untyped_storage
                storage_dtype = o.dtype
                storage_type = getattr(torch, o._pickle_storage_type())
                numel = o._size()
            else:
                storage = o
                storage_dtype = torch.uint8
                storage_type = ts.normalize_storage_type(type(o))
                numel = storage.nbytes()
            if str(storage.device) != "meta" and storage.data_ptr() != 0:
                seen = storage_dtypes.setdefault(storage.data_ptr(), storage_dtype)
                if seen != storage_dtype:
                    raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
            key = keys.get(storage._cdata)
            if key is None:
                key = keys[storage._cdata] = str(len(storages))
                storages.append(storage)
            location = str(o._fake_device) if getattr(o, "_fake_device", None) is not None else ts.location_tag(storage)
            return ("storage", storage_type, key, location, numel)
        return None

    plain = _PLAIN_TYPES

    class Pickler(pickle_module.Pickler):  # type: ignore[name-defined]
        def persistent_id(self, o):
            # called for every object pickled (17 times a tensor): the common
            # types, which are never storages, answered without a call
            return None if type(o) in plain else persistent_id(o)

    buf = io.BytesIO()
    Pickler(buf, protocol=pickle_protocol).dump(obj)
    for s in storages:
        if s.device.type == "meta" and not skip_data:
            raise ValueError("fastckpt.save: cannot save meta tensors (they have no data)")
    return buf.getvalue(), storages


def _as_bytes_tensor(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _EngineSink:
    """Writes through the engine into a temporary file, committed atomically.
    With ``crc=False`` (torch's compute_crc32 disabled) write_crc computes
    nothing and returns 0."""

    def __init__(self, path: str, expected: int, crc: bool = True):
        self.w = _C.Writer(get_engine(), path, expected)
        self.crc = crc

    def write(self, b) -> int:
        self.w.write(b)
        return memoryview(b).nbytes if not isinstance(b, torch.Tensor) else b.nbytes

    def write_crc(self, t: torch.Tensor, crc: int) -> int:
        if not self.crc:
            self.w.write(t)
            return 0
        return self.w.write_crc(t, crc)

    def write_zeros(self, n: int) -> None:
        self.w.write_zeros(n)

    def write_parts(self, parts: List[Any]) -> None:
        """Append several buffers in one engine call."""
        if parts:
            self.w.write_many(parts)

    def flush(self) -> None:  # torch's legacy writer flushes; the commit makes it durable
        pass

    def commit(self) -> None:
        self.w.commit()

    def abort(self) -> None:
        if self.w is not None:
            self.w.abort()
            self.w = None  # the engine Writer goes now (with its backend lease), not with the traceback


class _FileSink:
    """Writes to a caller's file object (buffered; durability is the caller's)."""

    def __init__(self, f, crc: bool = True):
        self.f = f
        self.crc = crc

    def write(self, b) -> None:
        self.f.write(b)

    def write_parts(self, parts: List[Any]) -> None:
        if parts:
            self.f.write(b"".join(parts))

    def write_crc(self, t: torch.Tensor, crc: int) -> int:
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


def save(obj: Any, f: FileLike, pickle_module: Any = pickle, pickle_protocol: int = DEFAULT_PROTOCOL,
         _use_new_zipfile_serialization: bool = True, _disable_byteorder_record: bool = False, *,
         group: Any = None, placement: str = "shared", storage_options: Optional[Dict[str, Any]] = None) -> None:
    """Save an object like :func:`torch.save`, durably and atomically.

    Args:
        obj: what torch.save accepts: (nested) containers of tensors and plain
            Python values, state dicts of models, optimizers, schedulers, scalers.
        f: a path (written through the engine: temporary file in the same
            directory, O_DIRECT writes, fdatasync, rename, directory fsync), a
            writable binary file object (written sequentially, not fsync'd), or
            an fsspec URL (``s3://bucket/dir/ckpt.pt``, ``gs://...``,
            ``file:///mnt/shared/ckpt.pt``): saved locally under ``TMPDIR``, then
            uploaded in parallel parts that become visible only when complete
            (:mod:`fastckpt.remote`; ``pip install 'fastckpt-io[s3]'``).
        pickle_module, pickle_protocol: as for torch.save.
        storage_options: with a URL ``f``: the fsspec filesystem's options
            (credentials, ``client_kwargs={"endpoint_url": ...}``), as DCP's
            fsspec writer takes them.
        _use_new_zipfile_serialization: as for torch.save. ``False`` writes
            torch's legacy (pre-1.6) format with torch's own writer, to a path
            still through the engine's temporary file, fdatasync and rename.
        _disable_byteorder_record: as for torch.save: no ``byteorder`` record.
        group: a ``torch.distributed`` process group whose every rank calls
            save with the same object and the same path on a filesystem they
            share (collective save, see :mod:`fastckpt.collective.save`): each rank
            writes a balanced share of the storages' bytes into one temporary
            file, rank 0 the rest and the commit; every rank returns after the
            commit or raises (ValueError when the ranks' objects differ,
            OSError naming ``f`` when any rank fails). The file is the one a
            single-process save writes. ``None``: this process writes alone.
        placement: with ``group``: ``"shared"`` (the default: one file on a
            filesystem every rank shares, as above) or ``"node"`` (node-local
            disks: every node writes one complete copy to its own ``f``, its
            ranks splitting that copy as "shared" splits the file; a rank's
            node is ``$FASTCKPT_NODE``, else its host name; the ranks of one
            node must pass the same ``f``). Every copy is the single-process
            save's file; a failure before the nodes rename leaves every node's
            previous file; a rename that fails on some node raises a "partial
            commit" OSError on every rank whose ``committed_nodes`` lists the
            nodes holding the new file (see :mod:`fastckpt.collective.save`).
            ``"node"`` without ``group`` is a ValueError.

    torch's settings are honoured as torch.save honours them:
    ``torch.serialization.skip_data()`` (storages' bytes are not written:
    their records are zero-filled or, in a seekable file object, left as holes,
    with CRC 0; ``materialize_fake_tensors`` lets fake tensors be saved), and
    ``torch.utils.serialization.config.save``: ``compute_crc32=False`` records
    CRC 0 (``fastckpt.load`` then loads the file unverified, with a warning;
    ``verify=True`` refuses it), ``storage_alignment`` aligns every record to
    it (storages of 64 KiB or more to a multiple of it and of 4096).
    ``use_pinned_memory_for_d2h`` does not change the file (fastckpt
    always copies CUDA storages through pinned buffers).

    Raises:
        FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
        OSError: the path cannot be written: checked before anything is written
            where it can be (missing or read-only parent directory, a target
            that is a directory); the message and ``filename`` name ``f``, even
            for errors of the engine's temporary file (ENOSPC, EIO), whose name
            is in ``filename2``. The previous file under that name is
            untouched and no temporary file is left.
        fastckpt.errors.MissingDependencyError: ``f`` is a URL whose scheme
            needs a package that is not installed (the message names the pip
            extra, ``fastckpt-io[s3]``). The store (bucket, credentials) is
            checked before anything is pickled: PermissionError,
            FileNotFoundError, OSError naming the URL.
        pickle.PicklingError, TypeError, RuntimeError: ``obj`` cannot be saved;
            raised before anything is written.

    Example:
        >>> fastckpt.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, "ckpt.pt")
    """
    ts._check_dill_version(pickle_module)
    if _paths.is_url(f) or storage_options is not None:
        if group is not None or not _paths.is_url(f):
            raise ValueError("fastckpt.save: storage_options= goes with a URL (s3://...), and a URL without group=")
        from .remote import urlio
        urlio.save(f, storage_options, lambda p: save(obj, p, pickle_module, pickle_protocol,
                                                      _use_new_zipfile_serialization, _disable_byteorder_record))
        return
    ts._check_save_filelike(f)
    if placement != "shared" and group is None:
        from .collective.save import PLACEMENTS
        raise ValueError(f"fastckpt.save: placement={placement!r} needs group= (a process group)" if placement in
                         PLACEMENTS else f"fastckpt.save: placement={placement!r} is not one of {PLACEMENTS}")
    if group is not None:
        if not _use_new_zipfile_serialization:
            raise ValueError("fastckpt.save: group= writes the zip format only (_use_new_zipfile_serialization=True)")
        from .collective import save as _collective
        _collective.save(obj, f, group, pickle_module, pickle_protocol, byteorder=not _disable_byteorder_record,
                         placement=placement)
        return
    if _is_path(f):
        f = _paths.check_save_target(f)
    if not _use_new_zipfile_serialization:
        _save_legacy(obj, f, pickle_module, pickle_protocol)
        return
    skip_data = bool(ts._serialization_tls.skip_data)
    data_pkl, storages = _pickle(obj, pickle_module, pickle_protocol, skip_data=skip_data)
    _write_archive(f, data_pkl, storages, byteorder=not _disable_byteorder_record, skip_data=skip_data)


def _save_legacy(obj: Any, f: FileLike, pickle_module: Any, pickle_protocol: int) -> None:
    """torch's legacy format, written by torch's own writer; to a path through
    the engine's atomic, durable commit."""
    if not _is_path(f):
        torch.save(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization=False)
        return
    path = os.fspath(f)
    sink = None
    try:
        sink = _EngineSink(path, -1)
        torch.save(obj, sink, pickle_module, pickle_protocol, _use_new_zipfile_serialization=False)
        sink.commit()
    except BaseException as e:
        if sink is not None:
            sink.abort()
        if isinstance(e, OSError):
            _paths.raise_named_after_target(e, path)
        raise


# Storage records below this size are copied, with their local headers and
# descriptors, into a list of parts that one engine call writes (about every
# _PARTS_BYTES): no engine call per record, which dominated saves of many small
# tensors. Larger ones are copied into the staging buffers by the engine.
_PACK_BYTES = 64 << 10
_PARTS_BYTES = 4 << 20


def _new_serialization_id() -> bytes:
    """The archive's .data/serialization_id record: 40 random decimal digits, as torch writes."""
    return f"{uuid.uuid4().int:040d}"[:40].encode()


def _plan_archive(data_pkl: bytes, storages: List[Any], alignment: int, byteorder: bool = True,
                  direct_min: Optional[int] = _zip.DIRECT_MIN, serialization_id: Optional[bytes] = None):
    """The layout of the archive :func:`_write_archive` writes (docs/FORMAT.md 1.3):
    every offset is known before the first byte is written. Returns (plan,
    entries, cd_offset, file_size): plan[i] = (payload bytes or storage, local
    header bytes, its _zip.Entry) in file order, the storages' records being
    "data/<i>"; the central directory starts at cd_offset. Each record is
    followed by its data descriptor (none for empty ones)."""
    if serialization_id is None:
        serialization_id = _new_serialization_id()
    head = [("data.pkl", data_pkl)]
    if direct_min is None:
        head.append((".format_version", b"1"))
    head.append((".storage_alignment", str(alignment).encode()))
    if byteorder:
        head.append(("byteorder", sys.byteorder.encode()))
    tail = [("version", FORMAT_VERSION), (".data/serialization_id", serialization_id)]

    # (One plain loop: it runs once per record, 100,000 times for 100,000 scalars.)
    records = [(name, payload, len(payload), alignment) for name, payload in head]
    align_of = _zip.record_alignment
    records += [(f"data/{i}", s, n, align_of(n, alignment, direct_min))
                for i, s, n in ((i, s, s.nbytes()) for i, s in enumerate(storages))]
    records += [(name, payload, len(payload), alignment) for name, payload in tail]
    plan = []  # (payload bytes or storage, header, entry)
    entries = []
    pos = 0
    u32 = _zip.U32_MAX
    local_header, Entry = _zip.local_header, _zip.Entry
    for name, payload, size, align in records:
        full = f"{ARCHIVE_NAME}/{name}"
        header = local_header(full.encode(), size, pos, align)
        entry = Entry(full, size, 0, pos, pos + len(header))
        pos += len(header) + size + (0 if size == 0 else 24 if size >= u32 or entry.header_offset >= u32 else 16)
        plan.append((payload, header, entry))
        entries.append(entry)
    return plan, entries, pos, pos + _zip.central_directory_size(entries, pos)


def _write_archive(f: FileLike, data_pkl: bytes, storages: List[Any], alignment: Optional[int] = None,
                   byteorder: bool = True, skip_data: bool = False, compute_crc32: Optional[bool] = None,
                   direct_min: Optional[int] = _zip.DIRECT_MIN) -> None:
    """Write the archive of a pickle made by :func:`_pickle` whose storage i is
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
    torch's setting (False: every CRC is 0).
    Engine errors name ``f`` (see :func:`fastckpt._core.paths.raise_named_after_target`)."""
    if alignment is None:
        alignment = _torch_rules.storage_alignment()
    crc_on = _torch_rules.compute_crc32() if compute_crc32 is None else compute_crc32
    plan, entries, pos, expected = _plan_archive(data_pkl, storages, alignment, byteorder, direct_min)
    u32 = _zip.U32_MAX

    path = os.fspath(f) if _is_path(f) else None
    stager = _staging.DeviceStorages([p[0] for p in plan], skip_data)  # copied ahead through the pool
    owns = stager.owns
    sink = None
    descriptor, desc32 = _zip.descriptor, _zip._descriptor32.pack
    crc32 = zlib.crc32
    string_at = ctypes.string_at
    try:
        sink = _EngineSink(path, expected, crc_on) if path is not None else _FileSink(f, crc_on)
        parts: List[Any] = []  # headers, small records' bytes and descriptors, written in one call
        parts_bytes = 0
        for payload, header, entry in plan:
            size = entry.size
            if isinstance(payload, (bytes, bytearray)):
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
                crc = _write_storage(sink, stager, payload, size, skip_data)
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
    except BaseException as e:
        if sink is not None:
            sink.abort()
        if path is not None and isinstance(e, OSError):
            _paths.raise_named_after_target(e, path)
        raise
    finally:
        stager.release()


def _write_storage(sink, stager: "_staging.DeviceStorages", payload, size: int, skip_data: bool) -> int:
    """Write the bytes of one storage record through `sink`; returns its CRC."""
    if skip_data:
        sink.write_zeros(size)  # torch writes the record's metadata only
        return 0
    if isinstance(payload, torch.UntypedStorage):
        if size == 0:
            return 0
        if stager.owns(payload):  # a device storage: its bytes through the staging pool
            return stager.write(sink, payload, 0)
        t = _as_bytes_tensor(payload)
        if t.device.type == "cpu":
            return sink.write_crc(t, 0)
        return sink.write_crc(t.cpu(), 0)  # other accelerators: a plain host copy of this storage
    return payload.write_into(sink) if size else 0  # streamed storage


# ---------------------------------------------------------------- loading

# Records that torch.serialization._load reads besides data.pkl's storages; any
# other record is read only if asked for.
_SMALL_RECORDS = ("data.pkl", ".format_version", ".storage_alignment", "byteorder", "version",
                  ".data/serialization_id")


def _host_storage(nbytes: int) -> torch.Tensor:
    """Memory for a storage of `nbytes` read from a file: 4 KiB-aligned from
    _zip.DIRECT_MIN bytes on (an O_DIRECT read can go straight into it), torch's
    allocator below. Not resizable, as torch.load's storages are not: a pickle
    whose tensor reaches past its record is then torch's error (a FormatError
    here), never a reallocation of memory that a read still in flight
    (:meth:`_Records.read_behind`) fills, nor a tensor holding bytes no record had."""
    if nbytes >= _zip.DIRECT_MIN:
        t = _C.empty_aligned(nbytes, _zip.ALIGNMENT)
    else:
        t = torch.empty(nbytes, dtype=torch.uint8)
    _C.set_resizable(t, False)
    return t


class _Records(dict):
    """The storages of one archive read so far (record name -> uint8 tensor),
    and the reading of records, for fastckpt.load and for the command's
    ZipSource (inspect, verify, convert) alike: every read goes to the file the
    archive was parsed from (:meth:`read_into`, the one place that turns
    records into engine reads), and all that :meth:`read` allocates together
    stays within the file's size (a check that stays on; docs/FORMAT.md 1.5).

    ``verify``: as :func:`load`'s (None: the default, True, False). Unless
    False, the engine computes each storage's CRC-32 while it reads it
    (``crcs``); :meth:`bad` says which storages fail their check."""

    def __init__(self, path: str, archive: "_zip.Archive", fd: int, verify: Optional[bool]):
        super().__init__()
        self.path, self.archive, self.fd, self.verify = path, archive, fd, verify
        self.allocated = 0  # bytes of records read so far, small ones included
        self.small_read: set = set()
        self.crcs: Dict[str, int] = {}  # storage record -> CRC-32 of the bytes read (unless verify=False)
        self._pending: Optional[Tuple[threading.Thread, Dict[str, Any], List[str]]] = None  # read_behind's

    def bad(self, names) -> List[str]:
        """Those of storages `names` whose bytes do not match their recorded
        CRC-32. A record with CRC 0 (written without checksums) counts as bad
        only with an explicit ``verify=True``; with ``verify=False``, none."""
        if self.verify is False:
            return []
        recs = self.archive.records
        return [n for n in names if self.crcs.get(n, 0) != recs[n].crc and (self.verify or recs[n].crc != 0)]

    def claim(self, names: List[str]) -> None:
        """Account for reading records `names`, before any memory is allocated."""
        n = sum(self.archive.records[name].size for name in names)
        if self.allocated + n > self.archive.file_size:
            raise FormatError(f"{self.path}: reading records {names[:3]}... would allocate "
                              f"{self.allocated + n} bytes for a {self.archive.file_size}-byte file")
        self.allocated += n

    def read_into(self, items: List[Tuple[str, int, Any, bool]], fd: Optional[int] = None) -> List[Optional[int]]:
        """Fill each (record, offset in the record, destination, crc) with
        that record's bytes, in one parallel batch of engine reads (from `fd`,
        by default :attr:`fd`: the file parsed); returns per item the CRC-32 of
        the bytes read when `crc` (computed by the engine during the reads),
        else None. A destination must lie inside its record."""
        recs = self.archive.records
        ranges = []
        for name, off, dest, crc in items:
            n = dest.numel() if isinstance(dest, torch.Tensor) else len(dest)
            if off < 0 or off + n > recs[name].size:
                raise ValueError(f"{self.path}: read of bytes {off}..{off + n} of record {name!r} "
                                 f"({recs[name].size} bytes)")
            ranges.append((dest, recs[name].data_offset + off, crc))
        out: List[Optional[int]] = [0 if crc else None for *_, crc in items]
        keep = [i for i, (dest, *_) in enumerate(ranges)
                if (dest.numel() if isinstance(dest, torch.Tensor) else len(dest))]
        if keep:
            st = _C.read_ranges(get_engine(), self.path, [ranges[i] for i in keep], self.fd if fd is None else fd)
            for i, c in zip(keep, st.get("crcs") or []):
                out[i] = c
        return out

    def read_behind(self, storages: List[str]) -> None:
        """Allocate storages `storages` (they are in this dict at once) and fill
        them on a background thread, from a duplicate of :attr:`fd`, while the
        caller unpickles; :meth:`wait` must follow (it joins the thread, also
        after an error). Only for pickles whose unpickling reads no storage
        bytes (:func:`_unpickling_reads_no_data`)."""
        storages = [n for n in dict.fromkeys(storages) if n not in self]
        self.claim(storages)
        recs = self.archive.records
        tensors = {n: _host_storage(recs[n].size) for n in storages}
        items = [(n, 0, t, self.verify is not False) for n, t in tensors.items()]
        self.update(tensors)
        # The thread reads through a duplicate of the descriptor: the caller
        # closes its own when the archive has been read.
        fd = os.dup(self.fd)
        box: Dict[str, Any] = {}

        def run() -> None:
            try:
                box["crcs"] = self.read_into(items, fd)
            except BaseException as e:  # noqa: BLE001 (re-raised by wait())
                box["error"] = e
            finally:
                os.close(fd)

        t = threading.Thread(target=run, name="fastckpt-load", daemon=True)
        self._pending = (t, box, [n for n, *_ in items])
        try:
            t.start()
        except BaseException:
            self._pending = None
            os.close(fd)
            raise

    @property
    def pending(self) -> bool:
        """A :meth:`read_behind` not yet waited for."""
        return self._pending is not None

    def join(self) -> None:
        """Wait until :meth:`read_behind`'s thread is done (its error, if any,
        is kept for :meth:`wait`)."""
        if self._pending is not None:
            self._pending[0].join()

    def wait(self, quiet: bool = False) -> None:
        """Join :meth:`read_behind`'s thread: raise what the read raised (not
        with `quiet`: another error is on its way), else record the CRC-32s the
        engine computed."""
        if self._pending is None:
            return
        t, box, names = self._pending
        t.join()
        self._pending = None
        if "error" in box:
            if quiet:
                return
            raise box["error"]
        if self.verify is not False:
            self.crcs.update((n, c or 0) for n, c in zip(names, box["crcs"]))

    def read(self, small: List[str], storages: List[str], bad_small: Optional[List[str]] = None) -> Dict[str, bytes]:
        """Read records `small` (returned as bytes, CRC-checked) and `storages`
        (kept as uint8 tensors) that were not read yet, in one parallel batch
        through the engine. A small record that fails its check raises
        FormatError, or is appended to `bad_small` when that is given."""
        small = [n for n in dict.fromkeys(small) if n not in self.small_read]
        storages = [n for n in dict.fromkeys(storages) if n not in self]
        self.claim(small + storages)
        self.small_read.update(small)
        recs = self.archive.records
        bufs = {n: bytearray(recs[n].size) for n in small}
        # Storages big enough to be aligned in the file get page-aligned memory:
        # the engine reads them O_DIRECT straight in (no copy out of staging),
        # while its helper thread faults the memory in ahead of the reads
        # (knob `prefault`). Small ones take torch's allocator, as torch.load.
        tensors = {n: _host_storage(recs[n].size) for n in storages}
        # The engine computes the CRC-32s while it reads (each piece as it
        # lands, in parallel with the other reads): metadata records always
        # (they are small), storages unless verify=False.
        items = [(n, 0, b, True) for n, b in bufs.items()]
        items += [(n, 0, t, self.verify is not False) for n, t in tensors.items()]
        got = {n: crc for (n, *_), crc in zip(items, self.read_into(items)) if crc is not None}
        for n in bufs:  # metadata records are always checked
            e = recs[n]
            if e.crc and got.get(n, 0) != e.crc:
                if bad_small is not None:
                    bad_small.append(n)
                    continue
                raise FormatError(f"{self.path}: checksum mismatch in record {n!r} "
                                  f"(offset {e.data_offset}, {e.size} bytes)")
        if self.verify is not False:
            self.crcs.update((n, got.get(n, 0)) for n in tensors)
        self.update(tensors)
        return {n: bytes(b) for n, b in bufs.items()}

    @contextlib.contextmanager
    def reopened(self) -> Iterator[int]:
        """The file opened again after the descriptor it was parsed from was
        closed, checked to be that same file (device, inode, size, mtime):
        reads in the block go to it (``fd``)."""
        st = self.archive.stat
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise FormatError(f"{self.path}: the file went away while it was being loaded ({e})") from None
        try:
            now = os.fstat(fd)
            if st is None or (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) != \
                    (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns):
                raise FormatError(f"{self.path}: the file was replaced or changed while it was being loaded")
            self.fd = fd
            yield fd
        finally:
            self.fd = -1
            os.close(fd)

    def read_late(self, name: str, storage: bool):
        """A record that was not read up front (data.pkl names a storage in a way
        _referenced_storages does not see, or torch asks for another record):
        read from the same file, opened again and checked to be the same one."""
        with self.reopened():
            small = self.read([] if storage else [name], [name] if storage else [])
        if not storage:
            return small.get(name, b"")
        if self.bad([name]):
            raise FormatError(f"{self.path}: checksum mismatch (corrupt data) in record {name!r}")
        return self[name]


class _Reader:
    """What torch.serialization._load asks of a zip reader, over records that
    were already read in parallel (`storages`: a _Records also reads the others
    on demand)."""

    def __init__(self, archive: _zip.Archive, small: Dict[str, bytes], storages: Dict[str, torch.Tensor]):
        self.archive = archive
        self.small = small
        self.storages = storages

    def has_record(self, name: str) -> bool:
        return name in self.archive.records

    def get_record(self, name: str) -> bytes:
        if name not in self.small:
            if name not in self.archive.records or not isinstance(self.storages, _Records):
                raise FormatError(f"{self.archive.path}: record {name!r} is missing")
            self.small[name] = self.storages.read_late(name, storage=False)
        return self.small[name]

    def get_all_records(self) -> List[str]:
        return list(self.archive.records)

    def get_record_offset(self, name: str) -> int:
        return self.archive.records[name].data_offset

    def get_record_header_offset(self, name: str) -> int:
        return self.archive.records[name].header_offset

    def get_record_offset_no_read(self, cursor: int, name: str, numel: int, alignment: int) -> int:
        # torch predicts this from the layout; the central directory knows it.
        return self.archive.records[name].data_offset

    def get_storage_from_record(self, name: str, numel: int, dtype) -> torch.Tensor:
        t = self.storages.get(name)
        rec = self.archive.records.get(name)
        if t is None and rec is not None and isinstance(self.storages, _Records):
            if rec.size != numel:  # checked before allocating
                raise FormatError(f"{self.archive.path}: record {name!r} holds {rec.size} bytes, "
                                  f"the pickle expects {numel}")
            t = self.storages.read_late(name, storage=True)
        if t is None:
            raise FormatError(f"{self.archive.path}: the pickle refers to record {name!r}, which is missing")
        if t.numel() != numel:
            raise FormatError(f"{self.archive.path}: record {name!r} holds {t.numel()} bytes, "
                              f"the pickle expects {numel}")
        return t

    def serialization_id(self) -> str:
        return self.small.get(".data/serialization_id", b"").decode("ascii", "replace")


def _parse_checkpoint(path: str, fh) -> "_zip.Archive":
    """The zip directory of the checkpoint open as `fh`, checked to be a
    torch.save archive fastckpt can read (uncompressed, with data.pkl, not
    TorchScript; records in order and disjoint, so that reading them all
    allocates at most the file's size). Reads go to that one file even if
    `path` is replaced."""
    fd = fh.fileno()
    archive = _zip.Archive.parse(fh, path, lambda ranges: _C.read_ranges(get_engine(), path, ranges, fd))
    recs = archive.records
    if "constants.pkl" in recs:
        raise FormatError(f"{path}: this is a TorchScript archive; load it with torch.jit.load")
    for n, e in recs.items():
        if e.method != 0:
            raise FormatError(f"{path}: record {n!r} is compressed (method {e.method}); "
                              "checkpoints store records uncompressed")
    if "data.pkl" not in recs:
        raise FormatError(f"{path}: no data.pkl record (not a torch.save checkpoint)")
    return archive


# A string in a pickle: BINUNICODE (X, 4-byte length) or SHORT_BINUNICODE
# (0x8c, 1-byte length). Zero-width matches: every position is tried.
_PICKLED_STR = re.compile(rb"(?=(X[\x00-\xff]{4}|\x8c[\x00-\xff]))")


def _pickled_strings(pkl: bytes, lengths: List[int]) -> set:
    """The strings of the byte lengths `lengths` written as BINUNICODE or
    SHORT_BINUNICODE in `pkl` (and any bytes that look like one)."""
    found: set = set()
    if len(lengths) <= 8:  # a few scans in C, no Python work per match (1 ms a MB)
        for n in lengths:
            for head in [b"X" + n.to_bytes(4, "little")] + ([b"\x8c" + bytes([n])] if n < 256 else []):
                found.update(re.findall(re.escape(head) + b"([\\x00-\\xff]{%d})" % n, pkl))
        return found
    longest = max(lengths)
    for m in _PICKLED_STR.finditer(pkl):
        p = m.start()
        if pkl[p] == 0x58:  # X
            n, p = int.from_bytes(pkl[p + 1:p + 5], "little"), p + 5
        else:
            n, p = pkl[p + 1], p + 2
        if n <= longest:
            found.add(pkl[p:p + n])
    return found


def _referenced_storages(pkl: bytes, names) -> List[str]:
    """The storage records among `names` ("data/<key>") whose key occurs as a
    string in the pickle `pkl`: every storage data.pkl refers to, as torch.save
    writes a storage's key as a string at its first use (later uses may be memo
    references; protocol 0 cannot be loaded by torch), and at most a few
    others. A record the unpickler asks for that is not in this list (a key
    that a scan missed or that the pickle computes) is read on demand."""
    keys = {n[5:].encode("utf-8"): n for n in names if n.startswith("data/")}
    if not keys:
        return []
    found = _pickled_strings(pkl, sorted({len(k) for k in keys}))
    return [n for k, n in keys.items() if k in found]


def _check_layout(f: FileLike, weights_only: bool = False) -> None:
    """For the loads left to torch.load (file objects, mmap=True): refuse a zip
    archive whose records are out of order or overlap, or whose sizes run past
    the file (docs/FORMAT.md 1.5), before torch allocates its records, and, with
    ``weights_only``, a data.pkl that _unpickle's walk refuses (nesting that
    would overflow the C stack in torch's unpickler, memory far beyond its
    size). Torch's legacy format and streams that cannot seek are left to
    torch.load."""
    def check(fh, name: str, **parse_args) -> None:
        if fh.read(4) != b"PK\x03\x04":
            return
        archive = _zip.Archive.parse(fh, name, **parse_args)
        pkl = archive.records.get("data.pkl")
        if weights_only and pkl is not None and pkl.method == 0:
            fh.seek(pkl.data_offset)
            data = fh.read(pkl.size)
            try:
                _unpickle.check(data, f"{name}: data.pkl")
            except _unpickle.Refused as e:
                raise pickle.UnpicklingError(_weights_only_message(name, str(e))) from None

    if _is_path(f):
        with open(f, "rb") as fh:  # FileNotFoundError etc. as torch.load would raise them
            check(fh, os.fspath(f))
        return
    seekable = getattr(f, "seekable", None)
    if not (callable(seekable) and seekable()) or not hasattr(f, "read"):
        return
    pos = f.tell()
    try:
        f.seek(0)
        check(f, str(getattr(f, "name", None) or f"<{type(f).__name__} object>"), use_fd=False)
    finally:
        f.seek(pos)


def _no_checksums(path: str, verify: Optional[bool]) -> None:
    """A file whose storages record no checksums (torch's compute_crc32
    disabled, or skip_data): ``verify=True`` refuses it, the default
    (``None``) loads it unverified with a warning naming it."""
    if verify:
        raise FormatError(f"{path}: verify=True, but the file records no checksums "
                          "(saved with torch's compute_crc32 disabled)")
    warnings.warn(f"fastckpt.load: {path} records no checksums (saved with torch's compute_crc32 "
                  "disabled, or under skip_data): its data cannot be verified; loading it unverified (verify=False "
                  "silences this, verify=True refuses such files)", stacklevel=4)


def _read_archive(path: str, fh, verify: Optional[bool], behind: Optional[Callable[[bytes], bool]] = None):
    """Parse and read the archive open as `fh`: every read goes to that one
    file, even if `path` is atomically replaced meanwhile. Reads data.pkl and
    the few small records torch reads, then, in one parallel batch, the storages
    data.pkl refers to; no other record. The engine computes the storages'
    CRC-32s during those reads (unless ``verify=False``). Returns (archive,
    small records, storages: a _Records that reads any other storage on
    demand); :func:`_check_storages` then says which fail their CRC check.

    When ``behind(small records)`` says so, the storages are read on a
    background thread (:meth:`_Records.read_behind`) while the caller
    unpickles; the caller must call ``storages.wait()`` before anything reads
    their bytes."""
    archive = _parse_checkpoint(path, fh)
    recs = archive.records
    storages = _Records(path, archive, fh.fileno(), verify)
    small = storages.read([n for n in _SMALL_RECORDS if n in recs], [])
    wanted = _referenced_storages(small["data.pkl"], recs)
    if behind is not None and behind(small):
        storages.read_behind(wanted)
    else:
        storages.read([], wanted)
    storages.fd = -1  # `fh` is closed after this: later reads open the file again
    if storages.allocated > archive.file_size:  # the bound, checked again where it is promised
        storages.wait()
        raise FormatError(f"{path}: {storages.allocated} bytes read from a {archive.file_size}-byte file")
    return archive, small, storages


def _check_storages(path: str, archive: "_zip.Archive", storages: "_Records", verify: Optional[bool]) -> List[str]:
    """The storages read so far that fail their CRC-32 check (none with
    ``verify=False``). A file whose storages all record CRC 0 (saved with
    torch's compute_crc32 disabled) cannot be verified: FormatError with
    ``verify=True``, a warning naming the file under the default
    (``verify=None``), which loads it."""
    if verify is False:
        return []
    recs = archive.records
    nonempty = [n for n in storages if recs[n].size]
    if nonempty and all(recs[n].crc == 0 for n in nonempty):
        _no_checksums(path, verify)
        storages.verify = False  # nor the storages read later
        return []
    return storages.bad(list(storages))


# Globals (module, name) whose calls during torch's weights-only unpickling
# read no storage bytes: what a state dict of plain tensors, parameters,
# optimizer and scheduler state pickles to (storage types and dtypes are
# matched by name below). A pickle naming any other global is unpickled only
# after its storages have been read.
_DATA_BLIND_GLOBALS = frozenset([
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"), ("torch", "Size"), ("torch", "device"),
    ("__builtin__", "set"), ("__builtin__", "frozenset"), ("builtins", "set"), ("builtins", "frozenset"),
    ("_codecs", "encode"),
])
_PICKLE_GLOBAL = re.compile(rb"c([A-Za-z_][\w.]*)\n([A-Za-z_][\w.]*)\n")


def _unpickling_reads_no_data(small: Dict[str, bytes]) -> bool:
    """Whether torch.serialization._load with the weights-only unpickler can
    run on the archive whose small records are `small` before the storages'
    bytes are in (they are read meanwhile): the file's byte order is this
    machine's (else torch byteswaps each storage as it is unpickled), and
    data.pkl is a pickle of protocol 3 or less (torch.save writes 2;
    STACK_GLOBAL exists from 4 on) whose every GLOBAL is data-blind
    (_DATA_BLIND_GLOBALS, torch dtypes, torch storage types). Conservative:
    bytes inside strings that look like a GLOBAL only make it say no. (A
    crafted pickle that hides a global from this scan still meets torch's
    weights-only allowlist; the worst it can do is build a value from bytes
    not yet read, in memory of the right size.) Restoring a storage to a
    location other than the CPU waits for the reads (see load)."""
    if small.get("byteorder") != sys.byteorder.encode():
        return False
    pkl = small.get("data.pkl", b"")
    if len(pkl) < 2 or pkl[0] != 0x80 or pkl[1] > 3:
        return False
    for mod, name in set(_PICKLE_GLOBAL.findall(pkl)):
        m, n = mod.decode(), name.decode()
        if (m, n) in _DATA_BLIND_GLOBALS:
            continue
        if m == "torch" and (n.endswith("Storage") or isinstance(getattr(torch, n, None), torch.dtype)):
            continue
        return False
    return True


# A short string in a pickle (BINUNICODE with a length < 256, or
# SHORT_BINUNICODE) that looks like a device location tag ("cuda", "cuda:1").
_LOCATION_TAG = re.compile(rb"(?:X[\x00-\xff]\x00\x00\x00|\x8c[\x00-\xff])([a-z_]+:[0-9]+|cuda)")


def _moves_off_cpu(map_location: MapLocation, fd: int = -1) -> bool:
    """Whether `map_location` may put storages on a device (then load() reads
    them through the staging pool: :class:`_DeviceRecords`). Without a
    map_location, whether the start of the file (data.pkl comes first) names
    a device location that a copier knows: one 64 KiB read."""
    if map_location is None:
        if fd < 0:
            return False
        head = os.pread(fd, 64 << 10, 0)
        tags = {m.group(1).decode("ascii") for m in _LOCATION_TAG.finditer(head)}
        return any(_staging.copier_for_location(t) is not None for t in tags)
    if callable(map_location):
        return True
    values = map_location.values() if isinstance(map_location, dict) else [map_location]
    return any(_staging.copier_for_location(v) is not None for v in values)


class _DeviceRecords(dict):
    """load() with a map_location that moves storages to a device: no storage
    is read up front. While torch unpickles, each storage's destination is
    decided from its location tag (string, torch.device and dict map_locations
    as torch decides them); a storage bound for a device gets an empty device
    storage now and its bytes in :meth:`finish`,
    read in chunks into the staging pool and copied to the device while the
    next chunks are read (host memory: the pool, not the checkpoint). Storages
    that stay on the host are read as :class:`_Records` reads them. A
    callable map_location is called once per storage, as by torch, with a
    storage of the right size whose bytes are filled after it returns (into
    the device storage it returns, through the pool; or into the host storage
    it returns): it must not look at the bytes."""

    def __init__(self, path: str, archive: "_zip.Archive", host: "_Records", map_location: MapLocation):
        super().__init__()
        self.path, self.archive, self.host, self.map_location = path, archive, host, map_location
        self.restore = ts._get_restore_location(map_location)
        self.jobs: List[_staging.LoadJob] = []
        self.host_jobs: List[Tuple[str, torch.UntypedStorage]] = []
        self._dest: Dict[str, Any] = {}
        self._name: Optional[str] = None

    def get(self, name, default=None):
        rec = self.archive.records.get(name)
        if rec is None:
            return default
        self._name = name  # torch restores the storage it asked for right after
        return torch.empty(rec.size, dtype=torch.uint8, device="meta")

    def _destination(self, location: str):
        if location not in self._dest:
            ml = self.map_location
            target = ml.get(location, location) if isinstance(ml, dict) else location if ml is None else ml
            self._dest[location] = _staging.copier_for_location(target)
            if self._dest[location] is None and isinstance(target, (str, torch.device)):
                try:
                    if torch.device(target).type == "cpu":
                        self._dest[location] = "cpu"
                except (RuntimeError, TypeError, ValueError):
                    pass
        return self._dest[location]

    def restore_location(self, storage, location):
        name, self._name = self._name, None
        if name is None:
            return self.restore(storage, location)
        rec = self.archive.records[name]
        if callable(self.map_location):
            # The callable is called once per storage, as torch calls it, with a
            # storage of the record's size and location whose bytes are filled
            # after it returns (through the pool if it moved it to a device).
            r = self.restore(_host_storage(rec.size).untyped_storage(), location)
            u = r._untyped_storage if isinstance(r, torch.storage.TypedStorage) else r
            if isinstance(u, torch.UntypedStorage) and u.nbytes() == rec.size:
                copier = _staging.copier_for(u)
                if copier is not None:
                    self.jobs.append(_staging.LoadJob(name, rec.data_offset, rec.size, u, copier))
                elif u.device.type == "cpu":
                    self.host_jobs.append((name, u))
                else:  # another accelerator: a plain copy of the bytes read now
                    u.copy_(self.host.read_late(name, storage=True).untyped_storage())
            return r
        dest = self._destination(location) if isinstance(location, str) else None
        if dest == "cpu":  # stays on the host: read with the others, in one batch
            u = _host_storage(rec.size).untyped_storage()
            self.host_jobs.append((name, u))
            return self.restore(u, location)
        if dest is None:  # an unknown place: read now, restore as torch does
            t = self.host[name] if name in self.host else self.host.read_late(name, storage=True)
            return self.restore(t.untyped_storage(), location)
        copier, device = dest
        dst = copier.empty_device(rec.size, device)
        # Filled after the unpickling: until then no tensor may stretch it (torch's error, as on the host);
        # resizable again in finish(), as torch's restored device storages are.
        _C.set_resizable(_as_bytes_tensor(dst), False)
        self.jobs.append(_staging.LoadJob(name, rec.data_offset, rec.size, dst, copier))
        return dst

    def unseal(self) -> None:
        """After :meth:`finish`: the device storages resizable, as torch's restored ones are."""
        for j in self.jobs:
            _C.set_resizable(_as_bytes_tensor(j.dst), True)

    def finish(self, verify: Optional[bool]) -> List[str]:
        """Read every deferred storage (device-bound ones through the pool,
        host ones a callable map_location kept on the host in one parallel
        batch); returns the names of records that fail their CRC with `verify`."""
        path = self.path
        recs = self.archive.records
        if not self.jobs and not self.host_jobs:
            return []
        # The file is open again (the unpickler ran after it was closed): it
        # must be the one the archive was parsed from.
        with self.host.reopened() as fd:
            def read(ranges, crc):
                return _C.read_ranges(get_engine(), path, ranges, fd, crc).get("crcs")

            self.host.claim([n for n, _ in self.host_jobs])
            # host-bound storages: one batch, CRC-32s computed by the engine during the reads
            host_crcs = self.host.read_into([(n, 0, _as_bytes_tensor(u), verify is not False)
                                             for n, u in self.host_jobs])
            _staging.load_into_device(read, self.jobs, verify is not False)
        if verify is False:
            return []
        names = [n for n in [j.name for j in self.jobs] + [n for n, _ in self.host_jobs] + list(self.host)
                 if recs[n].size]
        if names and all(recs[n].crc == 0 for n in names):
            _no_checksums(path, verify)
            return []
        bad = [j.name for j in self.jobs if j.crc != recs[j.name].crc]
        bad += [n for (n, _), crc in zip(self.host_jobs, host_crcs) if (crc or 0) != recs[n].crc]
        return bad + self.host.bad(list(self.host))


def _open_for_device(path: str, fh, verify: Optional[bool], map_location: MapLocation):
    """As :func:`_read_archive` for a load onto a device: (archive, small
    records, _DeviceRecords), or None where the device path does not apply
    (a file of the other byte order: torch byteswaps the host storages)."""
    archive = _parse_checkpoint(path, fh)
    host = _Records(path, archive, fh.fileno(), verify)
    small = host.read(["data.pkl"], [])
    small.update(host.read([n for n in _SMALL_RECORDS if n in archive.records], []))
    host.fd = -1
    if small.get("byteorder", sys.byteorder.encode()).decode("ascii", "replace") != sys.byteorder:
        return None
    return archive, small, _DeviceRecords(path, archive, host, map_location)


def _tensor_names_for_records(reader: _Reader, records: List[str], pickle_module, pickle_load_args) -> List[str]:
    """Names (paths in the loaded object) of the tensors stored in `records`."""
    offsets = {reader.get_record_offset(n): n for n in records}
    try:
        meta = ts._load(reader, "meta", pickle_module, **pickle_load_args)
    except Exception:  # the pickle itself is unreadable: report the records alone
        return [f"record {n!r}" for n in records]
    found: List[str] = []
    todo = [(meta, "")]  # a loop, not recursion: the object may be nested deeper than Python's stack
    seen = set()
    while todo:
        o, path = todo.pop()
        if isinstance(o, torch.Tensor):
            off = getattr(o.untyped_storage(), "_checkpoint_offset", None)
            if off in offsets:
                found.append(f"tensor {path or '<root>'} (record {offsets[off]!r})")
        elif isinstance(o, (dict, list, tuple)) and id(o) not in seen:
            seen.add(id(o))
            items = o.items() if isinstance(o, dict) else ((f"[{i}]", v) for i, v in enumerate(o))
            kids = [(v, (f"{path}.{k}" if path else str(k)) if isinstance(o, dict) else f"{path}{k}")
                    for k, v in items]
            todo.extend(reversed(kids))
    return found or [f"record {n!r}" for n in records]


class _MapLocationError(Exception):
    """Carries an error of map_location out of the unpickler unchanged."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _weights_only_message(path: str, why: str) -> str:
    """The refusal message: it starts as torch.load's does ("Weights only load
    failed"), which callers match on, then says what fastckpt adds."""
    return (f"Weights only load failed. fastckpt.load({path!r}): the weights-only unpickler refused the file; "
            f"nothing from the file was run.\n{ts.UNSAFE_MESSAGE}\nWeightsUnpickler error: {why}\n"
            "If you trust its source, load it with weights_only=False, "
            "or allow the classes it needs with torch.serialization.add_safe_globals([...]) "
            "(or the torch.serialization.safe_globals context manager).")


def _is_legacy(head: bytes) -> bool:
    """torch's pre-1.6 format: a pickle (protocol 2..5, maybe framed) that
    starts with torch's magic number."""
    if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        return False
    rest = head[2:]
    if rest[:1] == b"\x95":  # FRAME + 8-byte length (protocol 4+)
        rest = rest[9:]
    return rest.startswith(_LEGACY_MAGIC[2:])


def load(f: FileLike, map_location: MapLocation = None, pickle_module: Any = None, *,
         weights_only: Optional[bool] = None, mmap: Optional[bool] = None, verify: Optional[bool] = None,
         group: Any = None, storage_options: Optional[Dict[str, Any]] = None, **pickle_load_args) -> Any:
    """Load an object saved by :func:`save` or by :func:`torch.save`.

    Args:
        f: a path (read through the engine: every storage in parallel with
            O_DIRECT), a readable binary file object (read by torch.load), or an
            fsspec URL (``s3://...``: read with parallel ranged reads into
            memory, then loaded with every check of a path; errors name the URL).
        storage_options: with a URL ``f``: the fsspec filesystem's options.
        map_location: as for torch.load: a device string, torch.device, dict
            of location tags, or callable. Storages bound for a device (by
            map_location, or by their saved location tag when it is None) are
            read in chunks into the staging pool and copied to the device
            while the next chunks are read: host memory is the pool, not the
            checkpoint. A callable is called once per storage, as by torch,
            with a storage of the right size and location whose bytes are
            filled after it returns (it must not read them).
        pickle_module: as for torch.load; only without weights-only.
        weights_only: as for torch.load (the same rules, on every path:
            files, file objects, mmap, legacy files): ``None`` (default) and
            True unpickle with torch's restricted unpickler, so no code from
            the file runs (classes allowed with
            ``torch.serialization.add_safe_globals`` load too); ``None`` with
            an explicit ``pickle_module`` means False.
            ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` forces weights-only even over
            ``weights_only=False``; ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``
            turns ``None`` into False (with torch's warning).
        mmap: map the storages from the file instead of reading them
            (delegated to torch.load's mmap mode). ``None``: torch's
            ``torch.utils.serialization.config.load.mmap`` (False by default).
            Loads that read no storage bytes in torch.load (``map_location="meta"``,
            under a FakeTensorMode or ``torch.serialization.skip_data()``)
            are delegated to it too.
        verify: check every storage read against the CRC-32 recorded in the
            file; the engine computes the CRC-32s while it reads, in parallel
            with the reads. ``None`` (default): verify what is read from a
            path (a damaged byte is a ``FormatError`` naming the tensor); a
            file that records no checksums (saved with torch's
            ``compute_crc32`` disabled) loads unverified, with a warning naming
            it; loads left to torch.load (file objects, ``mmap=True``, the
            no-data loads above, torch's legacy format) are not verified.
            ``True``: verify, and refuse what cannot be verified (a file
            without checksums: ``FormatError``; a file object or
            ``mmap=True``: ``ValueError``). ``False``: no check.

        group: a ``torch.distributed`` process group whose every rank calls
            load with the same ``path`` (a shared filesystem, or node-local
            copies written with ``save(..., placement="node")``): the file is
            read from disk once in total, each rank that has it reading about
            an equal share and the shares exchanged over the group (a backend
            that carries CPU tensors, gloo: host memory, onto a device through
            the staging pool; NCCL with a map_location onto CUDA devices:
            device to device; a backend that carries neither the result's
            device nor CPU tensors: ValueError before any storage is read), so
            every rank returns the whole object. A rank whose path does not
            exist gets every byte from its peers. Verified as a local load
            (each piece's CRC-32 computed where it is read, combined on every
            rank); any rank's failure raises on every rank. Needs a path and
            mmap=False.

    Returns:
        The saved object.

    Raises:
        FileNotFoundError, PermissionError, OSError: the file cannot be read.
        fastckpt.FormatError: the file is truncated, corrupt, not a checkpoint,
            or (with ``verify``) a storage does not match its checksum.
        pickle.UnpicklingError: ``weights_only`` refused something in the file;
            the message starts with "Weights only load failed", as torch's.
        RuntimeError: weights-only with an explicit ``pickle_module``, or
            both TORCH_FORCE_* variables set (as torch.load).

    Example:
        >>> sd = fastckpt.load("ckpt.pt", map_location=f"cuda:{local_rank}")
    """
    if _paths.is_url(f) or storage_options is not None:  # the same call on the bytes read into memory
        if group is not None or not _paths.is_url(f):
            raise ValueError("fastckpt.load: storage_options= goes with a URL (s3://...), and a URL without group=")
        from .remote import urlio
        return urlio.load(f, storage_options, lambda p: load(
            p, map_location, pickle_module, weights_only=weights_only, mmap=mmap, verify=verify, **pickle_load_args))
    weights_only, pickle_module = _torch_rules.weights_only_policy(weights_only, pickle_module)
    ts._check_dill_version(pickle_module)
    if mmap is None:  # torch.load's default
        from torch.utils.serialization import config as _torch_config
        mmap = bool(_torch_config.load.mmap)
    if group is not None:
        if not _is_path(f) or mmap:
            raise ValueError("fastckpt.load(..., group=...) needs a path (the same on every rank) and mmap=False")
        if pickle_load_args and weights_only:
            warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=2)
        pickle_load_args.setdefault("encoding", "utf-8")  # torch.load's default
        from .collective import load as _collective_load
        return _collective_load.load(f, group, map_location, weights_only, pickle_module, verify, pickle_load_args)
    # torch.load receives the decided weights_only (an explicit value: it
    # decides the same again, without a second warning).
    # The default verify (None) leaves these loads to torch.load unverified;
    # an explicit verify=True insists on a path read through the engine.
    if not _is_path(f) or mmap or (verify is not True and _torch_rules.reads_no_data(map_location)):
        if verify:
            raise ValueError("verify=True needs a path and mmap=False")
        _check_layout(f, weights_only)
        return torch.load(f, map_location=map_location, weights_only=weights_only, mmap=mmap,
                          **({} if weights_only else {"pickle_module": pickle_module}), **pickle_load_args)
    path = os.fspath(f)
    with _paths.open_for_reading(path) as fh:  # FileNotFoundError etc. with the usual errno and path
        head = fh.read(32)
        if _is_legacy(head):  # torch's pre-1.6 format: torch.load knows it
            log.debug("fastckpt.load: %s is in torch's legacy format; using torch.load", path)
            fh.seek(0)
            return torch.load(fh, map_location=map_location, weights_only=weights_only,
                              **({} if weights_only else {"pickle_module": pickle_module}), **pickle_load_args)
        if pickle_load_args and weights_only:
            warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=2)
        pickle_load_args.setdefault("encoding", "utf-8")  # torch.load's default
        opened = _open_for_device(path, fh, verify, map_location) if _moves_off_cpu(map_location, fh.fileno()) \
            else None
        if opened is not None:  # storages go to a device through the staging pool
            (archive, small, storages), bad = opened, []
        else:
            # Torch's weights-only unpickler on a plain state dict reads no
            # storage bytes: it runs while the storages are read.
            behind = _unpickling_reads_no_data if weights_only and _is_plain_cpu(map_location) else None
            archive, small, storages = _read_archive(path, fh, verify, behind)
            bad = [] if storages.pending else _check_storages(path, archive, storages, verify)
    if isinstance(storages, _Records) and storages.pending:
        try:
            result = _load_weights_only(path, small, archive, storages, map_location, pickle_load_args)
        except BaseException:
            storages.wait(quiet=True)
            raise
        storages.wait()
        bad = _check_storages(path, archive, storages, verify)
        if bad:
            names = _tensor_names_for_records(_Reader(archive, small, storages), bad, ts._weights_only_unpickler,
                                              pickle_load_args)
            raise FormatError(f"{path}: checksum mismatch (corrupt data) in {', '.join(names)}")
        return result
    return _load_read(path, small, archive, storages, bad, map_location, weights_only, pickle_module,
                      verify, pickle_load_args)


def _is_plain_cpu(map_location: MapLocation) -> bool:
    """map_location leaves every storage where it is, on the CPU, without a call of the user's."""
    return map_location is None or (isinstance(map_location, (str, torch.device))
                                    and torch.device(map_location).type == "cpu" and
                                    torch.device(map_location).index is None)


def _load_weights_only(path: str, small, archive, storages, map_location, pickle_load_args):
    """load()'s unpickling while read_behind fills the storages (weights-only,
    map_location None or the CPU). A storage tagged with another location
    (restored there by torch's rules, copying its bytes) waits for the reads."""
    return _load_read(path, small, archive, storages, [], _restore_behind(storages, map_location), True,
                      ts._weights_only_unpickler, None, pickle_load_args)


def _restore_behind(storages: "_Records", map_location: MapLocation):
    """torch's restore for map_location None or the CPU, for storages still
    being read: one bound for a location other than the CPU (its bytes are
    copied there) waits for the reads first."""
    cpu = map_location is not None

    def restore(storage, location):
        target = "cpu" if cpu else location
        if target != "cpu":
            storages.join()
        return ts.default_restore_location(storage, target)
    return restore


def _load_read(path: str, small, archive, storages, bad, map_location, weights_only: bool, pickle_module,
               verify: Optional[bool], pickle_load_args):
    """The unpickling half of :func:`load`, over records read (or being read)."""
    if weights_only:
        pickle_module = ts._weights_only_unpickler
        # torch's weights-only unpickler is never handed a pickle that nests deep
        # enough to overflow the C stack (a key hashed a million tuples deep) or
        # that would allocate far more than its size: the one walk of _unpickle.
        try:
            _unpickle.check(small["data.pkl"], f"{path}: data.pkl")
        except _unpickle.Refused as e:
            raise pickle.UnpicklingError(_weights_only_message(path, str(e))) from None
    reader = _Reader(archive, small, storages)
    if bad:
        names = _tensor_names_for_records(reader, bad, pickle_module, pickle_load_args)
        raise FormatError(f"{path}: checksum mismatch (corrupt data) in {', '.join(names)}")
    restore_arg, done = map_location, (lambda result: result)
    if isinstance(storages, _DeviceRecords):
        restore_arg = storages.restore_location

        def done(result):  # the device storages' bytes, through the staging pool
            bad = storages.finish(verify)
            storages.unseal()
            if bad:
                names = _tensor_names_for_records(reader, bad, pickle_module, pickle_load_args)
                raise FormatError(f"{path}: checksum mismatch (corrupt data) in {', '.join(names)}")
            return result
    if not weights_only:
        return done(ts._load(reader, restore_arg, pickle_module, **pickle_load_args))
    # The restricted unpickler runs no code from the file, so anything it
    # raises, other than a refusal, comes from a damaged pickle; errors of
    # map_location itself are passed through unchanged.
    restore = ts._get_restore_location(restore_arg)

    def restore_location(storage, location):
        if not isinstance(location, str):
            raise FormatError(f"{path}: data.pkl is damaged: storage location {location!r} is not a string")
        try:
            return restore(storage, location)
        except Exception as e:
            try:
                torch.device(location)
            except Exception:
                raise FormatError(f"{path}: data.pkl is damaged: unknown storage location {location!r}") from e
            raise _MapLocationError(e) from e

    try:
        result = ts._load(reader, restore_location, pickle_module, **pickle_load_args)
    except _MapLocationError as e:
        raise e.error from None
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(_weights_only_message(path, str(e))) from None
    except (FormatError, OSError):
        raise
    except Exception as e:
        raise FormatError(f"{path}: data.pkl is damaged and cannot be unpickled "
                          f"({type(e).__name__}: {e})") from e
    return done(result)
