"""Checkpoints opened without loading them: what ``fastckpt inspect``, ``verify`` and ``convert``
read, and what :func:`fastckpt.load_into` reads into the state it fills.

A :class:`Source` gives a checkpoint's object tree with *meta* tensors as
leaves (dtype, shape, stride and storage offset, no data; each knows its
:class:`Storage` through :func:`storage_of`), and reads any byte range of a
storage on demand, so that a caller holds at most the piece it is working on:

- :class:`ZipSource`: fastckpt and stock ``torch.save`` archives. The zip
  directory is parsed by :mod:`fastckpt.formats.zip`; ``data.pkl`` is unpickled by
  torch's own weights-only unpickler with ``map_location="meta"`` (no code from
  the file runs and no storage is read); storages are read through the engine.
- :class:`SafetensorsSource`: the JSON header is parsed and checked; tensor
  bytes are read through the engine.
- :class:`ShardedSafetensorsSource`: a sharded safetensors set (its index
  ``model.safetensors.index.json`` and the shards it names), one
  :class:`SafetensorsSource` per shard.
- :class:`DcpSource`: a ``torch.distributed.checkpoint`` directory. ``.metadata``
  is unpickled by fastckpt's one restricted, size-guarded unpickler
  (:mod:`fastckpt.formats.unpickler`, through ``fastckpt.dcp.reader.load_metadata``),
  which knows only DCP's metadata classes; tensors are read one at a time with :class:`fastckpt.dcp.FastReader`
  (which checks CRC-32s), non-tensor values with ``torch.load(weights_only=True)``.
- :class:`LoadedSource`: anything else ``fastckpt.load`` reads (torch's legacy
  format, big-endian archives): loaded whole, with ``weights_only=True``.

Nothing here prints; errors are :class:`fastckpt.FormatError` (a damaged or
foreign file), ``OSError``, or ``pickle.UnpicklingError`` (the weights-only
unpickler refused a class).
"""

import io
import json
import logging
import os
import pickle
import struct
import sys
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.serialization as ts

from .._core import engine as _engine
from ..formats import unpickler as _unpickle, zip as _zip
from ..formats.torch_rules import itemsize
from ..torchsave.load import load_path
from ..torchsave.reader import Reader, Records, parse_checkpoint
from ..errors import FormatError
from ..formats import safetensors as _st
from ..formats.safetensors import LAYOUT_KEY
from .source import CHUNK, STORAGE_ATTR, LazyValue, Source, Storage, aligned_buffer, decode_layout, is_dense, meta_tensor, storage_of

log = logging.getLogger("fastckpt")

# ---------------------------------------------------------------- zip archives

class _MetaUnpickler(ts._weights_only_unpickler.Unpickler):
    """torch's weights-only unpickler; every storage it makes is tagged with its
    persistent id (torch._load assigns persistent_load after construction)."""

    on_storage: Callable = None  # type: ignore[assignment]

    @property
    def persistent_load(self):  # type: ignore[override]
        return self._pl

    @persistent_load.setter
    def persistent_load(self, f):
        def wrapped(pid):
            typed = f(pid)
            type(self).on_storage(pid, typed._untyped_storage)
            return typed
        self._pl = wrapped


