"""What FastReader reads of one data file: the requests of a load plan that
fall in it (:class:`Req`), its tensor records (:class:`Blob`) and the planned
reads (:class:`Copy`), the per-file job that parses the records' zip tails and
reads their bytes through the engine (:class:`FileJob`), and the checks a
non-tensor value passes before the planner unpickles it (:func:`check_value`)."""

import io
import logging
import pickle
import sys
import threading
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .._core import engine as _engine
from ..formats import unpickler as _unpickle
from ..formats.torch_rules import contiguous_stride, itemsize
from .._core.engine import get_engine
from ..errors import FormatError
from ..formats import dcp as _blob

if TYPE_CHECKING:
    from .reader import FastReader

__all__ = ["Req", "Blob", "Copy", "FileJob", "check_value", "item_name", "MAX_SMALL_SPAN"]

log = logging.getLogger("fastckpt")

MAX_SMALL_SPAN = 1 << 20  # data.pkl and byteorder records are expected to be small
# The first round reads each record's first HEAD_READ bytes with its last TAIL_READ: its zip directory,
# data.pkl, byteorder and the storage's local header are there in the archives torch.save and
# FastWriter write (anything beyond is read in a second round). A record of at most WHOLE_READ bytes
# is read whole, its data with it: up to there the engine's reads go through the gap between a head
# and a tail anyway (read_ranges coalesces ranges up to READ_COALESCE_GAP apart).
HEAD_READ = 4096
WHOLE_READ = HEAD_READ + _blob.TAIL_READ + _engine.READ_COALESCE_GAP


def item_name(index: MetadataIndex) -> str:
    return index.fqn if index.offset is None else f"{index.fqn} (chunk at {tuple(index.offset)})"


@dataclass
class Req:
    req: ReadItem
    info: Any                       # _StorageInfo
    target: Optional[torch.Tensor] = None
    data: Optional[bytearray] = None  # BYTE_IO / whole records for torch.load


@dataclass
class Blob:
    """One tensor record of a data file and what the fast path learned about it."""
    offset: int
    length: int
    where: str
    reqs: List[Req] = field(default_factory=list)
    index: Optional[_blob.ZipIndex] = None
    layout: Optional[_blob.TensorLayout] = None
    storage: Optional[_blob.ZipEntry] = None
    data_rel: int = 0               # record-relative offset of the storage bytes
    slow: Optional[str] = None      # why the fast path was abandoned (then read whole, torch.load)
    whole: Optional[bytearray] = None
    head: Optional[bytearray] = None  # the record's first bytes (all of them for a small record), read first

    @property
    def held_whole(self) -> bool:
        """The first round read the whole record (its data is in ``head``)."""
        return self.head is not None and len(self.head) == self.length


@dataclass
class Copy:
    """A planned data read: destination, file offset, then what to do once read."""
    dest: Any
    offset: int
    nbytes: int
    after: Any = None               # after(crc), run after the read (CRC check, copy into target)
    crc: bool = False               # the engine computes the CRC-32 of the bytes read (passed to after)
    src: Any = None                 # the bytes, when the first round read them already (a small record)


def refusal_reason(e: BaseException) -> str:
    """torch's weights-only error inside its refusal (what torch names as
    refused, and how to allow it): the text after "WeightsUnpickler error:", without
    torch's pointer to its documentation."""
    text = str(e)
    at = text.find("WeightsUnpickler error:")
    body = text[at + len("WeightsUnpickler error:"):] if at >= 0 else text
    lines = [ln.strip() for ln in body.splitlines()
             if ln.strip() and not ln.strip().startswith("Check the documentation")]
    return " ".join(lines).rstrip(".") if lines else type(e).__name__


