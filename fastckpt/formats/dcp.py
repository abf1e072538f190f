"""One DCP tensor record: a torch.save archive of one tensor, laid out for O_DIRECT.

The stock ``FileSystemWriter`` stores every tensor of a ``.distcp`` file as a
complete ``torch.save`` archive (a stored zip) at the offset/length recorded in
``.metadata``, and the stock reader hands that byte range to ``torch.load``.
fastckpt writes the same archives, byte for byte the same pickle and records,
with one difference: the padding field of the ``data/0`` record is sized so
that the tensor bytes start on a 4 KiB boundary *of the file* (for tensors of
at least :data:`ALIGN_MIN` bytes), which lets a reader fetch them with
``O_DIRECT`` straight into the destination. See docs/FORMAT.md, section 2.

Reading goes the other way without ``torch.load``: the central directory and
local headers locate ``data.pkl`` and the storage record, a restricted
unpickler turns ``data.pkl`` into a :class:`TensorLayout` (dtype, size, stride,
storage offset) without touching tensor data, and the caller reads only the
bytes it needs. Anything this parser does not recognise is reported as
:class:`Unsupported`, and the caller falls back to ``torch.load`` on the
whole record, exactly as the stock reader does.

Every offset and size read from disk is checked before use; an inconsistent
record raises :class:`fastckpt.FormatError`.
"""

import collections
import pickle
import sys
import uuid
import zlib
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from .. import _C
from . import unpickler as _unpickle
from .pickler import DEFAULT_PROTOCOL, pickle_with_storages, tensor_reduce
from .torch_rules import contiguous_stride, itemsize, storage_ref, v3_dtypes
from ..errors import FormatError

__all__ = ["ALIGN", "ALIGN_MIN", "RECORD_ALIGN", "TensorBlob", "plan_tensor_blob", "ZipIndex",
           "parse_tail", "TAIL_READ", "local_data_offset", "TensorLayout", "parse_pickle", "Unsupported"]

# The zip container is the one of single-file checkpoints (docs/FORMAT.md 1.1),
# and so is the rule of which tensors get 4 KiB alignment (1.3).
from .zip import ALIGNMENT, DIRECT_MIN, LOCAL_HEADER_SIZE, LOCAL_SIG, TORCH_ALIGNMENT, Entry, NeedMore, LOCAL_HEADER, central_directory, descriptor, local_header, parse_directory, record_alignment

ALIGN = ALIGNMENT           # file alignment of tensor bytes
ALIGN_MIN = DIRECT_MIN      # tensors smaller than this are only 64-byte aligned (no 4 KiB hole for a bias)
RECORD_ALIGN = TORCH_ALIGNMENT  # torch.save's own record alignment; every blob starts on a multiple of it
TAIL_READ = 4096            # bytes read from the end of a record to find its central directory

ARCHIVE = "archive"   # the top folder torch.save uses for a file object without a name


# ---------------------------------------------------------------- the pickle

class _TensorStub:
    """Pickles like a CPU tensor of `dtype` and `size` whose storage is exactly its
    contiguous bytes (what torch.save writes for such a tensor; see
    ``torch.Tensor._reduce_ex_internal``)."""

    def __init__(self, dtype: torch.dtype, size: Tuple[int, ...]):
        self.dtype = dtype
        self.size = size

    def __reduce__(self):
        numel = 1
        for s in self.size:
            numel *= s
        storage, untyped = storage_ref(self.dtype, numel * itemsize(self.dtype), key="0")
        return tensor_reduce(storage, untyped, self.dtype, 0, self.size, contiguous_stride(self.size))


def _storage_type_names() -> Dict[torch.dtype, str]:
    return torch.storage._dtype_to_storage_type_map()


_pickle_cache: Dict[Tuple[torch.dtype, Tuple[int, ...]], bytes] = {}


def tensor_pickle(dtype: torch.dtype, size: Tuple[int, ...]) -> bytes:
    """The ``data.pkl`` torch.save writes for a contiguous CPU tensor (protocol 2)."""
    key = (dtype, size)
    p = _pickle_cache.get(key)
    if p is None:
        if dtype not in v3_dtypes() and dtype not in _storage_type_names():
            raise TypeError(f"fastckpt.dcp: cannot save tensors of dtype {dtype}")
        p = pickle_with_storages(_TensorStub(dtype, size), pickle, DEFAULT_PROTOCOL)[0]
        if len(_pickle_cache) < 4096:
            _pickle_cache[key] = p
    return p


