"""The zip container of a torch.save archive, as fastckpt writes and reads it.

docs/FORMAT.md is the specification; this module follows it. Writing mirrors
what PyTorch's own writer (miniz) produces, ``.format_version`` included, so
that stock ``torch.load`` reads fastckpt files and may compute their storages'
offsets as it does for its own: every record on one alignment, which
:func:`storage_alignment` chooses (4096 where large storages dominate, else
torch's own, 64 by default).
Reading is defensive: every offset and size read from disk is checked against
the file before it is used, and any inconsistency is a :class:`FormatError`.
"""

import math
import os
import struct
from typing import Dict, List, Optional, Tuple

from ..errors import FormatError

ALIGNMENT = 4096       # file alignment of large storage records: read with O_DIRECT straight into place
DIRECT_MIN = 64 << 10  # storage records of at least this many bytes get ALIGNMENT (docs/FORMAT.md 1.3)
TORCH_ALIGNMENT = 64   # torch.save's default record alignment (config.save.storage_alignment)
U32_MAX = 0xFFFFFFFF
U16_MAX = 0xFFFF

LOCAL_SIG = 0x04034B50
CENTRAL_SIG = 0x02014B50
DESCRIPTOR_SIG = 0x08074B50
EOCD_SIG = 0x06054B50
EOCD64_SIG = 0x06064B50
EOCD64_LOC_SIG = 0x07064B50
LOCAL_HEADER_SIZE = 30
CENTRAL_HEADER_SIZE = 46
EOCD_SIZE = 22
EOCD64_SIZE = 56
EOCD64_LOC_SIZE = 20
FLAGS = 0x0808  # bit 3: sizes and CRC in a data descriptor; bit 11: UTF-8 names
DOS_TIME, DOS_DATE = 0, (1 << 5) | 1  # 1980-01-01 00:00, fixed: reproducible files
ZIP64_TAG = 0x0001
PAD_TAG = 0x4246  # "FB": PyTorch's padding field
_BLOCK = 64 << 10  # parsing reads the file in blocks of this size
_HEADER_GAP = 4096  # local headers at most this far apart share one read window ...
_HEADER_WINDOW = 1 << 20  # ... of at most this many bytes
_HEADER_BATCH_BYTES = 16 << 20  # windows read in one parallel batch (their buffers, at most)
# A file up to this size is read whole by one pread (page cache or one disk
# round trip) and parsed from memory, instead of a block at its start, its tail
# and a batch of local headers, one read after the other.
_WHOLE_FILE = 1 << 20

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_central = struct.Struct("<IHHHHHHIIIHHHHHII")
_descriptor32 = struct.Struct("<IIII")
_descriptor64 = struct.Struct("<IIQQ")
_eocd = struct.Struct("<IHHHHIIH")
_eocd64 = struct.Struct("<IQHHIIQQQQ")
_eocd64_loc = struct.Struct("<IIQI")


# ---------------------------------------------------------------- writing

def large_alignment(alignment: int) -> int:
    """The alignment of large storage records in a file whose records are
    otherwise aligned to `alignment` (torch's storage_alignment): a multiple of
    both it and :data:`ALIGNMENT`."""
    return math.lcm(ALIGNMENT, max(1, alignment))


# A file's storage records all share one alignment (torch predicts their offsets from it, see
# :func:`storage_alignment`); the small ones' padding up to it may cost at most this share of the data
# (or SMALL_PADDING_MIN bytes, whichever is more) before a file keeps torch's alignment instead.
SMALL_PADDING_SHARE = 64
SMALL_PADDING_MIN = 1 << 20


