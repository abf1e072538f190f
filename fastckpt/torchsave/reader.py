"""Reading a torch.save archive: its zip directory checked, the records that
torch reads fetched in parallel batches through the engine (CRC-32s computed
during the reads), on a background thread while torch unpickles where that is
safe, within the file's size."""

import contextlib
import ctypes
import os
import pickle
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .. import _C, knobs
from .._core import paths as _paths
from .._core.engine import get_engine
from ..errors import FormatError
from ..formats import torch_rules as _rules, unpickler as _unpickle, zip as _zip
from ..formats.pickle_scan import referenced_storages
from ..formats.torch_rules import FileLike


# Records that torch.serialization._load reads besides data.pkl's storages; any
# other record is read only if asked for.
SMALL_RECORDS = ("data.pkl", ".format_version", ".storage_alignment", "byteorder", "version",
                  ".data/serialization_id")


def huge_pages(nbytes: int) -> bool:
    """Whether the storages of 2 MiB or more that a load of `nbytes` allocates
    go on transparent huge pages (the knob load_huge_pages): 1 yes, 0 no, 2
    (default) yes for a load of ``_C.HUGE_JUDGE_MIN`` (32 MiB) or more unless a
    read of this process found them faulting in slower than small pages would
    in the last minute (``_C.huge_pages_pay``: on a VM whose host reclaims the
    guest's free 2 MiB blocks a huge page can fault in several times slower
    than small ones; elsewhere it is faster). A read of memory allocated on
    huge pages (``fresh_huge``) judges them as it faults them in, and moves the
    rest of its destinations to small pages where they are slow
    (:func:`judge_huge_pages`); a smaller load is not judged, and one huge page
    can cost it more than small pages save."""
    knob = knobs.get("load_huge_pages")
    return knob == 1 or (knob == 2 and _C.huge_pages_pay(nbytes))


def judge_huge_pages(huge: bool) -> bool:
    """Whether a read into storages allocated as :func:`huge_pages` said
    (``huge``) may judge the huge pages it faults in and move the rest to small
    pages (``_C.read_ranges``' ``fresh_huge``): with the knob load_huge_pages
    at 2 only; at 1 they stay on huge pages whatever they cost."""
    return huge and knobs.get("load_huge_pages") == 2


def host_storage(nbytes: int, offset: int = 0, item: int = 8, huge: Optional[bool] = None) -> torch.Tensor:
    """Memory for a storage of `nbytes` read from a file at `offset`: from
    _zip.DIRECT_MIN bytes on, at the offset's phase within a 4 KiB page where
    that phase keeps elements of `item` bytes aligned (a torch record's dtype is
    not known here: 8, the largest element alignment; torch.save aligns records
    to 64), so that the engine reads the aligned body of the range O_DIRECT
    straight into it, also from a file whose storages are not 4 KiB-aligned
    (torch.save's 64-byte records, safetensors' packed tensors); torch's
    allocator below. Not resizable, as torch.load's storages are not: a pickle
    whose tensor reaches past its record is then torch's error (a FormatError
    here), never a reallocation of memory that a read still in flight
    (:meth:`Records.read_behind`) fills, nor a tensor holding bytes no record
    had. ``huge``: whether on transparent huge pages from 2 MiB on, as
    decided for the load (None: :func:`huge_pages`)."""
    if nbytes >= _zip.DIRECT_MIN:
        phase = offset % _zip.ALIGNMENT
        # Faulting in fresh memory is most of a cold load's CPU: where huge pages fault in faster,
        # a 2 MiB page costs one fault instead of 512.
        t = _C.empty_aligned(nbytes, _zip.ALIGNMENT, phase if phase % min(item, 8) == 0 else 0,
                             huge=huge_pages(nbytes) if huge is None else huge)
    else:
        t = torch.empty(nbytes, dtype=torch.uint8)
    _C.set_resizable(t, False)
    return t


