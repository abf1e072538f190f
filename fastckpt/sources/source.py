"""What every source of ``fastckpt inspect``, ``verify`` and ``convert`` shares:
:class:`Source` (a checkpoint's object tree with meta tensors as leaves, and
the reading of any byte range of a storage on demand), :class:`Storage`, the
nesting record that safetensors files carry, and the walk of an object tree.
The kinds of sources are in :mod:`fastckpt.sources.kinds`."""

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.serialization as ts

from .._core import engine as _engine
from .._core import paths as _paths
from ..formats.torch_rules import contiguous_stride

log = logging.getLogger("fastckpt")

STORAGE_ATTR = "_fastckpt_storage"
CHUNK = 8 << 20          # bytes per streamed piece
ALIGN = 4096
@dataclass(eq=False)
class Storage:
    """One storage of a checkpoint: the bytes that one or more tensors view."""
    key: str                      # zip record ("data/3"), safetensors name, DCP fqn, or "mem:<n>"
    nbytes: int
    dtype: torch.dtype            # element type it is stored as (uint8 for an untyped storage)
    untyped: bool = False
    location: Optional[str] = None  # torch's location tag ("cpu", "cuda:0"); None: not recorded
    crc: Optional[int] = None     # CRC-32 recorded for it (zip records only; 0: saved without)
    data: Optional[torch.Tensor] = None  # its bytes, for sources loaded whole


def storage_of(t: torch.Tensor) -> Storage:
    """The :class:`Storage` behind a tensor of a source's tree (real tensors of a
    loaded source get one on first use)."""
    us = t.untyped_storage()
    s = getattr(us, STORAGE_ATTR, None)
    if s is None:
        if t.device.type == "meta":
            raise ValueError("a meta tensor that belongs to no checkpoint source")
        data = torch.empty(0, dtype=torch.uint8, device=us.device).set_(us)
        s = Storage(f"mem:{us._cdata:x}", us.nbytes(), t.dtype, location=ts.location_tag(us), data=data.cpu())
        setattr(us, STORAGE_ATTR, s)
    return s


def meta_tensor(storage: Storage, dtype: torch.dtype, shape, stride=None, offset: int = 0) -> torch.Tensor:
    """A meta tensor viewing `storage` (nothing allocated)."""
    us = torch.UntypedStorage(storage.nbytes, device="meta")
    setattr(us, STORAGE_ATTR, storage)
    shape = tuple(int(s) for s in shape)
    return torch.empty(0, dtype=dtype, device="meta").set_(us, offset, shape,
                                                            contiguous_stride(shape) if stride is None else stride)


def byte_span(t: torch.Tensor) -> Tuple[int, int]:
    """(first byte, length) of the part of its storage that tensor `t` covers."""
    isz = t.element_size()
    if t.numel() == 0:
        return t.storage_offset() * isz, 0
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * isz, (last + 1 - t.storage_offset()) * isz


def is_dense(t: torch.Tensor) -> bool:
    """Its elements are exactly the contiguous bytes of byte_span (C order)."""
    return all(s == c for n, s, c in zip(t.shape, t.stride(), contiguous_stride(t.shape)) if n > 1)


def aligned_buffer(n: int) -> torch.Tensor:
    """n bytes starting on an ALIGN boundary, so that aligned reads go straight in (O_DIRECT)."""
    return _engine.empty_aligned(n, ALIGN)


class LazyValue:
    """A non-tensor value of a DCP checkpoint that has not been read (inspect reads .metadata only)."""

    def __init__(self, fqn: str, nbytes: Optional[int]):
        self.fqn = fqn
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<value {self.fqn!r}, {self.nbytes} bytes, not read>"


