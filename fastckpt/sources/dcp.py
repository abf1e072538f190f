"""The source of a torch.distributed.checkpoint directory: :class:`DcpSource`."""

import io
import logging
import os
import pickle
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..formats.torch_rules import itemsize
from ..errors import FormatError
from .source import LazyValue, Source, Storage, is_dense, meta_tensor, storage_of

log = logging.getLogger("fastckpt")


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