class _FileSource(Source):
    """A Source over one file kept open: `_parse()` reads its directory, and
    the file is closed again if that fails."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.f = open(path, "rb")
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


class ZipSource(_FileSource):
    """A fastckpt or torch.save zip archive. With `verify` (default), every storage
    read whole is checked against its CRC-32 as it is read."""

    def __init__(self, path: str, verify: bool = True):
        self.verify = verify
        super().__init__(path)

    def _parse(self) -> None:
        path, fd = self.path, self.f.fileno()
        self.archive = parse_checkpoint(path, self.f)
        recs = self.archive.records
        # the record reader of fastckpt.load: reads go to this open file, CRC-32s come with them
        self.records = Records(path, self.archive, fd, verify=False)
        small_names = [n for n in recs if not n.startswith("data/")]
        # metadata records are small: always checked; callers decide what a mismatch means
        self.bad_small: List[str] = []
        self.small = self.records.read(small_names, [], bad_small=self.bad_small)
        order = self.small.get("byteorder", b"little")
        if order not in (b"little", b"big"):
            raise FormatError(f"{path}: unknown byte order {order!r} in record 'byteorder'")
        self.byteorder = order.decode()
        try:
            self.alignment = int(self.small.get(".storage_alignment", b"64"))
        except ValueError:
            raise FormatError(f"{path}: record '.storage_alignment' holds {self.small['.storage_alignment']!r}") \
                from None
        self.storages: Dict[str, Storage] = {
            n: Storage(n, e.size, torch.uint8, crc=e.crc) for n, e in recs.items() if n.startswith("data/")}
        self.kind = "fastckpt" if _zip.is_fastckpt_layout(recs, self.alignment) else "torch"
        # storage records of at least DIRECT_MIN bytes start on this (fastckpt files)
        self.large_alignment = _zip.large_alignment(self.alignment) if self.kind == "fastckpt" else self.alignment
        self._tree = None
        self._used: Dict[str, Storage] = {}

    def description(self) -> str:
        n = len(self.storages)
        if self.kind != "fastckpt":
            what = f"torch.save checkpoint (zip archive, records aligned to {self.alignment} bytes)"
        elif self.large_alignment == self.alignment:
            what = f"fastckpt checkpoint (torch.save zip archive, records aligned to {self.alignment} bytes)"
        else:
            what = (f"fastckpt checkpoint (torch.save zip archive, storage records of {_zip.DIRECT_MIN >> 10} KiB "
                    f"or more aligned to {self.large_alignment} bytes, the others to {self.alignment})")
        return f"{what}, {n} storage record{'s' if n != 1 else ''}"

    def check_small(self) -> None:
        if self.bad_small:
            raise FormatError(f"{self.path}: checksum mismatch in record {self.bad_small[0]!r} (corrupt data)")

    def tree(self, values: bool = True) -> Any:
        if self._tree is not None:
            return self._tree
        self.check_small()
        if self.byteorder != sys.byteorder:
            raise FormatError(f"{self.path}: {self.byteorder}-endian data; this command reads native "
                              f"({sys.byteorder}-endian) archives piece by piece")
        path, recs = self.path, self.archive.records
        reader = Reader(self.archive, self.small, {})

        def on_storage(pid, untyped) -> None:
            _, stype, key, location, numel = pid
            if not isinstance(key, str) or not isinstance(numel, int) or not isinstance(location, str):
                raise FormatError(f"{path}: data.pkl is damaged: storage id {pid!r}")
            name = f"data/{key}"
            rec = recs.get(name)
            if rec is None:
                raise FormatError(f"{path}: data.pkl refers to record {name!r}, which is missing")
            untyped_type = stype is torch.UntypedStorage
            dtype = torch.uint8 if untyped_type else stype.dtype
            nbytes = numel * itemsize(dtype)
            if nbytes != rec.size:
                raise FormatError(f"{path}: record {name!r} holds {rec.size} bytes, data.pkl expects {nbytes}")
            s = self.storages[name]
            if name not in self._used:
                s.dtype, s.untyped, s.location = dtype, untyped_type, location
                self._used[name] = s
            setattr(untyped, STORAGE_ATTR, s)

        # the size and nesting guards of fastckpt's walk first: torch's unpickler would hash a
        # deeply nested key (a C stack overflow) or grow its stack and memo as the file says
        _unpickle.check(self.small.get("data.pkl", b""), f"{path}: data.pkl")
        unpickler = type("_Unpickler", (_MetaUnpickler,), {"on_storage": staticmethod(on_storage)})
        module = types.SimpleNamespace(Unpickler=unpickler)
        try:
            self._tree = ts._load(reader, "meta", module, encoding="utf-8")
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(
                f"{path}: the weights-only unpickler refused data.pkl ({e}). Nothing from the file was run; "
                "this command only reads checkpoints that load with weights_only=True") from None
        except (FormatError, OSError):
            raise
        except Exception as e:
            raise FormatError(f"{path}: data.pkl is damaged and cannot be unpickled ({type(e).__name__}: {e})") \
                from None
        return self._tree

    def crc_error(self, storage: Storage) -> FormatError:
        return FormatError(f"{self.path}: checksum mismatch in record {storage.key!r} (corrupt data)")

    def _checked(self, storage: Storage, start: int, length: int) -> bool:
        return bool(self.verify and storage.crc and start == 0 and length == storage.nbytes)

    def stream(self, storage, start, length, consume, on_read=None, on_crc=None) -> None:
        if on_crc is not None or not self._checked(storage, start, length):
            return super().stream(storage, start, length, consume, on_read, on_crc)
        crc = 0

        def fold(piece_crc: int, n: int) -> None:  # the pieces' CRC-32s, computed by the engine's reads
            nonlocal crc
            crc = _engine.crc32_combine(crc, piece_crc, n)
        super().stream(storage, start, length, consume, on_read, fold)
        if crc != storage.crc:
            raise self.crc_error(storage)

    def read_span(self, storage: Storage, start: int, length: int) -> torch.Tensor:
        if not self._checked(storage, start, length):
            return super().read_span(storage, start, length)
        buf = aligned_buffer(length)
        if self.read_crc(storage, start, buf) != storage.crc:
            raise self.crc_error(storage)
        return buf

    def read(self, storage: Storage, offset: int, out: torch.Tensor) -> None:
        self._read(storage, offset, out, False)

    def read_crc(self, storage: Storage, offset: int, out: torch.Tensor) -> int:
        return self._read(storage, offset, out, True)

    def _read(self, storage: Storage, offset: int, out: torch.Tensor, crc: bool) -> Optional[int]:
        return self.records.read_into([(storage.key, offset, out, crc)])[0]

    def read_many(self, items: List[Tuple[Storage, int, torch.Tensor, bool]]) -> List[Optional[int]]:
        return self.records.read_into([(s.key, off, out, crc) for s, off, out, crc in items])

    def check_crcs(self, storages: List[Storage], progress: Optional[Callable[[int], None]] = None
                   ) -> Iterator[Tuple[Storage, Optional[BaseException]]]:
        """Check storages read whole against their CRC-32s, in order: yields
        (storage, None) for a match, (storage, error) for a mismatch
        (FormatError) or a read that failed (OSError, FormatError). Small
        records are read many at a time (up to CHUNK bytes per engine call),
        large ones streamed; the engine computes the CRC-32s during the reads.
        Memory stays at a few CHUNKs. ``progress(nbytes)`` as bytes are checked."""
        batch: List[Storage] = []
        size = 0
        for s in storages:
            if s.nbytes > CHUNK // 8:
                if batch:
                    yield from self._check_batch(batch, progress)
                    batch, size = [], 0
                yield from self._check_one(s, progress)
                continue
            if batch and size + s.nbytes > CHUNK:
                yield from self._check_batch(batch, progress)
                batch, size = [], 0
            batch.append(s)
            size += s.nbytes
        if batch:
            yield from self._check_batch(batch, progress)

    def _check_batch(self, batch: List[Storage], progress) -> Iterator[Tuple[Storage, Optional[BaseException]]]:
        buf = aligned_buffer(sum(s.nbytes for s in batch))
        items, at = [], 0
        for s in batch:
            items.append((s.key, 0, buf[at:at + s.nbytes], True))
            at += s.nbytes
        try:
            crcs = self.records.read_into(items)
        except (OSError, FormatError):  # one by one, to say which record cannot be read
            for s in batch:
                yield from self._check_one(s, progress)
            return
        for s, crc in zip(batch, crcs):
            if progress:
                progress(s.nbytes)
            yield s, (None if crc == s.crc else self.crc_error(s))

    def _check_one(self, s: Storage, progress) -> Iterator[Tuple[Storage, Optional[BaseException]]]:
        crc = 0

        def fold(piece_crc: int, n: int) -> None:
            nonlocal crc
            crc = _engine.crc32_combine(crc, piece_crc, n)
        try:
            self.stream(s, 0, s.nbytes, lambda piece: progress(piece.numel()) if progress else None, on_crc=fold)
        except (OSError, FormatError) as e:
            yield s, e
            return
        yield s, (None if crc == s.crc else self.crc_error(s))


# ---------------------------------------------------------------- safetensors

StEntry = _st.Entry


class SafetensorsSource(_FileSource):
    """A safetensors file: 8-byte little-endian header length, JSON header, tensor bytes."""

    kind = "safetensors"

    def _parse(self) -> None:
        path = self.path
        size = os.fstat(self.f.fileno()).st_size
        self.file_size = size
        fd = self.f.fileno()
        n, self.metadata, self.entries, self.problems = _st.read_header(lambda k, o: os.pread(fd, k, o), size, path)
        self.header_size = n
        self.data_start = 8 + n
        self.storages = {e.name: Storage(e.name, e.end - e.begin, e.dtype, location=None) for e in self.entries}

    def description(self) -> str:
        return f"safetensors file ({len(self.entries)} tensors, {self.header_size}-byte header)"

    def tree(self, values: bool = True) -> Any:
        tensors = {e.name: meta_tensor(self.storages[e.name], e.dtype, e.shape) for e in self.entries}
        layout = self.metadata.get(LAYOUT_KEY)
        if layout is not None:
            try:
                return decode_layout(json.loads(layout), tensors)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("%s: ignoring the %s metadata (%s); the tensors are returned under their flat names",
                            self.path, LAYOUT_KEY, e)
        return tensors

    def read(self, storage: Storage, offset: int, out: torch.Tensor) -> None:
        n = out.numel()
        if n == 0:
            return
        if offset < 0 or offset + n > storage.nbytes:
            raise ValueError(f"read of bytes {offset}..{offset + n} of {storage.key} ({storage.nbytes} bytes)")
        e = self._by_name()[storage.key]
        _engine.read_ranges(self.path, [(out, self.data_start + e.begin + offset)], self.f.fileno())

    def read_many(self, items: List[Tuple[Storage, int, torch.Tensor, bool]]) -> List[Optional[int]]:
        index = self._by_name()
        ranges, at = [], []
        for i, (storage, offset, out, crc) in enumerate(items):
            n = out.numel()
            if offset < 0 or offset + n > storage.nbytes:
                raise ValueError(f"read of bytes {offset}..{offset + n} of {storage.key} ({storage.nbytes} bytes)")
            if n:
                ranges.append((out, self.data_start + index[storage.key].begin + offset, crc))
                at.append(i)
        got: List[Optional[int]] = [0 if crc else None for *_, crc in items]
        if ranges:
            crcs = _engine.read_ranges(self.path, ranges, self.f.fileno()).get("crcs") or []
            for i, c in zip(at, crcs):
                if items[i][3]:
                    got[i] = c
        return got

    def _by_name(self) -> Dict[str, StEntry]:
        m = getattr(self, "_index", None)
        if m is None:
            m = self._index = {e.name: e for e in self.entries}
        return m


class ShardedSafetensorsSource(Source):
    """A sharded safetensors set (Hugging Face's ``model-0000i-of-0000N.safetensors``
    files and the index ``model.safetensors.index.json`` that maps each tensor
    name to its shard): one flat tree of every shard's tensors in the index's
    order, each read from its own shard. The index is checked as
    ``fastckpt.safetensors.load_sharded`` checks it (a tensor held by a shard
    the index does not map it to, or named by the index and held by none, is a
    FormatError naming the file)."""

    kind = "safetensors-sharded"

    def __init__(self, index_path: str, path: Optional[str] = None):
        super().__init__()
        self.path = path or index_path
        self.index_path = index_path
        directory = os.path.dirname(index_path)
        with open(index_path, "rb") as f:
            raw = f.read(_st.MAX_HEADER + 1)
        self.weight_map = _st.parse_index(raw, index_path)
        self.shards: Dict[str, SafetensorsSource] = {}
        try:
            for name in sorted(set(self.weight_map.values())):
                self.shards[name] = SafetensorsSource(os.path.join(directory, name))
            self._check()
        except BaseException:
            self.close()
            raise

    def _check(self) -> None:
        self._shard_of: Dict[str, SafetensorsSource] = {}
        self.problems: List[str] = []
        for name, shard in self.shards.items():
            self.problems += shard.problems
            for e in shard.entries:
                if self.weight_map.get(e.name) != name:
                    raise FormatError(f"{shard.path}: holds tensor {e.name!r}, which {self.index_path} maps to "
                                      f"{self.weight_map.get(e.name)!r}")
                self._shard_of[e.name] = shard
        missing = [n for n in self.weight_map if n not in self._shard_of]
        if missing:
            raise FormatError(f"{self.index_path}: names {missing[:5]} (of {len(missing)}) are in no shard")
        self.storages = {n: self._shard_of[n].storages[n] for n in self.weight_map}

    def description(self) -> str:
        return (f"sharded safetensors checkpoint ({len(self.weight_map)} tensors in {len(self.shards)} "
                f"file{'s' if len(self.shards) != 1 else ''}, index {os.path.basename(self.index_path)})")

    def tree(self, values: bool = True) -> Any:
        out = {}
        for n in self.weight_map:
            e = self._shard_of[n]._by_name()[n]
            out[n] = meta_tensor(self.storages[n], e.dtype, e.shape)
        return out

    def shard_of(self, storage: Storage) -> SafetensorsSource:
        return self._shard_of[storage.key]

    def read_many(self, items: List[Tuple[Storage, int, torch.Tensor, bool]]) -> List[Optional[int]]:
        got: List[Optional[int]] = [None] * len(items)
        by_shard: Dict[int, List[int]] = {}
        for i, (storage, *_rest) in enumerate(items):
            by_shard.setdefault(id(self.shard_of(storage)), []).append(i)
        for idx in by_shard.values():  # one engine batch per shard file
            for i, c in zip(idx, self.shard_of(items[idx[0]][0]).read_many([items[i] for i in idx])):
                got[i] = c
        return got

    def read(self, storage: Storage, offset: int, out: torch.Tensor) -> None:
        self.shard_of(storage).read(storage, offset, out)

    def close(self) -> None:
        super().close()
        for shard in getattr(self, "shards", {}).values():
            shard.close()


# ---------------------------------------------------------------- DCP directories

def read_dcp_metadata(directory: str):
    """The Metadata of a DCP checkpoint, unpickled without running code from it."""
    from ..dcp.reader import load_metadata
    p = os.path.join(directory, ".metadata")
    md = load_metadata(p, directory)
    for index, info in md.storage_data.items():
        fqn = getattr(index, "fqn", None)
        rel, off, ln = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(fqn, str):
            raise FormatError(f"{p}: corrupt checkpoint metadata (storage entry {index!r})")
        if not (isinstance(rel, str) and type(off) is int and type(ln) is int and off >= 0 and ln >= 0):
            raise FormatError(f"{p}: corrupt storage entry for {fqn}: file {rel!r}, offset {off!r}, length {ln!r}")
    if not isinstance(getattr(md, "planner_data", None), (dict, type(None))):
        md.planner_data = None
    return md


class _Into:
    """The LoadPlanner methods FastReader.read_data calls: tensors land in `target`."""

    def __init__(self, target: Optional[torch.Tensor] = None):
        self.target = target
        self.value: Optional[bytes] = None

    def resolve_tensor(self, req):
        t = self.target
        for d, (o, n) in enumerate(zip(req.dest_offsets, req.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, req, tensor) -> None:
        pass

    def load_bytes(self, req, value) -> None:
        self.value = value.read()


class DcpSource(Source):
    """A torch.distributed.checkpoint directory."""

    kind = "dcp"

    def __init__(self, path: str, verify: bool = True):
        super().__init__()
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
        self.path = path
        self.md = read_dcp_metadata(path)
        self.items: Dict[str, Any] = {}
        for fqn, m in self.md.state_dict_metadata.items():
            if not isinstance(fqn, str) or not isinstance(m, (TensorStorageMetadata, BytesStorageMetadata)):
                raise FormatError(f"{path}/.metadata: corrupt entry {fqn!r}")
            self.items[fqn] = m
        self.by_fqn: Dict[str, List[Tuple[Any, Any]]] = {}
        for index, info in self.md.storage_data.items():
            self.by_fqn.setdefault(getattr(index, "fqn", None), []).append((index, info))
        self.verify = verify
        self._cache: Tuple[Optional[str], Optional[torch.Tensor]] = (None, None)
        self._reader = None

    def description(self) -> str:
        files = {getattr(i, "relative_path", None) for i in self.md.storage_data.values()}
        return (f"DCP checkpoint (torch.distributed.checkpoint directory, {len(self.items)} items "
                f"in {len(files)} data file{'s' if len(files) != 1 else ''})")

    def data_files(self) -> Dict[str, List[str]]:
        """relative path -> the fqns stored in it."""
        out: Dict[str, List[str]] = {}
        for index, info in self.md.storage_data.items():
            out.setdefault(getattr(info, "relative_path", None), []).append(getattr(index, "fqn", "?"))
        return out

    def is_tensor(self, fqn: str) -> bool:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        return isinstance(self.items[fqn], TensorStorageMetadata)

    def tree(self, values: bool = True) -> Any:
        from torch.distributed.checkpoint._traverse import set_element
        flat: Dict[str, Any] = {}
        for fqn, m in self.items.items():
            if self.is_tensor(fqn):
                dtype = m.properties.dtype
                shape = tuple(m.size)
                numel = 1
                for s in shape:
                    numel *= s
                flat[fqn] = meta_tensor(Storage(fqn, numel * itemsize(dtype), dtype), dtype, shape)
            else:
                infos = self.by_fqn.get(fqn) or [(None, None)]
                flat[fqn] = self.load_value(fqn) if values else LazyValue(fqn, getattr(infos[0][1], "length", None))
        mapping = self.md.planner_data
        if not (isinstance(mapping, dict) and all(isinstance(mapping.get(k), tuple) and mapping[k] for k in flat)):
            return flat
        root: Dict[str, Any] = {}
        try:
            for fqn, v in flat.items():
                set_element(root, mapping[fqn], v)
        except Exception as e:
            log.warning("%s: the nesting recorded in .metadata does not apply (%s); using flat names", self.path, e)
            return flat
        return root

    def fast_reader(self):
        if self._reader is None:
            from ..dcp import FastReader
            r = FastReader(self.path, verify=self.verify, thread_count=1)
            r.set_up_storage_reader(self.md, True)
            self._reader = r
        return self._reader

    def _read_items(self, fqn: str, planner: _Into, items) -> None:
        from torch.distributed.checkpoint.planner import LoadPlan
        self.fast_reader().read_data(LoadPlan(items), planner).wait()

    def load_tensor(self, fqn: str) -> torch.Tensor:
        """The whole tensor `fqn`, assembled from its chunks (CRC-checked where whole records are read)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
        m = self.items[fqn]
        target = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        if target.numel() == 0:
            return target
        covered = 0
        for c in m.chunks:
            n = 1
            for s in c.sizes:
                n *= s
            covered += n
        if covered < target.numel():
            raise FormatError(f"{self.path}: {fqn}: the chunks in .metadata cover {covered} of its "
                              f"{target.numel()} elements")
        full = ChunkStorageMetadata(offsets=torch.Size([0] * target.dim()), sizes=torch.Size(target.shape))
        items = create_read_items_for_chunk_list(fqn, m, [full])
        for it in items:
            if it.storage_index not in self.md.storage_data:
                raise FormatError(f"{self.path}: .metadata has no storage entry for {fqn} "
                                  f"(chunk at {tuple(it.storage_index.offset or ())})")
        self._read_items(fqn, _Into(target), items)
        return target

    def load_value_bytes(self, fqn: str) -> bytes:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio
        index = MetadataIndex(fqn)
        if index not in self.md.storage_data:
            raise FormatError(f"{self.path}: .metadata has no storage entry for value {fqn}")
        planner = _Into()
        self._read_items(fqn, planner, [_create_read_item_for_byteio(index, 0, index, 0, 0)])
        return planner.value or b""

    def load_value(self, fqn: str) -> Any:
        data = self.load_value_bytes(fqn)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(
                f"{self.path}: value {fqn}: the weights-only unpickler refused it ({e}). Nothing from the "
                "checkpoint was run; this command only reads values that load with weights_only=True") from None
        except Exception as e:
            raise FormatError(f"{self.path}: value {fqn} cannot be loaded ({type(e).__name__}: {e})") from None

    def _whole(self, fqn: str) -> torch.Tensor:
        """Tensor `fqn`, flattened; the last one read is kept (reads come in storage order)."""
        key, t = self._cache
        if key != fqn:
            self._cache = (None, None)  # drop the previous tensor before reading the next
            t = self.load_tensor(fqn).reshape(-1)
            self._cache = (fqn, t)
        return t

    def read(self, storage: Storage, offset: int, out: torch.Tensor) -> None:
        t = self._whole(storage.key)
        out.copy_(t.view(torch.uint8)[offset:offset + out.numel()] if t.numel() else t.view(torch.uint8))

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        whole = self._whole(storage_of(t).key)
        if t.numel() == whole.numel() and t.storage_offset() == 0 and is_dense(t):
            return whole.view(t.shape)
        return whole.as_strided(t.shape, t.stride(), t.storage_offset()).contiguous()

    def close(self) -> None:
        super().close()
        self._cache = (None, None)