class Source:
    """A checkpoint opened for reading piece by piece."""

    kind = "?"            # fastckpt | torch | torch-legacy | safetensors | dcp
    streamed = True       # False: the whole checkpoint was loaded into memory
    path = ""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._bufs: List[torch.Tensor] = []

    # -- what subclasses provide
    def description(self) -> str:
        return self.kind

    def tree(self, values: bool = True) -> Any:
        """The object, with meta tensors for tensors. `values`: also read the
        non-tensor values that are stored apart (DCP byte items)."""
        raise NotImplementedError

    def read(self, storage: Storage, offset: int, out: torch.Tensor) -> None:
        """Fill the uint8 tensor `out` with bytes [offset, offset + len(out)) of `storage`."""
        if storage.data is None:
            raise ValueError(f"no data for storage {storage.key}")
        out.copy_(storage.data[offset:offset + out.numel()])

    def read_crc(self, storage: Storage, offset: int, out: torch.Tensor) -> int:
        """:meth:`read`, returning the CRC-32 of the bytes read (sources that
        read through the engine have it computed during the read)."""
        self.read(storage, offset, out)
        return _engine.crc32(out)

    def read_many(self, items: List[Tuple[Storage, int, torch.Tensor, bool]]) -> List[Optional[int]]:
        """Fill each (storage, offset, uint8 out, crc) of `items` as :meth:`read`
        does; returns per item the CRC-32 of the bytes read where `crc` is true,
        else None. Sources that read through the engine do it in one parallel
        batch of engine reads (straight into each destination, O_DIRECT where
        destination, offset and length are aligned)."""
        return [self.read_crc(s, off, out) if crc else self.read(s, off, out) for s, off, out, crc in items]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._bufs = []

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- built on read()
    def stream(self, storage: Storage, start: int, length: int, consume: Callable[[torch.Tensor], None],
               on_read: Optional[Callable[[torch.Tensor], None]] = None,
               on_crc: Optional[Callable[[int, int], None]] = None) -> None:
        """Call consume(piece) on bytes [start, start + length) of `storage`, in
        pieces of at most CHUNK bytes, reading the next piece while the last is consumed.
        ``on_read(piece)`` runs in the reading thread right after each read, in order;
        so does ``on_crc(crc, n)``, with each piece's CRC-32 (from :meth:`read_crc`).
        Holds two CHUNK buffers, reused across calls."""
        end = start + length
        if length <= 0:
            return

        def fill(pos: int, out: torch.Tensor) -> None:
            if on_crc is None:
                self.read(storage, pos, out)
            else:
                on_crc(self.read_crc(storage, pos, out), out.numel())
            if on_read:
                on_read(out)

        if length <= CHUNK // 8:  # small: no thread
            buf = aligned_buffer(length)
            fill(start, buf)
            consume(buf)
            return
        if not self._bufs:
            self._bufs = [aligned_buffer(CHUNK), aligned_buffer(CHUNK)]
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-source-read")
        bufs = self._bufs

        def rd(i: int, pos: int) -> int:
            n = min(CHUNK, end - pos)
            fill(pos, bufs[i][:n])
            return n

        pos, i = start, 0
        fut = self._pool.submit(rd, 0, pos)
        while True:
            n = fut.result()
            nxt = pos + n
            if nxt < end:
                fut = self._pool.submit(rd, 1 - i, nxt)
            try:
                consume(bufs[i][:n])
            except BaseException:
                if nxt < end:
                    fut.exception()  # let the read in flight finish before the buffer goes
                raise
            if nxt >= end:
                return
            pos, i = nxt, 1 - i

    def read_span(self, storage: Storage, start: int, length: int) -> torch.Tensor:
        """Bytes [start, start + length) of `storage` in a new aligned buffer."""
        buf = aligned_buffer(length)
        self.read(storage, start, buf)
        return buf

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor with the values of meta tensor `t` (reads only the bytes it covers;
        conjugate and negative views resolved)."""
        if t.device.type != "meta":
            return t.detach().cpu().resolve_conj().resolve_neg()
        s = storage_of(t)
        lo, n = byte_span(t)
        if t.numel() == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        buf = self.read_span(s, lo, n)
        v = buf.view(t.dtype)
        out = v.as_strided(t.shape, t.stride(), v.storage_offset())  # storage_offset: buf starts inside its storage
        if t.is_conj() or t.is_neg():  # the bytes are stored unconjugated / unnegated
            out = (out.conj() if t.is_conj() else out)
            out = (out._neg_view() if t.is_neg() else out)
            return out.resolve_conj().resolve_neg().contiguous()
        return out if is_dense(t) else out.contiguous()


class FileSource(Source):
    """A Source over one file kept open: `_parse()` reads its directory, and
    the file is closed again if that fails."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.f = _paths.open_for_reading(path)
        try:
            self._parse()
        except BaseException:
            self.f.close()
            raise

    def _parse(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        super().close()
        self.f.close()


def encode_layout(obj: Any, name_of: Callable[[torch.Tensor], str]) -> Any:
    """The nesting of `obj` as JSON: {"d": [[key, child], ...]} for dicts, {"l": [...]}
    for lists, {"t": [...]} for tuples, {"T": name} for a tensor. Keys must be str or int."""
    if isinstance(obj, torch.Tensor):
        return {"T": name_of(obj)}
    if isinstance(obj, dict):
        for k in obj:
            if type(k) not in (str, int):
                raise TypeError(f"key {k!r} of type {type(k).__name__}")
        return {"d": [[k, encode_layout(v, name_of)] for k, v in obj.items()]}
    if type(obj) is list:
        return {"l": [encode_layout(v, name_of) for v in obj]}
    if type(obj) is tuple:
        return {"t": [encode_layout(v, name_of) for v in obj]}
    raise TypeError(f"a {type(obj).__name__} value")


def decode_layout(j: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if not isinstance(j, dict) or len(j) != 1:
        raise ValueError(f"bad layout node {str(j)[:60]}")
    (tag, v), = j.items()
    if tag == "T":
        return tensors[v]
    if tag == "d":
        out = {}
        for k, c in v:
            if type(k) not in (str, int):
                raise ValueError(f"bad key {k!r}")
            out[k] = decode_layout(c, tensors)
        return out
    if tag == "l":
        return [decode_layout(c, tensors) for c in v]
    if tag == "t":
        return tuple(decode_layout(c, tensors) for c in v)
    raise ValueError(f"unknown layout tag {tag!r}")


def walk(obj: Any, path: Tuple = ()) -> Iterator[Tuple[Tuple, Any, str]]:
    """(path, value, kind) for every node: kind is "tensor", "dict", "list",
    "tuple" (containers, then their children) or "value"."""
    if isinstance(obj, torch.Tensor):
        yield path, obj, "tensor"
    elif isinstance(obj, dict):
        yield path, obj, "dict"
        for k, v in obj.items():
            yield from walk(v, path + (k,))
    elif type(obj) in (list, tuple) and holds_structure(obj):
        yield path, obj, type(obj).__name__
        for i, v in enumerate(obj):
            yield from walk(v, path + (i,))
    else:
        yield path, obj, "value"


def holds_structure(seq) -> bool:
    return any(isinstance(v, (torch.Tensor, dict)) or (type(v) in (list, tuple) and holds_structure(v))
               for v in seq)