def guard_archive(data: bytes, where: str) -> None:
    """Walk the data.pkl of the torch.save archive `data` with fastckpt's size
    and nesting guards (:func:`fastckpt.formats.unpickler.check`) before torch's
    unpickler sees it: torch's weights-only unpickler would hash a deeply
    nested key (a C stack overflow) or grow as the file says."""
    index = _blob.parse_tail(data, 0, len(data), where)
    e = index.entries.get("data.pkl")
    if e is None:
        raise FormatError(f"{where}: no data.pkl record (not a torch.save archive)")
    start = _blob.local_data_offset(data[e.rel_offset:e.rel_offset + _blob.LOCAL_HEADER_SIZE], e, index, where)
    raw = data[start:index.span_end(e)]
    if e.method == 0:
        pkl = raw[:e.size]
    elif e.method == 8:
        try:
            pkl = zlib.decompressobj(-15).decompress(raw, e.size + 1)
        except zlib.error as z:
            raise FormatError(f"{where}: record 'data.pkl' does not inflate ({z})") from None
    else:
        raise FormatError(f"{where}: record 'data.pkl' uses compression method {e.method}")
    if len(pkl) != e.size:
        raise FormatError(f"{where}: record 'data.pkl' holds {len(pkl)} bytes, the directory says {e.size}")
    _unpickle.check(pkl, f"{where}: data.pkl")


def check_value(r: "Req", path: str) -> None:
    """Refuse a non-tensor value that torch's weights-only unpickler refuses,
    before the planner unpickles it (DefaultLoadPlanner.load_bytes uses
    torch.load with weights_only=False). Anything the check cannot load is
    refused too: a value that fails in the weights-only unpickler is never
    handed to the full one."""
    where = f"{path} @{r.info.offset}+{r.info.length} ({item_name(r.req.storage_index)})"
    data = bytes(r.data)
    guard_archive(data, where)
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"Weights only load failed for the value in {where}: {refusal_reason(e)}. "
            "Nothing from the checkpoint was run. If you trust its source, read it with "
            "FastReader(..., weights_only=False), or allow the class with torch.serialization.add_safe_globals"
        ) from None
    except Exception as e:
        raise FormatError(f"{where}: cannot load the record with the weights-only unpickler "
                          f"({type(e).__name__}: {e}); nothing from the checkpoint was run") from None


def torch_load_record(data: bytes, req: ReadItem, descriptors, reader: "FastReader", where: str):
    stream: Any = io.BytesIO(data)
    if descriptors:
        try:
            stream = reader._transforms().transform_load_stream(req, descriptors, stream)
            stream = io.BytesIO(stream.read(-1))
        except ImportError:
            raise FormatError(f"{where}: record uses stream transforms {descriptors!r}, which this torch "
                              "cannot undo") from None
        except (FormatError, OSError):
            raise
        except Exception as e:  # unknown or damaged descriptors, a damaged transformed stream
            raise FormatError(f"{where}: cannot undo the record's stream transforms {descriptors!r} "
                              f"({type(e).__name__}: {e})") from None
    return stream