# ---------------------------------------------------------------- writing a record

class TensorBlob:
    """The layout of one tensor record at a known file offset: ``head`` (bytes up
    to the tensor data), then the tensor's ``nbytes``, then ``tail(crc)``."""

    def __init__(self, head: bytes, nbytes: int, data_offset: int, data_rec: Entry, tail_len: int,
                 small_tail: bytes, recs: List[Entry], cd_rel: int):
        self.head = head
        self.nbytes = nbytes
        self.data_offset = data_offset  # absolute file offset of the tensor bytes
        self._data_rec = data_rec
        self._small_tail = small_tail
        self._recs = recs
        self._cd_rel = cd_rel
        self.length = len(head) + nbytes + tail_len

    def tail(self, crc: int) -> bytes:
        self._data_rec.crc = crc
        return (descriptor(crc, self.nbytes, self._data_rec.header_offset) + self._small_tail
                + central_directory(self._recs, self._cd_rel))


def plan_tensor_blob(dtype: torch.dtype, size: Tuple[int, ...], file_offset: int) -> TensorBlob:
    """Lay out the torch.save archive of a contiguous tensor starting at `file_offset`."""
    if file_offset % RECORD_ALIGN:
        raise ValueError(f"tensor records start on multiples of {RECORD_ALIGN} (got {file_offset})")
    numel = 1
    for s in size:
        numel *= s
    nbytes = numel * itemsize(dtype)
    pkl = tensor_pickle(dtype, tuple(size))
    serialization_id = f"{uuid.uuid4().int:040d}"[:40].encode()
    before = [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", str(RECORD_ALIGN).encode()),
              ("byteorder", sys.byteorder.encode())]
    after = [("version", b"3\n"), (".data/serialization_id", serialization_id)]
    recs: List[Entry] = []
    parts: List[bytes] = []
    rel = 0

    def small(name: str, payload: bytes, out: List[bytes]) -> None:
        nonlocal rel
        full = f"{ARCHIVE}/{name}".encode()
        rec = Entry(full.decode(), len(payload), zlib.crc32(payload), rel)
        h = local_header(full, len(payload), rel, RECORD_ALIGN, base=file_offset)
        d = descriptor(rec.crc, len(payload), rel)
        out += [h, payload, d]
        rel += len(h) + len(payload) + len(d)
        recs.append(rec)

    for name, payload in before:
        small(name, payload, parts)
    full = f"{ARCHIVE}/data/0".encode()
    data_rec = Entry(full.decode(), nbytes, 0, rel)
    h = local_header(full, nbytes, rel, record_alignment(nbytes, RECORD_ALIGN), base=file_offset)
    parts.append(h)
    rel += len(h)
    head = b"".join(parts)
    data_offset = file_offset + rel
    recs.append(data_rec)
    rel += nbytes + len(descriptor(0, nbytes, data_rec.header_offset))
    tail_parts: List[bytes] = []
    for name, payload in after:
        small(name, payload, tail_parts)
    small_tail = b"".join(tail_parts)
    cd_rel = rel
    tail_len = (len(descriptor(0, nbytes, data_rec.header_offset)) + len(small_tail)
                + len(central_directory(recs, cd_rel)))
    return TensorBlob(head, nbytes, data_offset, data_rec, tail_len, small_tail, recs, cd_rel)


# ---------------------------------------------------------------- reading a record

@dataclass
class ZipEntry:
    name: str          # without the top folder: "data.pkl", "data/0", ...
    size: int
    crc: int
    rel_offset: int    # local header, relative to the record's start
    method: int


@dataclass
class ZipIndex:
    entries: Dict[str, ZipEntry]
    cd_offset: int     # relative to the record's start

    def span_end(self, e: ZipEntry) -> int:
        """Where the next local header (or the central directory) starts."""
        nxt = [x.rel_offset for x in self.entries.values() if x.rel_offset > e.rel_offset]
        return min(nxt) if nxt else self.cd_offset


class Unsupported(Exception):
    """A valid record that this fast parser does not handle (torch.load will)."""


