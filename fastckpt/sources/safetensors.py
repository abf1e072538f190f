"""The sources of safetensors checkpoints: one file (:class:`SafetensorsSource`) and a sharded
set with its index (:class:`ShardedSafetensorsSource`)."""

import json
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._core import engine as _engine
from ..errors import FormatError
from ..formats import safetensors as _st
from ..formats.safetensors import LAYOUT_KEY
from .source import FileSource, Source, Storage, decode_layout, meta_tensor

log = logging.getLogger("fastckpt")


StEntry = _st.Entry


class SafetensorsSource(FileSource):
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