# ---------------------------------------------------------------- anything else torch can load

class LoadedSource(Source):
    """A checkpoint loaded whole as ``fastckpt.load(weights_only=True)`` loads it (not streamed)."""

    streamed = False

    def __init__(self, path: str, kind: str, why: str):
        super().__init__()
        self.path = path
        self.kind = kind
        self.why = why
        self.obj = load_path(path, "cpu", True, pickle, None, {})

    def description(self) -> str:
        return {"torch-legacy": "torch checkpoint in the legacy (pre-1.6, non-zip) format"}.get(self.kind, self.kind)

    def tree(self, values: bool = True) -> Any:
        return self.obj


# ---------------------------------------------------------------- opening

def sniff(path: str) -> str:
    """The format of file `path`: fastckpt-or-torch ("zip"), "torch-legacy", "safetensors" or "unknown"."""
    with open(path, "rb") as f:
        head = f.read(32)
        size = os.fstat(f.fileno()).st_size
    if head[:4] == b"PK\x03\x04":
        return "zip"
    from ..formats.pickle_scan import is_legacy
    if is_legacy(head):
        return "torch-legacy"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= _st.MAX_HEADER and 8 + n <= size and head[8:9] == b"{":
            return "safetensors"
    return "unknown"


def is_dcp_dir(path: str) -> bool:
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, ".metadata"))
                                    or any(n.endswith(".distcp") for n in os.listdir(path)))