def parse_tail(tail: bytes, tail_start: int, length: int, where: str) -> ZipIndex:
    """Parse the end records and central directory of a record of `length` bytes,
    given its bytes from relative offset `tail_start` to the end.

    Raises NeedMore(start) when the directory begins before `tail_start`."""

    def bad(what: str) -> FormatError:
        return FormatError(f"{where}: {what}")

    def at(off: int, n: int) -> bytes:
        if off < tail_start:
            raise NeedMore(off)
        if off + n > length:
            raise bad(f"zip structure runs past the end of the record (needs bytes {off}..{off + n} of {length})")
        return tail[off - tail_start:off - tail_start + n]

    entries, cd_off, _ = parse_directory(tail, tail_start, length, at, bad)
    return ZipIndex({rest: ZipEntry(rest, e.size, e.crc, e.header_offset, e.method) for rest, e in entries.items()},
                    cd_off)


def local_data_offset(header: bytes, e: ZipEntry, index: ZipIndex, where: str) -> int:
    """The record-relative offset of `e`'s data, from its local header (at least
    LOCAL_HEADER_SIZE bytes of it); checked against the central directory."""
    if len(header) < LOCAL_HEADER_SIZE:
        raise FormatError(f"{where}: truncated local header of {e.name!r}")
    sig, _, _, method, _, _, _, _, _, name_len, extra_len = LOCAL_HEADER.unpack_from(header, 0)
    if sig != LOCAL_SIG:
        raise FormatError(f"{where}: no local header for {e.name!r} at record offset {e.rel_offset}")
    if method != e.method:
        raise FormatError(f"{where}: record {e.name!r}: the local header says compression method {method}, "
                          f"the central directory {e.method}")
    start = e.rel_offset + LOCAL_HEADER_SIZE + name_len + extra_len
    if start + e.size > index.cd_offset:
        raise FormatError(f"{where}: record {e.name!r} ({e.size} bytes at record offset {start}) "
                          f"runs into the central directory at {index.cd_offset}")
    return start


def verify_archive(data: bytes, where: str) -> int:
    """Check every record of a whole in-memory archive against its CRC-32 (stored
    and deflated records). Returns how many were checked; 0 when `data` is not a
    zip archive. A mismatch or an inconsistent structure raises FormatError."""
    try:
        index = parse_tail(data, 0, len(data), where)
    except FormatError:
        if data[:4] != b"PK\x03\x04":
            return 0  # not an archive at all: nothing to check here
        raise
    checked = 0
    for e in index.entries.values():
        start = local_data_offset(data[e.rel_offset:e.rel_offset + LOCAL_HEADER_SIZE], e, index, where)
        end = index.span_end(e)
        raw = data[start:end]
        if e.method == 0:
            payload = raw[:e.size]
        elif e.method == 8:
            d = zlib.decompressobj(-15)
            try:
                payload = d.decompress(raw, e.size + 1)
            except zlib.error as z:
                raise FormatError(f"{where}: record {e.name!r} does not inflate ({z})") from None
        else:
            continue
        if len(payload) != e.size:
            raise FormatError(f"{where}: record {e.name!r} holds {len(payload)} bytes, the directory says {e.size}")
        if e.crc == 0 and e.size:
            continue  # written with CRCs disabled
        if _C.crc32(payload) != e.crc:
            raise FormatError(f"{where}: checksum mismatch in record {e.name!r} (corrupt data)")
        checked += 1
    return checked


# ---------------------------------------------------------------- the pickle, read back

@dataclass
class _StorageType:
    dtype: torch.dtype
    untyped: bool


@dataclass
class _ParsedStorage:
    """A storage's persistent id as data.pkl holds it, read back (the writing
    side is _torch_rules.StorageRef)."""
    dtype: torch.dtype
    untyped: bool
    key: str
    numel: int


@dataclass(frozen=True)
class TensorLayout:
    """What ``data.pkl`` says about the tensor: element type, shape and where
    its elements lie in storage record ``data/<key>`` (``nbytes`` long)."""

    dtype: torch.dtype
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int     # storage offset, in elements
    key: str
    nbytes: int     # of the storage record