def storage_alignment(sizes: List[int], alignment: int, direct_min: Optional[int] = DIRECT_MIN) -> int:
    """The one alignment of every record of an archive whose storages have
    `sizes` bytes, which its ``.storage_alignment`` record states: torch.save
    writes a ``.format_version`` record, and with it torch.load computes each
    storage's offset from the previous one's end and that one alignment, so
    every storage record must follow it (docs/FORMAT.md 1.3).
    :func:`large_alignment` (a multiple of `alignment` and of 4096: records of
    `direct_min` bytes or more are then read O_DIRECT straight into place)
    when the file has such a record and padding its smaller ones to it costs
    at most 1/SMALL_PADDING_SHARE of the data (or SMALL_PADDING_MIN bytes);
    else `alignment`, torch.save's own layout. ``direct_min=None``: always
    `alignment`."""
    if direct_min is None or not any(n >= direct_min for n in sizes):
        return alignment
    large = large_alignment(alignment)
    small = sum(1 for n in sizes if n < direct_min)
    if small * large > max(SMALL_PADDING_MIN, sum(sizes) // SMALL_PADDING_SHARE):
        return alignment
    return large


def record_alignment(size: int, alignment: int, direct_min: Optional[int] = DIRECT_MIN) -> int:
    """Where the data of a storage record of `size` bytes starts: on a multiple
    of :func:`large_alignment` when it has at least `direct_min` bytes (a read
    of it then goes straight into place with O_DIRECT, and the padding, under
    4 KiB, is at most 6% of it), else on a multiple of `alignment`, as
    torch.save packs it. ``direct_min=None``: `alignment` for every record
    (torch.save's own layout). docs/FORMAT.md 1.3."""
    if direct_min is not None and size >= direct_min:
        return large_alignment(alignment)
    return alignment


# (name length, padding) -> (local header's fixed part, "FB" padding field)
_header_parts: Dict[Tuple[int, int], Tuple[bytes, bytes]] = {}


def local_header(name: bytes, size: int, offset: int, alignment: int = ALIGNMENT, base: int = 0) -> bytes:
    """Local file header for a record of `size` bytes whose header starts at
    `offset` of the archive, padded (PyTorch's "FB" extra field) so that the
    data starts on a multiple of `alignment` of the file, where the archive
    itself starts at file offset `base` (an archive embedded in a bigger file,
    as in DCP data files). Same padding rule as PyTorch's getPadding()."""
    start = base + offset + LOCAL_HEADER_SIZE + len(name) + 4
    if size < U32_MAX and offset < U32_MAX:  # the common case, kept short: saves write one per record
        pad = (-start) % alignment
        key = (len(name), pad)
        parts = _header_parts.get(key)
        if parts is None:  # the fixed fields before the name, and the padding field after it
            field = struct.pack("<HH", PAD_TAG, pad) + b"Z" * pad
            parts = (LOCAL_HEADER.pack(LOCAL_SIG, 0, FLAGS, 0, DOS_TIME, DOS_DATE, 0, 0, 0, len(name), len(field)), field)
            if len(_header_parts) < 4096:
                _header_parts[key] = parts
        return parts[0] + name + parts[1]
    extra = b""
    if size >= U32_MAX or offset >= U32_MAX:
        z = b""
        if size >= U32_MAX:
            z += struct.pack("<QQ", 0, 0)
        if offset >= U32_MAX:
            z += struct.pack("<Q", 0)
        extra += struct.pack("<HH", ZIP64_TAG, len(z)) + z
        start += len(extra)
    pad = (-start) % alignment
    extra += struct.pack("<HH", PAD_TAG, pad) + b"Z" * pad
    head = LOCAL_HEADER.pack(LOCAL_SIG, 0, FLAGS, 0, DOS_TIME, DOS_DATE, 0, 0, 0, len(name), len(extra))
    return head + name + extra


def is_fastckpt_layout(records: Dict[str, "Entry"], alignment: int) -> bool:
    """Whether the storage records of an archive (``data_offset`` read) whose
    ``.storage_alignment`` record says `alignment` follow a layout only fastckpt
    writes (docs/FORMAT.md 1.3): `alignment` a multiple of :data:`ALIGNMENT` and
    every storage on it; or, as earlier releases wrote, no ``.format_version``,
    every storage on a multiple of `alignment` and those of at least
    :data:`DIRECT_MIN` bytes on :func:`large_alignment`. (A fastckpt file of
    small storages has torch.save's own layout, and reads as one.)"""
    if alignment < 1 or ".storage_alignment" not in records:
        return False
    data = [e for n, e in records.items() if n.startswith("data/")]
    if alignment % ALIGNMENT == 0:  # every record on one alignment (older fastckpt files among them)
        return all(e.data_offset % alignment == 0 for e in data)
    if ".format_version" in records:
        return False
    large = large_alignment(alignment)
    return all(e.data_offset % (large if e.size >= DIRECT_MIN else alignment) == 0 for e in data)


def descriptor(crc: int, size: int, header_offset: int) -> bytes:
    """Data descriptor after a record's data (none for an empty record)."""
    if size == 0:
        return b""
    if size >= U32_MAX or header_offset >= U32_MAX:
        return _descriptor64.pack(DESCRIPTOR_SIG, crc, size, size)
    return _descriptor32.pack(DESCRIPTOR_SIG, crc, size, size)


class Entry:
    """One record of a zip archive. A class with slots (a dataclass gets
    them only from Python 3.10): an archive of 100,000 records keeps 100,000."""
    __slots__ = ("name", "size", "crc", "header_offset", "data_offset", "method", "compressed_size")

    def __init__(self, name: str, size: int, crc: int, header_offset: int, data_offset: int = 0,
                 method: int = 0, compressed_size: int = -1):
        self.name, self.size, self.crc, self.header_offset = name, size, crc, header_offset
        self.data_offset = data_offset
        self.method = method  # compression method: fastckpt writes 0 (stored); others are refused on load
        self.compressed_size = compressed_size  # as read from the central directory (-1: same as size)

    def _fields(self):
        return tuple(getattr(self, n) for n in self.__slots__)

    def __eq__(self, other):
        return type(other) is Entry and self._fields() == other._fields()

    def __repr__(self):
        return "Entry(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"


def central_directory_size(entries: List[Entry], cd_offset: int) -> int:
    """len(central_directory(entries, cd_offset)), without building it."""
    size = 0
    for e in entries:
        size += CENTRAL_HEADER_SIZE + len(e.name.encode("utf-8"))
        if e.size >= U32_MAX or e.header_offset >= U32_MAX:
            size += 4 + (16 if e.size >= U32_MAX else 0) + (8 if e.header_offset >= U32_MAX else 0)
    n = len(entries)
    if n >= U16_MAX or size >= U32_MAX or cd_offset >= U32_MAX:
        size += EOCD64_SIZE + EOCD64_LOC_SIZE
    return size + EOCD_SIZE


def central_directory(entries: List[Entry], cd_offset: int) -> bytes:
    """Central directory + (zip64 end records when needed) + end record."""
    out = []
    pack = _central.pack
    for e in entries:
        name = e.name.encode("utf-8")
        if e.size < U32_MAX and e.header_offset < U32_MAX:  # the common case, kept short
            out.append(pack(CENTRAL_SIG, 20, 20, FLAGS, 0, DOS_TIME, DOS_DATE, e.crc, e.size, e.size, len(name),
                            0, 0, 0, 0, 0, e.header_offset))
            out.append(name)
            continue
        z = b""
        size32 = e.size
        off32 = e.header_offset
        if e.size >= U32_MAX:
            z += struct.pack("<QQ", e.size, e.size)
            size32 = U32_MAX
        if e.header_offset >= U32_MAX:
            z += struct.pack("<Q", e.header_offset)
            off32 = U32_MAX
        extra = struct.pack("<HH", ZIP64_TAG, len(z)) + z if z else b""
        version = 45 if z else 20
        out.append(_central.pack(CENTRAL_SIG, version, version, FLAGS, 0, DOS_TIME, DOS_DATE, e.crc,
                                 size32, size32, len(name), len(extra), 0, 0, 0, 0, off32))
        out.append(name)
        out.append(extra)
    cd = b"".join(out)
    n = len(entries)
    end = b""
    need64 = n >= U16_MAX or len(cd) >= U32_MAX or cd_offset >= U32_MAX
    if need64:
        eocd64_offset = cd_offset + len(cd)
        end += _eocd64.pack(EOCD64_SIG, EOCD64_SIZE - 12, 45, 45, 0, 0, n, n, len(cd), cd_offset)
        end += _eocd64_loc.pack(EOCD64_LOC_SIG, 0, eocd64_offset, 1)
    end += _eocd.pack(EOCD_SIG, 0, 0, min(n, U16_MAX), min(n, U16_MAX), min(len(cd), U32_MAX),
                      min(cd_offset, U32_MAX), 0)
    return cd + end


# ---------------------------------------------------------------- reading
class NeedMore(Exception):
    """The central directory starts before the bytes given to parse_directory."""

    def __init__(self, start: int):
        super().__init__(start)
        self.start = start  # offset from which the archive must be read


def parse_directory(tail: bytes, tail_start: int, length: int, at, bad):
    """Parse the end records and central directory of an archive of `length`
    bytes, given its last bytes `tail` (from offset `tail_start`).

    `at(offset, n)` returns n bytes of the archive (or raises NeedMore), `bad(what)`
    makes the error to raise. Returns ({name without top folder: Entry without
    data_offset}, central directory offset, top folder). Every count, size and
    offset is checked against the archive before it is used."""
    if length < EOCD_SIZE:
        raise bad(f"a {length}-byte file is too short for a zip archive")
    pos = tail.rfind(b"PK\x05\x06")
    while pos >= 0 and pos + EOCD_SIZE > len(tail):
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
    if pos < 0:
        if tail_start > 0 and length - tail_start < EOCD_SIZE + U16_MAX:
            raise NeedMore(max(0, length - EOCD_SIZE - U16_MAX))
        raise bad("truncated or corrupt: no end-of-central-directory record")
    eocd_off = tail_start + pos
    (_, disk, cd_disk, n_disk, n, cd_size, cd_off, _) = _eocd.unpack_from(tail, pos)
    if disk != 0 or cd_disk != 0 or n_disk != n:
        raise bad("multi-disk zip archives are not supported")
    if n == U16_MAX or cd_size == U32_MAX or cd_off == U32_MAX:
        loc_off = eocd_off - EOCD64_LOC_SIZE
        sig, _, eocd64_off, _ = _eocd64_loc.unpack(at(loc_off, EOCD64_LOC_SIZE))
        if sig != EOCD64_LOC_SIG:
            raise bad(f"corrupt zip64 end locator at offset {loc_off}")
        fields = _eocd64.unpack(at(eocd64_off, EOCD64_SIZE))
        if fields[0] != EOCD64_SIG:
            raise bad(f"corrupt zip64 end record at offset {eocd64_off}")
        n, cd_size, cd_off = fields[7], fields[8], fields[9]
    if cd_off + cd_size > eocd_off or n * CENTRAL_HEADER_SIZE > cd_size:
        raise bad(f"corrupt central directory (offset {cd_off}, {cd_size} bytes, {n} entries, "
                  f"end record at {eocd_off})")
    cd = at(cd_off, cd_size)
    entries: Dict[str, Entry] = {}
    prefix: Optional[str] = None
    p = 0
    for i in range(n):
        if p + CENTRAL_HEADER_SIZE > len(cd):
            raise bad(f"central directory entry {i} runs past the directory")
        (sig, _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len, comment_len,
         _, _, _, hoff) = _central.unpack_from(cd, p)
        if sig != CENTRAL_SIG:
            raise bad(f"corrupt central directory entry {i} at offset {cd_off + p}")
        p += CENTRAL_HEADER_SIZE
        if p + name_len + extra_len + comment_len > len(cd):
            raise bad(f"central directory entry {i} runs past the directory")
        raw_name = cd[p:p + name_len]
        extra = cd[p + name_len:p + name_len + extra_len]
        p += name_len + extra_len + comment_len
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise bad(f"entry {i}: name is not UTF-8") from None
        # zip64 extended information: only the fields that overflowed are present.
        q = 0
        while q + 4 <= len(extra):
            tag, ln = struct.unpack_from("<HH", extra, q)
            body = extra[q + 4:q + 4 + ln]
            if len(body) != ln:
                raise bad(f"entry {name!r}: truncated extra field")
            if tag == ZIP64_TAG:
                it = iter([struct.unpack_from("<Q", body, r)[0] for r in range(0, len(body) - 7, 8)])
                try:
                    if usize == U32_MAX:
                        usize = next(it)
                    if csize == U32_MAX:
                        csize = next(it)
                    if hoff == U32_MAX:
                        hoff = next(it)
                except StopIteration:
                    raise bad(f"entry {name!r}: short zip64 field") from None
            q += 4 + ln
        if flags & 0x1:
            raise bad(f"entry {name!r} is encrypted")
        if method == 0 and csize != usize:
            raise bad(f"entry {name!r}: stored sizes differ ({csize} vs {usize})")
        top, sep, rest = name.partition("/")
        if not sep or not rest:
            raise bad(f"entry {name!r} is not inside the archive's folder")
        if prefix is None:
            prefix = top
        elif top != prefix:
            raise bad(f"entries in two top folders: {prefix!r} and {top!r}")
        if rest in entries:
            raise bad(f"duplicate entry {name!r}")
        if hoff + LOCAL_HEADER_SIZE + csize > cd_off:
            raise bad(f"truncated or corrupt: record {name!r} ({csize} bytes, header at {hoff}) "
                      f"overlaps the central directory at {cd_off}")
        entries[rest] = Entry(name, usize, crc, hoff, 0, method, csize)
    if prefix is None:
        raise bad("empty archive")
    check_layout(entries.values(), cd_off, bad)
    return entries, cd_off, prefix


def record_end(e: Entry) -> int:
    """Where record `e` ends at least: its local header's fixed part and name
    (the extra field is known once the local header is read), then its data.
    With ``data_offset`` set, where its data ends."""
    if e.data_offset:
        return e.data_offset + e.compressed_size
    return e.header_offset + LOCAL_HEADER_SIZE + len(e.name.encode("utf-8")) + e.compressed_size


def check_layout(entries, cd_off: int, bad) -> int:
    """Check that the records `entries` (in central directory order) lie in the
    file in that order, each local header + data before the next record's local
    header and the last before the central directory at `cd_off` (docs/FORMAT.md
    1.5). So no byte of the file belongs to two records, and the records' data
    together is at most the file's size, whatever the directory claims: a reader
    that allocates each record's size allocates at most the file. Returns the
    sum of the records' sizes on disk."""
    prev: Optional[Entry] = None
    end = total = 0
    for e in entries:
        if prev is not None and e.header_offset < end:
            if e.header_offset < prev.header_offset:
                raise bad(f"records out of order: {e.name!r} (local header at {e.header_offset}) lies before "
                          f"{prev.name!r} (at {prev.header_offset}) but follows it in the central directory")
            raise bad(f"records overlap: {e.name!r} (local header at {e.header_offset}) starts inside "
                      f"{prev.name!r} (bytes {prev.header_offset}..{end})")
        end = record_end(e)
        if end > cd_off:
            raise bad(f"truncated or corrupt: record {e.name!r} (bytes {e.header_offset}..{end}) "
                      f"overlaps the central directory at {cd_off}")
        total += e.compressed_size
        prev = e
    if total > cd_off:  # follows from the above; a check that stays on guards the memory bound
        raise bad(f"records hold {total} bytes before the central directory at {cd_off}")
    return total



def local_data_offset(buf, q: int, e: Entry, bad) -> int:
    """Check record `e`'s local header, which starts at ``buf[q:]`` (its fixed
    part and name at least), and return where its data starts in the file."""
    if q < 0 or q + LOCAL_HEADER_SIZE > len(buf):
        raise bad(f"entry {e.name!r}: truncated local header at offset {e.header_offset}")
    lsig, _, _, _, _, _, _, _, _, lname_len, lextra_len = LOCAL_HEADER.unpack_from(buf, q)
    if lsig != LOCAL_SIG:
        raise bad(f"entry {e.name!r}: no local header at offset {e.header_offset}")
    raw_name = e.name.encode("utf-8")
    if lname_len != len(raw_name) or buf[q + LOCAL_HEADER_SIZE:q + LOCAL_HEADER_SIZE + lname_len] != raw_name:
        raise bad(f"entry {e.name!r}: local header names another record")
    return e.header_offset + LOCAL_HEADER_SIZE + lname_len + lextra_len


def read_local_headers(entries: List[Entry], read_many, read_at, bad) -> None:
    """Set the ``data_offset`` of each of `entries` (in file order) from its
    local header. The headers lie all over the file (one before each record):
    they are read in parallel batches through ``read_many([(buffer, offset),
    ...])`` (the engine's reads; None: one ``read_at(offset, n)`` each) rather
    than one cold read each. Headers close to each other (records smaller than
    _HEADER_GAP) share one read window of at most _HEADER_WINDOW bytes, parsed
    in place: 100,000 small records are a few dozen reads, not 100,000
    buffers. (The engine reads aligned blocks anyway, so a window reads no
    more of the file than separate reads would.) Windows go in batches of at
    most _HEADER_BATCH_BYTES."""
    windows: List[Tuple[int, int, List[Entry]]] = []  # (file offset, length, entries whose headers it covers)
    for e in entries:
        need = e.header_offset + LOCAL_HEADER_SIZE + len(e.name.encode("utf-8"))
        if windows:
            w_off, w_len, w_items = windows[-1]
            if (e.header_offset - (w_off + w_len) <= _HEADER_GAP and need - w_off <= _HEADER_WINDOW
                    and e.header_offset >= w_off):
                windows[-1] = (w_off, max(w_len, need - w_off), w_items)
                w_items.append(e)
                continue
        windows.append((e.header_offset, need - e.header_offset, [e]))
    first = 0
    while first < len(windows):
        last, total = first, 0
        while last < len(windows) and (last == first or total + windows[last][1] <= _HEADER_BATCH_BYTES):
            total += windows[last][1]
            last += 1
        batch = windows[first:last]
        first = last
        bufs = [bytearray(w_len) for _, w_len, _ in batch]
        if read_many is not None:
            read_many([(b, w_off) for b, (w_off, _, _) in zip(bufs, batch)])
        else:
            for b, (w_off, w_len, _) in zip(bufs, batch):
                b[:] = read_at(w_off, w_len)
        for buf, (w_off, _, w_items) in zip(bufs, batch):
            for e in w_items:
                e.data_offset = local_data_offset(buf, e.header_offset - w_off, e, bad)


class Archive:
    """The records of a zip archive, parsed from its central directory.

    ``records`` maps names without the archive's top folder ("data.pkl",
    "data/0", ...) to entries whose ``data_offset`` has been read from and
    checked against each local header; parsed with ``local_headers=False``,
    an entry's ``data_offset`` is 0 until its header is read: with its data
    (:meth:`guesses`, :meth:`settle`: a load reads each byte of the file once)
    or on its own (:meth:`resolve`).
    """

    def __init__(self, path: str, prefix: str, records: Dict[str, Entry], file_size: int, data_bytes: int = -1):
        self.path = path
        self.prefix = prefix
        self.records = records
        self.file_size = file_size
        # sum of the records' sizes on disk: at most file_size (check_layout)
        self.data_bytes = sum(e.compressed_size for e in records.values()) if data_bytes < 0 else data_bytes
        self.stat: Optional[os.stat_result] = None  # of the file parsed, to know it again
        self.cd_offset = file_size  # where the central directory starts (parse sets it)
        self._next: Optional[Dict[int, int]] = None  # header offset -> where the next record (or the directory) starts
        self._signed: Optional[bool] = True  # data descriptors with their signature (None: no descriptors)
        self._guesses: Optional[Dict[int, int]] = None  # guesses()

    def bad(self, what: str) -> FormatError:
        return FormatError(f"{self.path}: {what}")

    def _following(self) -> Dict[int, int]:
        """Header offset -> where the next record (or the central directory) starts."""
        if self._next is None:
            starts = [e.header_offset for e in self.records.values()] + [self.cd_offset]
            self._next = dict(zip(starts, starts[1:]))
        return self._next

    @staticmethod
    def _descriptor(e: Entry, signed: Optional[bool]) -> int:
        """The bytes of record `e`'s data descriptor in the form `signed` (with
        its signature, without, None: no descriptors)."""
        if signed is None:
            return 0
        return (16 if signed else 12) + (8 if max(e.size, e.compressed_size) >= U32_MAX else 0)

    def guesses(self) -> Dict[int, int]:
        """Where the data of each record whose local header was not read yet
        starts if the file is laid out as torch.save and fastckpt write it
        (by the record's header offset): the record's data, then its data
        descriptor, then the next record (the descriptors' form learnt from
        the headers :meth:`settle` checked); 0 where that leaves no room for
        a local header (or more room than one can take). :meth:`settle`
        checks each against the header."""
        if self._guesses is None:
            following, signed, out = self._following(), self._signed, {}
            for e in self.records.values():
                if e.data_offset:
                    continue
                at = following[e.header_offset] - e.compressed_size - self._descriptor(e, signed)
                least = e.header_offset + LOCAL_HEADER_SIZE + len(e.name.encode("utf-8"))
                out[e.header_offset] = at if least <= at <= least + U16_MAX else 0
            self._guesses = out
        return self._guesses

    def settle(self, groups: List[Tuple[object, int, List[str]]], guessed: Dict[str, int]) -> List[str]:
        """For each (buffer, file offset, names) of `groups`, a buffer of the
        file's bytes from that offset holding the local headers of records
        `names`: set each record's data offset from its header (checked:
        :func:`local_data_offset`), taking its guess out of `guessed`.
        Returns the names of those whose data is not where it was guessed;
        from those, learns the form of the file's data descriptors for the
        guesses that follow (:meth:`guesses`)."""
        recs, wrong = self.records, []
        for buf, base, names in groups:
            for name in names:
                e = recs[name]
                e.data_offset = local_data_offset(buf, e.header_offset - base, e, self.bad)
                if e.data_offset != guessed.pop(name):
                    wrong.append(name)
                    gap = self._following()[e.header_offset] - e.data_offset - e.compressed_size
                    for signed in (True, False, None):
                        if gap == self._descriptor(e, signed) and signed != self._signed:
                            self._signed, self._guesses = signed, None
                            break
        return wrong

    def resolve(self, entries: List[Entry], read_many) -> None:
        """Read the local headers of those of `entries` (in file order) whose
        data offset is not known yet (:func:`read_local_headers`)."""
        read_local_headers([e for e in entries if not e.data_offset], read_many, None, self.bad)

    def check_layout(self) -> None:
        """:func:`check_layout` with the data offsets known so far."""
        self.data_bytes = check_layout(self.records.values(), self.cd_offset, self.bad)

    @classmethod
    def open(cls, path: str, read_many=None) -> "Archive":
        """Parse the archive at `path`. `read_many([(buffer, offset), ...])`, if
        given, fills buffers from the file in one batch (the engine's parallel
        reads); it must raise FormatError for a range past the end."""
        with open(path, "rb") as f:
            return cls.parse(f, os.fspath(path), read_many)

    @classmethod
    def parse(cls, f, path: str, read_many=None, use_fd: bool = True, local_headers: bool = True) -> "Archive":
        """Parse the archive open as binary file `f` (`path` names it in errors):
        a file, or (or with use_fd=False: any) seekable binary stream, read from
        its offset 0 with seek and read (a gzip.GzipFile's fileno() is that of
        the compressed file, not of the bytes it reads). With
        ``local_headers=False``, the records' local headers are left to be read
        with their data (see the class), except from a file small enough to
        be read whole here."""
        try:
            fd = f.fileno() if use_fd else -1
        except (AttributeError, OSError):  # io.BytesIO: io.UnsupportedOperation
            fd = -1
        st: Optional[os.stat_result] = None
        if fd >= 0:
            st = os.fstat(fd)
            size = st.st_size

            def pread(n: int, off: int) -> bytes:
                return os.pread(fd, n, off)
        else:
            size = f.seek(0, os.SEEK_END)

            def pread(n: int, off: int) -> bytes:
                f.seek(off)
                return f.read(n)

        def bad(what: str) -> FormatError:
            return FormatError(f"{path}: {what}")

        blocks: Dict[int, bytes] = {}  # small reads (local headers) share 64 KiB blocks
        whole = pread(size, 0) if fd >= 0 and size <= _WHOLE_FILE else None

        def read_at(off: int, n: int) -> bytes:
            if off < 0 or n < 0 or off + n > size:
                raise bad(f"truncated: needs bytes {off}..{off + n} of a {size}-byte file")
            if whole is not None:
                b = whole[off:off + n]
                if len(b) != n:  # the file shrank since fstat
                    raise bad(f"truncated while reading {n} bytes at offset {off}")
                return b
            first, last = off // _BLOCK, (off + n - 1) // _BLOCK if n else off // _BLOCK
            if n > _BLOCK or last - first > 1:
                b = pread(n, off)
            else:
                parts = []
                for k in range(first, last + 1):
                    if k not in blocks:
                        blocks[k] = pread(_BLOCK, k * _BLOCK)
                    parts.append(blocks[k])
                joined = b"".join(parts)
                b = joined[off - first * _BLOCK:off - first * _BLOCK + n]
            if len(b) != n:
                raise bad(f"truncated while reading {n} bytes at offset {off}")
            return b

        if size < EOCD_SIZE:
            raise bad(f"not a checkpoint: {size} bytes is too short for a zip archive")
        head = read_at(0, 4)
        if head != b"PK\x03\x04":
            raise bad(f"not a zip-format torch checkpoint (starts with {head!r})")
        tail_len = min(size, EOCD_SIZE + U16_MAX)
        tail = read_at(size - tail_len, tail_len)
        entries, cd_off, prefix = parse_directory(tail, size - tail_len, size, read_at, bad)
        data_bytes = -1  # the sum of the records' sizes (Archive)
        if local_headers or whole is not None:
            read_local_headers(list(entries.values()), read_many if whole is None else None, read_at, bad)
            # Now with each record's real data offset: in order, disjoint, before the directory.
            data_bytes = check_layout(entries.values(), cd_off, bad)
        archive = cls(path, prefix, entries, size, data_bytes)
        archive.stat = st
        archive.cd_offset = cd_off
        return archive