SHARDED_INDEX = _st.index_name("model.safetensors")  # the index a sharded set's directory holds


def sharded_index(path: str) -> Optional[str]:
    """The index file of the sharded safetensors set at `path` (its directory, holding
    ``model.safetensors.index.json``, or an ``*.safetensors.index.json`` file itself), else None."""
    if os.path.isdir(path):
        p = os.path.join(path, SHARDED_INDEX)
        return p if os.path.isfile(p) else None
    return path if path.endswith(".safetensors" + _st.INDEX_SUFFIX) and os.path.isfile(path) else None


def open_source(path: str, verify: bool = True) -> Source:
    """Open a checkpoint file, a sharded safetensors set (its directory or its
    index file) or a DCP directory. `verify`: check CRC-32s of what is read
    whole (zip records, DCP records). Raises FileNotFoundError, FormatError
    (damaged or not a checkpoint), OSError."""
    index = sharded_index(path)
    if index is not None:
        return ShardedSafetensorsSource(index, path)
    if os.path.isdir(path):
        single = os.path.join(path, "model.safetensors")  # a set of one shard has no index
        if not is_dcp_dir(path) and os.path.isfile(single):
            return SafetensorsSource(single)
        return DcpSource(path, verify=verify)
    kind = sniff(path)
    if kind == "zip":
        src = ZipSource(path, verify=verify)
        if src.byteorder != sys.byteorder:
            src.close()
            return LoadedSource(path, "torch", f"{src.byteorder}-endian data")
        return src
    if kind == "safetensors":
        return SafetensorsSource(path)
    if kind == "torch-legacy":
        return LoadedSource(path, kind, "legacy format")
    raise FormatError(f"{path}: not a checkpoint fastckpt knows (not a torch.save zip archive, torch's legacy "
                      "format, safetensors, or a DCP directory)")