def _rebuild_v2(*args):
    # (storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None)
    if not 4 <= len(args) <= 7:
        raise Unsupported(f"_rebuild_tensor_v2 with {len(args)} arguments")
    storage, storage_offset, size, stride = args[:4]
    if len(args) == 7 and args[6]:
        raise Unsupported("tensor metadata (conjugate/negative bits)")
    if not isinstance(storage, _ParsedStorage) or storage.untyped:
        raise Unsupported("_rebuild_tensor_v2 without a typed storage")
    return _layout(storage, storage.dtype, storage_offset, size, stride)


def _rebuild_v3(*args):
    # (storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None)
    if not 7 <= len(args) <= 8:
        raise Unsupported(f"_rebuild_tensor_v3 with {len(args)} arguments")
    storage, storage_offset, size, stride, _, _, dtype = args[:7]
    if len(args) == 8 and args[7]:
        raise Unsupported("tensor metadata (conjugate/negative bits)")
    if not isinstance(storage, _ParsedStorage) or not isinstance(dtype, torch.dtype):
        raise Unsupported("_rebuild_tensor_v3 without an untyped storage")
    return _layout(storage, dtype, storage_offset, size, stride)


def _layout(storage: "_ParsedStorage", dtype, storage_offset, size, stride) -> TensorLayout:
    ok = (isinstance(storage_offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)
          and len(size) == len(stride) and all(isinstance(x, int) for x in size + stride))
    if not ok:
        raise Unsupported("unexpected tensor arguments")
    isz = 1 if storage.untyped else itemsize(storage.dtype)
    return TensorLayout(dtype, size, stride, storage_offset, storage.key, storage.numel * isz)


_torch_dtypes: Dict[str, torch.dtype] = {}


def _layout_class(module: str, name: str):
    """The policy for data.pkl (see :mod:`fastckpt.formats.unpickler`): torch.save's tensor
    rebuild functions (replaced by ones that only record the layout), storage
    types, dtypes and OrderedDict; any other global is Unsupported."""
    if module == "torch._utils" and name == "_rebuild_tensor_v2":
        return _rebuild_v2
    if module == "torch._utils" and name == "_rebuild_tensor_v3":
        return _rebuild_v3
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    if module == "torch.storage" and name == "UntypedStorage":
        return _StorageType(torch.uint8, True)
    if module == "torch":
        names = {v: k for k, v in _storage_type_names().items()}
        if name in names:
            return _StorageType(names[name], False)
        if not _torch_dtypes:  # from torch's namespace, never getattr with a name from the file
            _torch_dtypes.update({k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)})
        if name in _torch_dtypes:
            return _torch_dtypes[name]
    raise Unsupported(f"global {module}.{name}")


def _layout_persistent(pid):
    if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str) or not isinstance(pid[4], int)):
        raise Unsupported(f"persistent id {pid!r}")
    return _ParsedStorage(pid[1].dtype, pid[1].untyped, pid[2], pid[4])


def parse_pickle(data: bytes, where: str = "data.pkl") -> TensorLayout:
    """The TensorLayout that torch.save's ``data.pkl`` of one plain tensor
    describes, through fastckpt's one restricted unpickler (no code from the
    file runs, and nothing is allocated that the data cannot account for).

    Raises:
        Unsupported: a valid pickle this parser does not handle (another
            object, an unknown global or persistent id): torch.load decides.
        fastckpt.FormatError: a damaged pickle, or one crafted to allocate far
            more than its size (huge memo indices, counted sizes, nesting).
    """
    data = bytes(data)
    hit = _layouts.get(data)
    if hit is not None:
        return hit
    try:
        obj = _unpickle.loads(data, where, _layout_class, persistent_load=_layout_persistent,
                              passthrough=(Unsupported,))
    except _unpickle.Refused as e:  # an opcode or call this parser does not expect
        raise Unsupported(str(e)) from None
    if not isinstance(obj, TensorLayout):
        raise Unsupported(f"data.pkl holds a {type(obj).__name__}, not a tensor")
    if len(_layouts) < _LAYOUTS_MAX and len(data) <= _LAYOUT_KEY_MAX:
        _layouts[data] = obj
    return obj


# parse_pickle's results by the pickle's bytes (a pure function of them: the tensors of a model
# repeat a few dtypes and shapes, and a data.pkl holds nothing else): only what parsed, so that a
# refusal is decided again each time. TensorLayout is frozen: a caller cannot change a hit.
_layouts: Dict[bytes, TensorLayout] = {}
_LAYOUTS_MAX = 1024
_LAYOUT_KEY_MAX = 1024