def host_block(nbytes: int, offset: int, spans: List[Tuple[int, int, int]],
               huge: Optional[bool] = None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Memory for the storages read from one stretch of a file: ``nbytes``
    at file offset ``offset``, each (begin, end, item) of ``spans`` (in order,
    relative to ``offset``, ``item`` its elements' size) a storage of its own.
    Returns (a uint8 tensor over the stretch, for the engine to read it into
    in one range, [a uint8 tensor per span]).

    The stretch is one block laid out as the file is, at its offset's phase
    within a page (``_C.empty_arena``): the engine reads it O_DIRECT in large
    requests into contiguous memory, on transparent huge pages where they pay
    (:func:`huge_pages`), with no copy; each storage gives its own pages back when
    it dies. A span whose file offset does not keep its elements aligned (a
    file written unaligned) is read with the rest and moved into memory of its
    own by :func:`settle_block` (so that no tensor is misaligned). ``huge``:
    as :func:`host_storage`'s."""
    whole, parts = _C.empty_arena(nbytes, offset % _zip.ALIGNMENT, [(b, e) for b, e, _ in spans],
                                  huge=huge_pages(nbytes) if huge is None else huge)
    return whole, parts


def settle_block(offset: int, spans: List[Tuple[int, int, int]], parts: List[torch.Tensor]) -> List[torch.Tensor]:
    """After the block of :func:`host_block` was read: its parts, each span
    whose elements its file offset leaves misaligned copied into memory of its
    own (the block's pages for it given back)."""
    out = []
    for (b, e, item), part in zip(spans, parts):
        if (offset + b) % min(item, 8) != 0:
            own = torch.empty(e - b, dtype=torch.uint8)
            _C.copy_bytes(own, part)
            _C.set_resizable(own, False)
            part = own
        out.append(part)
    return out


# Records at most this far apart in the file share one block of memory (:func:`host_storages`): the
# holes between them (a record's zip header and padding) stay in the block, unused.
BLOCK_GAP = 64 << 10


def block_runs(records: List[Tuple[int, int, int]]) -> Tuple[List[List[int]], int]:
    """How :func:`host_storages` places records (size, data offset, start) of
    one file (``start``: where the stretch read for the record begins: its
    data offset, or its local header's when that is read with the data): runs
    of indices, in file order, of records that follow each other at most
    BLOCK_GAP apart at offsets that keep every element aligned (8); a run of
    several shares one block, a run of one gets memory of its own. Also
    returns the bytes of the holes the blocks hold between and before their
    records (to be accounted for before anything is allocated)."""
    runs: List[List[int]] = []
    open_run = False  # the last run may take the next record
    end = 0  # where the last run's last record ends
    for i in sorted(range(len(records)), key=lambda i: records[i][1]):
        size, off, start = records[i]
        fits = size > 0 and off % 8 == 0
        if fits and open_run and end <= start <= end + BLOCK_GAP:
            runs[-1].append(i)
        else:
            runs.append([i])
            open_run = fits
        end = off + size
    holes = 0
    for run in runs:
        if len(run) > 1:
            last_size, last_off, _ = records[run[-1]]
            holes += (last_off + last_size - records[run[0]][2]) - sum(records[i][0] for i in run)
    return runs, holes


def host_storages(records: List[Tuple[int, int, int]], runs: List[List[int]],
                  blocks: Optional[list] = None, huge: Optional[bool] = None) -> List[torch.Tensor]:
    """Memory for storages read from records (size, data offset, start) of
    one file, in the order given, placed by ``runs`` (:func:`block_runs`): the
    records of a run of several share one block laid out as the file is from
    the first one's start on (:func:`host_block`: each a storage of its own),
    so that the engine's reads of them (one per record, each with its CRC)
    join into large requests into contiguous memory on huge pages; the others
    get memory of their own (:func:`host_storage`). Each block is appended to
    `blocks` (if given) as (file offset, uint8 tensor over it, run).
    ``huge``: as :func:`host_storage`'s, for all of them."""
    out: List[Optional[torch.Tensor]] = [None] * len(records)
    if huge is None:  # decided once for the load
        huge = huge_pages(sum(size for size, _, _ in records))
    for run in runs:
        if len(run) == 1:
            size, off, _ = records[run[0]]
            out[run[0]] = host_storage(size, off, huge=huge)
            continue
        start = records[run[0]][2]
        end = records[run[-1]][1] + records[run[-1]][0]
        whole, parts = host_block(end - start, start, [(records[i][1] - start, records[i][1] - start + records[i][0], 8)
                                                       for i in run], huge=huge)
        for i, part in zip(run, parts):
            out[i] = part
        if blocks is not None:
            blocks.append((start, whole, run))
    return out  # type: ignore[return-value]


class Heads:
    """Local headers planned to be read with the next batch of a
    :class:`Records`' reads: ``own``, (buffer, file offset) reads of headers
    into buffers of their own; ``fills``, blocks (buffer, file offset) whose
    holes the engine fills (`read_ranges`' fill); ``groups``, (buffer, file
    offset it starts at, [records whose headers it holds]) to check after;
    ``blocks``, the tensors those buffers view."""
    __slots__ = ("own", "fills", "groups", "blocks")

    def __init__(self):
        self.own: List[Tuple[Any, int]] = []
        self.fills: List[Tuple[Any, int]] = []
        self.groups: List[Tuple[Any, int, List[str]]] = []
        self.blocks: List[torch.Tensor] = []  # the tensors under the views of fills and groups


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of CPU tensor `t`'s bytes, which does not keep
    `t` alive (the caller does). Not ``t.numpy()``: a process's first use of
    numpy faults its code in, megabytes read from the disk after a cache drop."""
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


class Records(dict):
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
        self.fresh_huge = False  # the last allocate()'s storages may move to small pages (read_into's)
        self._pending: Optional[Tuple[threading.Thread, Dict[str, Any], List[Tuple[str, int, Any, bool]],
                                      "Heads"]] = None  # read_behind's: thread, outcome, items, headers
        # Records whose local header is read with their data (an archive parsed with local_headers=False):
        # the data offset guessed, by name, until the header is checked; and the reads planned for
        # the next batch that bring those headers.
        self._at: Dict[str, int] = {}
        self._heads = Heads()

    def bad(self, names) -> List[str]:
        """Those of storages `names` whose bytes do not match their recorded
        CRC-32. A record with CRC 0 (written without checksums) counts as bad
        only with an explicit ``verify=True``; with ``verify=False``, none."""
        if self.verify is False:
            return []
        recs = self.archive.records
        return [n for n in names if self.crcs.get(n, 0) != recs[n].crc and (self.verify or recs[n].crc != 0)]

    def claim(self, names: List[str], extra: int = 0) -> None:
        """Account for reading records `names` (and `extra` bytes more), before any memory is allocated."""
        n = sum(self.archive.records[name].size for name in names) + extra
        if self.allocated + n > self.archive.file_size:
            raise FormatError(f"{self.path}: reading records {names[:3]}... would allocate "
                              f"{self.allocated + n} bytes for a {self.archive.file_size}-byte file")
        self.allocated += n

    def resolve_headers(self, entries: List["_zip.Entry"]) -> None:
        """Read the local headers of `entries` on their own (and check the layout with them)."""
        fd = self.fd
        self.archive.resolve(sorted(entries, key=lambda e: e.header_offset),
                             lambda ranges: _C.read_ranges(get_engine(), self.path, ranges, fd))
        self.archive.check_layout()

    def _place(self, names: List[str]) -> List[Tuple[int, int, int]]:
        """(size, data offset, start) of records `names`, for :func:`block_runs`:
        a record whose local header is not read yet is placed where the
        archive guesses its data (:meth:`_zip.Archive.guesses`; kept in
        :attr:`_at` until the header is checked), its header to be read with
        it (start: the header's offset); where there is no guess, its header
        is read first."""
        recs = self.archive.records
        guesses = None
        out, lost = [], []
        for n in names:
            e = recs[n]
            at = e.data_offset
            if at:
                out.append((e.size, at, at))
                continue
            if guesses is None:
                guesses = self.archive.guesses()
            g = guesses[e.header_offset]
            if not g:
                lost.append(e)
            out.append((e.size, g, e.header_offset))
        if lost:
            self.resolve_headers(lost)
            out = [(r[0], recs[n].data_offset, recs[n].data_offset) if not r[1] else r for n, r in zip(names, out)]
        at_of = self._at
        for n, (_, off, head) in zip(names, out):
            if head < off:
                at_of[n] = off
        return out

    def allocate(self, storages: List[str]) -> Dict[str, torch.Tensor]:
        """Memory for storage records `storages` (:func:`host_storages`),
        accounted for first (:meth:`claim`, the blocks' holes and the local
        headers read with the data too)."""
        records = self._place(storages)
        runs, holes = block_runs(records)
        heads = sum(records[run[0]][1] - records[run[0]][2] for run in runs if len(run) == 1)
        self.claim(storages, holes + heads)
        blocks: List[Tuple[int, torch.Tensor, List[int]]] = []
        huge = huge_pages(sum(size for size, _, _ in records))
        self.fresh_huge = judge_huge_pages(huge)  # what the reads into them are told (read_into's)
        tensors = host_storages(records, runs, blocks, huge)
        # The local headers to read with the data: a block's holes (before each record: the last
        # one's descriptor, its header) are read into the block, in the same requests (the engine
        # fills what no record covers); a record of its own has its header read into a buffer of
        # its own.
        in_block = set()
        for start, whole, run in blocks:
            in_block.update(run)
            names = [storages[i] for i in run if records[i][2] < records[i][1]]
            if names:
                mem = byte_view(whole)  # where the engine fills the holes and the headers are checked
                self._heads.blocks.append(whole)  # alive while the view is used
                self._heads.fills.append((mem, start))
                self._heads.groups.append((mem, start, names))
        for i, n in enumerate(storages):
            if i not in in_block:
                self._own_head(n, records[i])
        return dict(zip(storages, tensors))

    def _own_head(self, name: str, record: Tuple[int, int, int]) -> None:
        """Plan the read of record `name`'s local header, where the record is
        placed by :meth:`_place`, into a buffer of its own."""
        _, off, head = record
        if head < off:
            buf = bytearray(off - head)
            self._heads.own.append((buf, head))
            self._heads.groups.append((buf, head, [name]))

    def take_heads(self) -> "Heads":
        """The reads of local headers planned so far, to go with the next
        :meth:`read_into` and :meth:`_settle` after it."""
        heads, self._heads = self._heads, Heads()
        return heads

    def _settle(self, items: List[Tuple[str, int, Any, bool]], got: List[Optional[int]], heads: "Heads") -> None:
        """After a read of `items` with `heads` (:meth:`read_into`'s, `got`
        its CRCs): check the local headers read with the data. Where a
        record's data does not start where it was guessed (a file laid out
        otherwise than torch.save and fastckpt lay it out), check the layout
        with the headers' offsets and read that record's data again into the
        same memory (updating `got`)."""
        if not heads.groups:
            return
        at = self._at
        wrong = self.archive.settle(heads.groups, at)
        if wrong:
            self.archive.check_layout()
            index = {name: k for k, (name, *_) in enumerate(items)}
            ks = [index[n] for n in wrong if n in index]
            redo = [items[k] for k in ks]
            if self.fd < 0:  # after read_behind: the caller's descriptor is closed
                with self.reopened():
                    again = self.read_into(redo)
            else:
                again = self.read_into(redo)
            for k, crc in zip(ks, again):
                got[k] = crc

    def read_into(self, items: List[Tuple[str, int, Any, bool]], fd: Optional[int] = None,
                  heads: Optional["Heads"] = None, fresh_huge: bool = False) -> List[Optional[int]]:
        """Fill each (record, offset in the record, destination, crc) with
        that record's bytes, in one parallel batch of engine reads (from `fd`,
        by default :attr:`fd`: the file parsed); returns per item the CRC-32 of
        the bytes read when `crc` (computed by the engine during the reads),
        else None. A destination must lie inside its record. ``fresh_huge``:
        the destinations were just allocated on huge pages (:meth:`allocate`;
        ``_C.read_ranges``)."""
        recs = self.archive.records
        ranges = []
        for name, off, dest, crc in items:
            n = dest.numel() if isinstance(dest, torch.Tensor) else len(dest)
            if off < 0 or off + n > recs[name].size:
                raise ValueError(f"{self.path}: read of bytes {off}..{off + n} of record {name!r} "
                                 f"({recs[name].size} bytes)")
            at = recs[name].data_offset or self._at[name]
            ranges.append((dest, at + off, crc))
        out: List[Optional[int]] = [0 if crc else None for *_, crc in items]
        keep = [i for i, (dest, *_) in enumerate(ranges)
                if (dest.numel() if isinstance(dest, torch.Tensor) else len(dest))]
        own, fills = (heads.own, heads.fills) if heads is not None else ((), ())
        if keep or own or fills:
            st = _C.read_ranges(get_engine(), self.path, [ranges[i] for i in keep] + [(b, at, False) for b, at in own],
                                self.fd if fd is None else fd, fill=fills, fresh_huge=fresh_huge)
            for i, c in zip(keep, st.get("crcs") or []):
                out[i] = c
        return out

    def read_behind(self, storages: List[str]) -> None:
        """Allocate storages `storages` (they are in this dict at once) and fill
        them on a background thread, from a duplicate of :attr:`fd`, while the
        caller unpickles; :meth:`wait` must follow (it joins the thread, also
        after an error). Only for pickles whose unpickling reads no storage
        bytes (:func:`unpickling_reads_no_data`)."""
        storages = [n for n in dict.fromkeys(storages) if n not in self]
        tensors = self.allocate(storages)
        items = [(n, 0, t, self.verify is not False) for n, t in tensors.items()]
        heads = self.take_heads()
        self.update(tensors)
        # The thread reads through a duplicate of the descriptor: the caller
        # closes its own when the archive has been read.
        fd = os.dup(self.fd)
        box: Dict[str, Any] = {}

        def run() -> None:
            try:
                box["crcs"] = self.read_into(items, fd, heads, self.fresh_huge)
            except BaseException as e:  # noqa: BLE001 (re-raised by wait())
                box["error"] = e
            finally:
                os.close(fd)

        t = threading.Thread(target=run, name="fastckpt-load", daemon=True)
        self._pending = (t, box, items, heads)
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
        t, box, items, heads = self._pending
        t.join()
        self._pending = None
        if "error" in box:
            if quiet:
                return
            raise box["error"]
        crcs = box["crcs"]
        self._settle(items, crcs, heads)
        if self.verify is not False:
            self.crcs.update((n, c or 0) for (n, *_), c in zip(items, crcs))

    def read(self, small: List[str], storages: List[str], bad_small: Optional[List[str]] = None) -> Dict[str, bytes]:
        """Read records `small` (returned as bytes, CRC-checked) and `storages`
        (kept as uint8 tensors) that were not read yet, in one parallel batch
        through the engine. A small record that fails its check raises
        FormatError, or is appended to `bad_small` when that is given."""
        small = [n for n in dict.fromkeys(small) if n not in self.small_read]
        storages = [n for n in dict.fromkeys(storages) if n not in self]
        placed = self._place(small)
        self.claim(small, sum(off - head for _, off, head in placed))
        self.small_read.update(small)
        recs = self.archive.records
        bufs = {n: bytearray(recs[n].size) for n in small}
        for n, record in zip(small, placed):
            self._own_head(n, record)
        # Storages get memory at their file offsets' phase, those close together in
        # the file one block laid out as the file is (allocate): the engine reads
        # them O_DIRECT straight in (no copy out of staging), in requests that
        # span several, while its helper thread faults the memory in ahead of
        # the reads (knob `prefault`).
        tensors = self.allocate(storages)
        # The engine computes the CRC-32s while it reads (each piece as it
        # lands, in parallel with the other reads): metadata records always
        # (they are small), storages unless verify=False.
        items = [(n, 0, b, True) for n, b in bufs.items()]
        items += [(n, 0, t, self.verify is not False) for n, t in tensors.items()]
        heads = self.take_heads()
        crcs = self.read_into(items, heads=heads, fresh_huge=self.fresh_huge)
        self._settle(items, crcs, heads)
        got = {n: crc for (n, *_), crc in zip(items, crcs) if crc is not None}
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
            fd = _paths.no_readahead(os.open(self.path, os.O_RDONLY | os.O_CLOEXEC))
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
        referenced_storages does not see, or torch asks for another record):
        read from the same file, opened again and checked to be the same one."""
        with self.reopened():
            small = self.read([] if storage else [name], [name] if storage else [])
        if not storage:
            return small.get(name, b"")
        if self.bad([name]):
            raise FormatError(f"{self.path}: checksum mismatch (corrupt data) in record {name!r}")
        return self[name]


class Reader:
    """What torch.serialization._load asks of a zip reader, over records that
    were already read in parallel (`storages`: a Records also reads the others
    on demand)."""

    def __init__(self, archive: _zip.Archive, small: Dict[str, bytes], storages: Dict[str, torch.Tensor]):
        self.archive = archive
        self.small = small
        self.storages = storages

    def has_record(self, name: str) -> bool:
        return name in self.archive.records

    def get_record(self, name: str) -> bytes:
        if name not in self.small:
            if name not in self.archive.records or not isinstance(self.storages, Records):
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
        if t is None and rec is not None and isinstance(self.storages, Records):
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


def parse_checkpoint(path: str, fh, local_headers: bool = True) -> "_zip.Archive":
    """The zip directory of the checkpoint open as `fh`, checked to be a
    torch.save archive fastckpt can read (uncompressed, with data.pkl, not
    TorchScript; records in order and disjoint, so that reading them all
    allocates at most the file's size). Reads go to that one file even if
    `path` is replaced. ``local_headers=False``: the records' local headers
    are read with their data (:class:`Records`), not here."""
    fd = fh.fileno()
    archive = _zip.Archive.parse(fh, path, lambda ranges: _C.read_ranges(get_engine(), path, ranges, fd),
                                 local_headers=local_headers)
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


def check_layout(f: FileLike, weights_only: bool = False) -> None:
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
                raise pickle.UnpicklingError(weights_only_message(name, str(e), from_torch=False)) from None

    if _paths.is_path(f):
        with _paths.open_for_reading(f) as fh:  # FileNotFoundError etc. as torch.load would raise them
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


def no_checksums(path: str, verify: Optional[bool]) -> None:
    """A file whose storages record no checksums (torch's compute_crc32
    disabled, or skip_data): ``verify=True`` refuses it, the default
    (``None``) loads it unverified with a warning naming it."""
    if verify:
        raise FormatError(f"{path}: verify=True, but the file records no checksums "
                          "(saved with torch's compute_crc32 disabled)")
    warnings.warn(f"fastckpt.load: {path} records no checksums (saved with torch's compute_crc32 "
                  "disabled, or under skip_data): its data cannot be verified; loading it unverified (verify=False "
                  "silences this, verify=True refuses such files)", stacklevel=5)


READ_BEHIND_MIN = 8 << 20  # storages of at least this many bytes are read behind the unpickling


def read_archive(path: str, fh, verify: Optional[bool], behind: Optional[Callable[[bytes], bool]] = None):
    """Parse and read the archive open as `fh`: every read goes to that one
    file, even if `path` is atomically replaced meanwhile. Reads data.pkl and
    the few small records torch reads, then, in one parallel batch, the storages
    data.pkl refers to; no other record. The engine computes the storages'
    CRC-32s during those reads (unless ``verify=False``). Returns (archive,
    small records, storages: a Records that reads any other storage on
    demand); :func:`check_storages` then says which fail their CRC check.

    When ``behind(small records)`` says so, the storages are read on a
    background thread (:meth:`Records.read_behind`) while the caller
    unpickles; the caller must call ``storages.wait()`` before anything reads
    their bytes."""
    # Each record's local header is read with its data, in the same requests: a cold load reads
    # each byte of the file once (the small records first, then the storages).
    archive = parse_checkpoint(path, fh, local_headers=False)
    recs = archive.records
    storages = Records(path, archive, fh.fileno(), verify)
    small = storages.read([n for n in SMALL_RECORDS if n in recs], [])
    wanted = referenced_storages(small["data.pkl"], recs)
    # Records read neither now nor below (none in a file torch.save wrote) get their offsets from
    # their headers now, while the file is open: the archive is then complete when this returns.
    wanted_set = set(wanted)
    rest = [e for n, e in recs.items() if not e.data_offset and n not in wanted_set]
    if rest:
        storages.resolve_headers(rest)
    # Below READ_BEHIND_MIN bytes the reads take less than a thread's start and the GIL's hand-offs
    # between it and the unpickler cost: read first, then unpickle.
    if behind is not None and sum(recs[n].size for n in wanted) >= READ_BEHIND_MIN and behind(small):
        storages.read_behind(wanted)
    else:
        storages.read([], wanted)
    storages.fd = -1  # `fh` is closed after this: later reads open the file again
    if storages.allocated > archive.file_size:  # the bound, checked again where it is promised
        storages.wait()
        raise FormatError(f"{path}: {storages.allocated} bytes read from a {archive.file_size}-byte file")
    return archive, small, storages


def check_storages(path: str, archive: "_zip.Archive", storages: "Records", verify: Optional[bool]) -> List[str]:
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
        no_checksums(path, verify)
        storages.verify = False  # nor the storages read later
        return []
    return storages.bad(list(storages))

def weights_only_message(path: str, why: str, from_torch: bool = True) -> str:
    """The refusal message: torch.load's (:func:`fastckpt.formats.torch_rules.weights_only_failure`:
    it starts "Weights only load failed", which callers match on, and names the
    blocked global and how to allow it), with the user's path and that nothing
    from the file was run. `from_torch=False`: `why` is a refusal of fastckpt's walk."""
    msg = _rules.weights_only_failure(why, from_torch)
    head = "Weights only load failed."
    return f"{head} fastckpt.load({path!r}): nothing from the file was run.{msg[len(head):]}"