class FileJob:
    def __init__(self, reader: "FastReader", path: str, rel: str, reqs: List[Req]):
        self.reader = reader
        self.path = path
        self.rel = rel
        self.reqs = reqs
        self.eng = get_engine()
        self.lock = threading.Lock()
        self.stats = {"fast": 0, "slow": 0, "verified": 0, "bytes_requested": 0, "bytes_read": 0}

    def _read(self, ranges: List[Tuple[Any, ...]]) -> List[Optional[int]]:
        """Fill each (destination, offset[, crc]); returns, per range, the CRC-32
        of its bytes that the engine computed while reading (when asked), else None."""
        keep = [i for i, (d, *_) in enumerate(ranges) if (d.numel() if isinstance(d, torch.Tensor) else len(d))]
        crcs: List[Optional[int]] = [0 if len(r) > 2 and r[2] else None for r in ranges]  # empty: CRC 0
        if keep:
            st = _engine.read_ranges(self.path, [ranges[i] for i in keep], engine=self.eng)
            with self.lock:
                self.stats["bytes_read"] += st["bytes_read"]
            for i, c in zip(keep, st.get("crcs") or []):
                crcs[i] = c
        return crcs

    def run(self) -> None:
        blobs: Dict[Tuple[int, int], Blob] = {}
        whole: List[Req] = []  # BYTE_IO and transformed records: read whole
        for r in self.reqs:
            descs = getattr(r.info, "transform_descriptors", None)
            if r.req.type == LoadItemType.BYTE_IO or descs:
                whole.append(r)
                continue
            key = (r.info.offset, r.info.length)
            b = blobs.get(key)
            if b is None:
                b = blobs[key] = Blob(r.info.offset, r.info.length,
                                       f"{self.path} @{r.info.offset}+{r.info.length} ({item_name(r.req.storage_index)})")
            b.reqs.append(r)
        blist = list(blobs.values())
        self._locate(blist)
        copies: List[Copy] = []
        for r in whole:
            r.data = bytearray(r.info.length)
            copies.append(Copy(r.data, r.info.offset, r.info.length, after=self._after_whole_req(r)))
        for b in blist:
            if b.slow is None:
                for r in b.reqs:
                    c = self._plan_fast(b, r)
                    if c is not None:
                        copies.append(c)
                    self.stats["fast"] += 1
            else:
                log.debug("fastckpt.dcp: %s: read whole (%s)", b.where, b.slow)
                b.whole = bytearray(b.length)
                copies.append(Copy(b.whole, b.offset, b.length, after=self._after_slow_blob(b),
                                   src=b.head if b.held_whole else None))
                self.stats["slow"] += len(b.reqs)
        self.stats["bytes_requested"] += sum(c.nbytes for c in copies)
        self._read_data(copies)

    # -- rounds 1 and 2: zip structures and data.pkl

    def _locate(self, blobs: List[Blob]) -> None:
        # round 1: each record's head and tail in one read (a small record whole)
        first, tails = [], []
        for b in blobs:
            if b.length <= WHOLE_READ:
                b.head = bytearray(b.length)
                first.append((b.head, b.offset))
                tails.append((b.head, 0))
                continue
            b.head = bytearray(HEAD_READ)
            t = bytearray(_blob.TAIL_READ)
            first += [(b.head, b.offset), (t, b.offset + b.length - len(t))]
            tails.append((t, b.length - len(t)))
        self._read(first)
        more = []
        for b, (t, at) in zip(blobs, tails):
            try:
                b.index = _blob.parse_tail(bytes(t), at, b.length, b.where)
            except _blob.NeedMore as m:
                more.append((b, m.start))
        if more:
            bufs = [bytearray(b.length - s) for b, s in more]
            self._read([(buf, b.offset + s) for (b, s), buf in zip(more, bufs)])
            for (b, s), buf in zip(more, bufs):
                try:
                    b.index = _blob.parse_tail(bytes(buf), s, b.length, b.where)
                except _blob.NeedMore:
                    raise FormatError(f"{b.where}: corrupt zip end records") from None

        # data.pkl, byteorder and the storage record's local header: from the head, else round 2
        plan = []  # (blob, what, entry, bytes from the entry's local header on)
        for b in blobs:
            ents = b.index.entries
            pkl = ents.get("data.pkl")
            if pkl is None:
                raise FormatError(f"{b.where}: no data.pkl record (not a torch.save archive)")
            storages = [e for n, e in ents.items() if n.startswith("data/")]
            if len(storages) != 1:
                b.slow = f"{len(storages)} storage records"
                continue
            b.storage = storages[0]
            small = [("pkl", pkl)] + ([("byteorder", ents["byteorder"])] if "byteorder" in ents else [])
            if any(e.method != 0 for _, e in small) or b.storage.method != 0:
                b.slow = "compressed records"
                continue
            for what, e in small:
                span = b.index.span_end(e) - e.rel_offset
                if span > e.size + MAX_SMALL_SPAN:
                    b.slow = f"unusual padding around {e.name}"
                    break
                plan.append([b, what, e, span])
            else:
                plan.append([b, "storage", b.storage, _blob.LOCAL_HEADER_SIZE])
        plan = [p for p in plan if p[0].slow is None]
        missing = []
        for p in plan:
            b, _, e, n = p
            if e.rel_offset + n <= len(b.head):
                p[3] = bytes(b.head[e.rel_offset:e.rel_offset + n])
            else:
                p[3] = bytearray(n)
                missing.append((p[3], b.offset + e.rel_offset))
        if missing:
            self._read(missing)
        got: Dict[int, Dict[str, bytes]] = {}
        for b, what, e, buf in plan:
            if b.slow is not None:
                continue
            start = _blob.local_data_offset(bytes(buf), e, b.index, b.where) - e.rel_offset
            if what == "storage":
                b.data_rel = start + e.rel_offset
                continue
            if start + e.size > len(buf):
                raise FormatError(f"{b.where}: record {e.name!r} runs past the next record")
            data = bytes(buf[start:start + e.size])
            if e.crc and zlib.crc32(data) != e.crc:
                raise FormatError(f"{b.where}: checksum mismatch in record {e.name!r} (corrupt data)")
            got.setdefault(id(b), {})[what] = data
        for b in blobs:
            if b.slow is not None:
                continue
            small = got.get(id(b), {})
            order = small.get("byteorder")
            if order is not None and order not in (b"little", b"big"):
                raise FormatError(f"{b.where}: unknown byte order {order!r}")
            if order is not None and order.decode() != sys.byteorder:
                b.slow = f"{order.decode()}-endian data"
                continue
            try:
                lay = _blob.parse_pickle(small["pkl"], f"{b.where}: data.pkl")
            except _blob.Unsupported as u:
                b.slow = f"data.pkl: {u}"
                continue
            if f"data/{lay.key}" != b.storage.name:
                raise FormatError(f"{b.where}: data.pkl refers to storage {lay.key!r}, the archive holds "
                                  f"{b.storage.name!r}")
            if lay.nbytes != b.storage.size:
                raise FormatError(f"{b.where}: storage record {b.storage.name!r} holds {b.storage.size} bytes, "
                                  f"data.pkl expects {lay.nbytes}")
            isz = itemsize(lay.dtype)
            if lay.offset < 0 or any(s < 0 for s in lay.size) or any(s < 0 for s in lay.stride):
                raise FormatError(f"{b.where}: data.pkl describes a tensor with negative sizes or strides")
            numel = 1
            for s in lay.size:
                numel *= s
            if numel:
                last = lay.offset + sum((n - 1) * s for n, s in zip(lay.size, lay.stride))
                if (last + 1) * isz > lay.nbytes:
                    raise FormatError(f"{b.where}: data.pkl describes a tensor that runs past its storage "
                                      f"({(last + 1) * isz} > {lay.nbytes} bytes)")
            b.layout = lay

    # -- round 3: the data

    def _plan_fast(self, b: Blob, r: Req) -> Optional[Copy]:
        lay = b.layout
        req = r.req
        offs, lens = tuple(req.storage_offsets), tuple(req.lengths)
        if len(offs) != len(lay.size) or len(lens) != len(lay.size):
            raise FormatError(f"{b.where}: the load plan asks for a {len(lens)}-d piece of a "
                              f"{len(lay.size)}-d tensor")
        for o, n, s in zip(offs, lens, lay.size):
            if o < 0 or n < 0 or o + n > s:
                raise FormatError(f"{b.where}: the load plan asks for [{offs}, +{lens}) of a tensor of "
                                  f"size {lay.size}")
        target = r.target
        if tuple(target.shape) != lens:
            raise FormatError(f"{b.where}: destination has shape {tuple(target.shape)}, the checkpoint piece "
                              f"{lens}")
        numel = 1
        for n in lens:
            numel *= n
        if numel == 0:
            return None
        isz = itemsize(lay.dtype)
        lo = lay.offset + sum(o * s for o, s in zip(offs, lay.stride))
        hi = lo + sum((n - 1) * s for n, s in zip(lens, lay.stride))
        span = (hi - lo + 1) * isz
        file_off = b.offset + b.data_rel + lo * isz
        whole_record = lo == 0 and span == lay.nbytes
        check = self.reader.verify and whole_record and (b.storage.crc != 0 or lay.nbytes == 0)
        crc = b.storage.crc
        dense = span == numel * isz and all(
            s == c for n, s, c in zip(lens, lay.stride, contiguous_stride(lens)) if n > 1)
        held = None
        if b.held_whole:  # no read again
            rel = file_off - b.offset
            held = memoryview(b.head)[rel:rel + span]
        if (dense and target.device.type == "cpu" and target.is_contiguous() and target.dtype == lay.dtype):
            dest = target.reshape(-1).view(torch.uint8)

            def after(got: Optional[int]) -> None:
                if check:
                    self._check(b, got, crc)
            return Copy(dest, file_off, span, after, crc=check, src=held)
        buf = torch.empty(span, dtype=torch.uint8)

        def after(got: Optional[int]) -> None:
            if check:
                self._check(b, got, crc)
            src = torch.empty(0, dtype=lay.dtype).set_(buf.untyped_storage(), 0, lens, lay.stride)
            target.copy_(src)
        return Copy(buf, file_off, span, after, crc=check, src=held)

    def _check(self, b: Blob, got: Optional[int], crc: int) -> None:
        """`got`: the CRC-32 the engine computed while reading the record."""
        if got is None:
            raise RuntimeError(f"{b.where}: no CRC-32 came back from the read")  # a bug here, not in the file
        if got != crc:
            raise FormatError(f"{b.where}: checksum mismatch in {b.storage.name!r} (corrupt data)")
        with self.lock:
            self.stats["verified"] += 1

    def _after_whole_req(self, r: Req):
        descs = getattr(r.info, "transform_descriptors", None)
        where = f"{self.path} @{r.info.offset}+{r.info.length} ({item_name(r.req.storage_index)})"

        def after(_crc: Optional[int] = None) -> None:
            if r.req.type == LoadItemType.BYTE_IO:
                if descs:
                    r.data = bytearray(torch_load_record(bytes(r.data), r.req, descs, self.reader, where).read())
                if self.reader.verify and _blob.verify_archive(bytes(r.data), where):
                    with self.lock:
                        self.stats["verified"] += 1
                return
            b = Blob(r.info.offset, r.info.length, where, reqs=[r])
            b.whole = r.data
            self._after_slow_blob(b)()
            r.data = None
        return after

    def _after_slow_blob(self, b: Blob):
        def after(_crc: Optional[int] = None) -> None:
            r0 = b.reqs[0]
            stream = torch_load_record(bytes(b.whole), r0.req, getattr(r0.info, "transform_descriptors", None),
                                        self.reader, b.where)
            # torch.load does not check CRCs: a corrupt record would load as wrong values
            if self.reader.verify and _blob.verify_archive(stream.getvalue(), b.where):
                with self.lock:
                    self.stats["verified"] += 1
            guard_archive(stream.getvalue(), b.where)
            try:
                t = torch.load(stream, map_location="cpu", weights_only=True)
            except Exception as e:
                raise FormatError(f"{b.where}: cannot load the tensor record ({type(e).__name__}: {e})") from None
            if not isinstance(t, torch.Tensor):
                raise FormatError(f"{b.where}: the record holds a {type(t).__name__}, not a tensor")
            for r in b.reqs:
                src = t
                for d, (o, n) in enumerate(zip(r.req.storage_offsets, r.req.lengths)):
                    if d >= src.dim() or o < 0 or o + n > src.size(d):
                        raise FormatError(f"{b.where}: the load plan asks for [{tuple(r.req.storage_offsets)}, "
                                          f"+{tuple(r.req.lengths)}) of a tensor of size {tuple(t.shape)}")
                    if n < src.size(d):
                        src = src.narrow(d, o, n)
                if r.target.size() != src.size():
                    raise FormatError(f"{b.where}: destination has shape {tuple(r.target.shape)}, the checkpoint "
                                      f"piece {tuple(src.shape)}")
                r.target.copy_(src)
            b.whole = None
        return after

    def _read_data(self, copies: List[Copy]) -> None:
        """One parallel read of every copy; the engine computes the CRC-32s
        asked for while the reads are in flight, so that checking a record is
        a comparison afterwards, not a pass over its bytes."""
        held = [c for c in copies if c.src is not None]
        copies = sorted((c for c in copies if c.src is None), key=lambda c: c.offset)
        crcs = self._read([(c.dest, c.offset, c.crc) for c in copies])
        # bytes the first round read (small records): copied, each one's CRC-32 taken during its copy
        got = _engine.copy_crc32_many([c.dest for c in held], [c.src for c in held]) if held else []
        for c, crc in zip(held, got):
            if c.after:
                c.after(crc if c.crc else None)
        for c, crc in zip(copies, crcs):
            if c.after:
                c.after(crc)
