"""Filling a state that already exists from a checkpoint: ``fastckpt.load_into``.

The checkpoint is opened as a :class:`~fastckpt.sources.source.Source` (its
object tree with meta tensors, nothing read), both trees are walked and
matched by path, and every key, shape and dtype is checked before any byte is
read. Then every tensor is filled in place:

- a plain CPU tensor that is contiguous, from a tensor stored contiguously in
  the file: its bytes are read straight into its memory, all such tensors in
  one parallel batch of engine reads (O_DIRECT where the memory, the offset and
  the length are aligned); a storage read whole in one piece is checked
  against its CRC-32 (torch.save records);
- a DTensor: only the row-major runs of its local shard's box in the
  full-size tensor of the file (trailing whole dimensions coalesced), read
  straight into the local tensor, in the same batch;
- anything else (a non-contiguous target, a strided view in the file, a
  tensor on another device): through a bounded host buffer, a slab of at most
  about :data:`~fastckpt.sources.source.CHUNK` bytes at a time, copied in.

With a gloo group, the replicated tensors are read once in all and broadcast
(:class:`_Sharing`, agreed through :class:`fastckpt.collective.group.Group`).

Non-tensor leaves held by dicts and lists of the state are set from the file
after the tensors were read. A DCP directory goes to
``torch.distributed.checkpoint.load`` with :class:`fastckpt.dcp.FastReader`
(which reshards natively); its keys are checked against the metadata first.
"""

import errno
import os
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..errors import FormatError, StateMismatchError
from ..formats.torch_rules import is_dtensor
from .dcp import read_dcp_metadata
from .kinds import is_dcp_dir, open_source, sharded_index
from .safetensors import SafetensorsSource, ShardedSafetensorsSource
from .zip import ZipSource
from .source import CHUNK, Source, Storage, aligned_buffer, byte_span, is_dense, storage_of, walk

__all__ = ["LoadIntoResult", "load_into"]


class LoadIntoResult(NamedTuple):
    """What :func:`load_into` returns, as ``nn.Module.load_state_dict`` does: the
    keys of the state that the file lacks, and the keys of the file that the
    state lacks (both empty under ``strict=True``, which raises instead)."""
    missing_keys: List[str]
    unexpected_keys: List[str]


Path = Tuple[Any, ...]


def key_name(path: Path) -> str:
    """A path of a tree as a key: its parts joined by dots ("state.0.exp_avg")."""
    return ".".join(str(p) for p in path)


def _leaves(tree: Any) -> Tuple[Dict[Path, Any], Dict[Path, Any]]:
    """(leaves: path -> tensor or value, containers: path -> dict/list/tuple)."""
    leaves: Dict[Path, Any] = {}
    containers: Dict[Path, Any] = {}
    for path, v, kind in walk(tree):
        if kind in ("tensor", "value"):
            if path:
                leaves[path] = v
        else:
            containers[path] = v
    return leaves, containers


def _refused_placement(t: torch.Tensor) -> Optional[str]:
    from torch.distributed.tensor.placement_types import Partial, _StridedShard
    for p in t.placements:
        if isinstance(p, (_StridedShard, Partial)):
            return repr(p)
    return None


def _mismatch_error(path: str, missing: List[str], unexpected: List[str], mismatched: List[str]) -> StateMismatchError:
    lines = [f"fastckpt.load_into: error(s) in loading the state from {path} (nothing was changed):"]
    if missing:
        lines.append("Missing key(s) in the checkpoint: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        lines.append("Unexpected key(s) in the checkpoint: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    lines += mismatched
    return StateMismatchError("\n\t".join(lines), path, missing, unexpected, mismatched)


def _check(path: str, target: Dict[Path, Any], found: Dict[Path, Any], strict: bool, shape_of, dtype_of
           ) -> Tuple[List[str], List[str]]:
    """Missing and unexpected keys; raises StateMismatchError for what cannot be loaded."""
    missing = [key_name(p) for p in target if p not in found]
    unexpected = [key_name(p) for p in found if p not in target]
    mismatched = []
    for p, t in target.items():
        if p not in found:
            continue
        f, k = found[p], key_name(p)
        if isinstance(t, torch.Tensor) != (shape_of(f) is not None):
            mismatched.append(f"kind mismatch for {k}: the state holds a "
                              f"{'tensor' if isinstance(t, torch.Tensor) else type(t).__name__}, the checkpoint "
                              f"{'a tensor' if shape_of(f) is not None else 'a ' + type(f).__name__}.")
            continue
        if not isinstance(t, torch.Tensor):
            continue
        if tuple(t.shape) != tuple(shape_of(f)):
            mismatched.append(f"size mismatch for {k}: copying a tensor with shape {torch.Size(shape_of(f))} from "
                              f"the checkpoint, the shape in the state is {t.shape}.")
        elif t.dtype != dtype_of(f):
            mismatched.append(f"dtype mismatch for {k}: the checkpoint holds {dtype_of(f)}, the state {t.dtype}.")
        elif is_dtensor(t):
            refused = _refused_placement(t)
            if refused is not None:
                mismatched.append(f"placement of {k}: {refused} cannot be read from a full-size tensor "
                                  "(Shard and Replicate placements can).")
    if mismatched or (strict and (missing or unexpected)):
        raise _mismatch_error(path, missing if strict else [], unexpected if strict else [], mismatched)
    return missing, unexpected


def _set_values(target: Dict[Path, Any], found: Dict[Path, Any], containers: Dict[Path, Any]) -> None:
    """The non-tensor leaves of the state set from the file (where their container can be changed)."""
    for p, v in target.items():
        if isinstance(v, torch.Tensor) or p not in found:
            continue
        parent = containers.get(p[:-1])
        if isinstance(parent, (dict, list)):
            parent[p[-1]] = found[p]


# ---------------------------------------------------------------- planning the reads of one source

class _Plan:
    """The reads of one load_into: ranges read straight into the state's memory
    (``direct``: one engine batch) and tensors copied in through a bounded buffer."""

    def __init__(self, src: Source):
        self.src = src
        self.direct: List[Tuple[Storage, int, torch.Tensor, bool]] = []
        self.direct_keys: List[str] = []
        self.staged: List[Tuple[str, torch.Tensor, torch.Tensor]] = []  # (key, target, source meta view)
        self.seen: set = set()

    def add(self, key: str, target: torch.Tensor, meta: torch.Tensor) -> None:
        if target.numel() == 0:
            return
        if is_dtensor(target):
            self._add_shard(key, target, meta)
            return
        mark = (target.untyped_storage().data_ptr(), target.storage_offset(), tuple(target.stride()),
                id(storage_of(meta)), meta.storage_offset(), tuple(meta.stride()), tuple(meta.shape))
        if mark in self.seen:  # tied weights: one tensor under two keys, one storage in the file
            return
        self.seen.add(mark)
        self._add_box(key, target, meta, is_dense(meta))

    def _add_shard(self, key: str, dt: torch.Tensor, meta: torch.Tensor) -> None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        local = dt.to_local()
        shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        if tuple(local.shape) != tuple(shape):
            raise _mismatch_error(self.src.path, [], [], [
                f"local shard of {key}: shape {tuple(local.shape)}, its placements {tuple(dt.placements)} "
                f"give {tuple(shape)}."])
        if local.numel() == 0:
            return
        box = meta
        for d, (o, n) in enumerate(zip(offset, shape)):
            box = box.narrow(d, o, n)
        self._add_box(key, local, box, is_dense(meta))

    def _add_box(self, key: str, target: torch.Tensor, meta: torch.Tensor, dense: bool) -> None:
        """`meta` (a view of a source storage: a tensor of the file, or a box of one) into `target`
        (same shape and dtype). `dense`: the file's tensor is stored row-major, so that the box's
        runs (:func:`_runs`) are its rows, not single elements."""
        if not (target.device.type == "cpu" and target.is_contiguous() and not meta.is_conj()
                and not meta.is_neg() and dense):
            self.staged.append((key, target, meta))
            return
        runs = _runs(meta)
        storage = storage_of(meta)
        isz = meta.element_size()
        out = target.reshape(-1).view(torch.uint8) if target.dim() else target.view(1).view(torch.uint8)
        run_bytes = runs[1] * isz
        whole = len(runs[0]) == 1 and runs[0][0] == 0 and run_bytes == storage.nbytes
        crc = bool(whole and isinstance(self.src, ZipSource) and storage.crc)
        for i, start in enumerate(runs[0]):
            self.direct.append((storage, start * isz, out[i * run_bytes:(i + 1) * run_bytes], crc))
            self.direct_keys.append(key)

    def run(self) -> None:
        if self.direct:
            got = self.src.read_many(self.direct)
            for (storage, _, _, crc), c, key in zip(self.direct, got, self.direct_keys):
                if crc and c != storage.crc:
                    raise _crc_error(self.src, storage, key)
        if self.staged:
            buf = None
            for key, target, meta in self.staged:
                buf = _copy_staged(self.src, key, target, meta, buf)


def _runs(meta: torch.Tensor) -> Tuple[List[int], int]:
    """(first element of each run, elements per run): the row-major runs of contiguous
    elements of `meta` in its storage, trailing contiguous dimensions coalesced."""
    shape, stride = list(meta.shape), list(meta.stride())
    run, d = 1, len(shape) - 1
    while d >= 0 and (shape[d] == 1 or stride[d] == run):
        run *= shape[d]
        d -= 1
    starts = torch.tensor([meta.storage_offset()], dtype=torch.int64)
    for k in range(d + 1):  # the outer dimensions: every combination, row-major
        starts = (starts[:, None] + torch.arange(shape[k], dtype=torch.int64)[None, :] * stride[k]).reshape(-1)
    return starts.tolist(), run


def _crc_error(src: Source, storage: Storage, key: str) -> FormatError:
    return FormatError(f"{src.path}: checksum mismatch in record {storage.key!r} (corrupt data; tensor {key}): "
                       "the state's tensor now holds the damaged bytes")


def _copy_staged(src: Source, key: str, target: torch.Tensor, meta: torch.Tensor, buf: Optional[torch.Tensor]
                 ) -> torch.Tensor:
    """`meta`'s values copied into `target` a slab at a time through one host buffer
    (about CHUNK bytes, at least one slab along the dimension of largest stride)."""
    storage = storage_of(meta)
    if meta.dim() == 0:
        slabs = [(None, 0, 1)]
    else:
        d = max(range(meta.dim()), key=lambda i: (meta.shape[i] > 1, meta.stride()[i]))
        step = max(1, CHUNK // max(1, meta.stride()[d] * meta.element_size()))
        slabs = [(d, a, min(step, meta.shape[d] - a)) for a in range(0, meta.shape[d], step)]
    for d, a, k in slabs:
        sub = meta if d is None else meta.narrow(d, a, k)
        lo, n = byte_span(sub)
        if buf is None or buf.numel() < n:
            buf = aligned_buffer(max(n, min(CHUNK, 1 << 20)))
        piece = buf[:n]
        if lo == 0 and n == storage.nbytes and isinstance(src, ZipSource) and storage.crc:
            if src.read_crc(storage, lo, piece) != storage.crc:
                raise _crc_error(src, storage, key)
        else:
            src.read(storage, lo, piece)
        v = piece.view(meta.dtype)
        vals = v.as_strided(sub.shape, sub.stride(), v.storage_offset() + sub.storage_offset() - lo // v.element_size())
        if meta.is_conj():
            vals = vals.conj()
        if meta.is_neg():
            vals = vals._neg_view()
        dst = target if d is None else target.narrow(d, a, k)
        dst.copy_(vals)
    return buf


# ---------------------------------------------------------------- load_into

def _prepare(src: Source, state: Any, path: str, strict: bool):
    """Both trees' leaves, checked against each other (nothing read yet)."""
    problems = getattr(src, "problems", None) if isinstance(src, (SafetensorsSource, ShardedSafetensorsSource)) \
        else None
    if problems:
        raise FormatError(f"{problems[0]} (not a valid safetensors file)")
    if isinstance(src, ZipSource):
        src.check_small()
    found, _ = _leaves(src.tree(values=True))
    target, containers = _leaves(state)

    def shape_of(v):
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    missing, unexpected = _check(path, target, found, strict, shape_of, lambda v: v.dtype)
    return found, target, containers, missing, unexpected


class _Sharing:
    """The reads of replicated tensors shared over a group (gloo: host memory): each such
    tensor (a plain tensor, or a DTensor replicated on every mesh dimension, on the CPU) is
    read by one rank, the ranks balanced by bytes, and broadcast to the others. Every step
    is agreed through fastckpt.collective's Group: a rank's failure raises on every rank."""

    def __init__(self, group: Any, path: str):
        from ..collective.group import Group
        self.g = Group(group, path, action="load into", outcome="the state may hold some of the checkpoint's tensors")
        self.group = group
        self.owner: Dict[str, int] = {}
        self.items: List[Tuple[str, torch.Tensor]] = []

    @staticmethod
    def wanted(group: Any) -> bool:
        if group is None:
            return False
        import torch.distributed as dist
        return dist.get_world_size(group) > 1 and "gloo" in str(dist.get_backend(group)).lower()

    def agree(self, target: Dict[Path, Any], found: Dict[Path, Any], error: Optional[BaseException]) -> None:
        items = []
        if error is None:
            for p, t in target.items():
                if isinstance(t, torch.Tensor) and p in found and t.numel() and t.device.type == "cpu":
                    if not is_dtensor(t):
                        items.append((key_name(p), t.detach()))
                    elif all(pl.is_replicate() for pl in t.placements):
                        items.append((key_name(p), t.detach().to_local()))
        mine = [(k, tuple(t.shape), str(t.dtype)) for k, t in items]
        every = self.g.exchange(mine, error, "to check the state")
        if any(e != every[0] for e in every):
            raise StateMismatchError(f"fastckpt.load_into({self.g.path!r}, group=...): the ranks of the group hold "
                                     "different replicated tensors (keys, shapes or dtypes); every rank must hold "
                                     "the same ones to share their reads", self.g.path)
        load = [0] * self.g.world
        for k, t in sorted(items, key=lambda kt: (-kt[1].numel() * kt[1].element_size(), kt[0])):
            r = min(range(self.g.world), key=lambda i: (load[i], i))
            load[r] += t.numel() * t.element_size()
            self.owner[k] = r
        self.items = items

    def skip(self, key: str) -> bool:
        """This rank does not read `key`: another rank reads it and broadcasts it."""
        return key in self.owner and self.owner[key] != self.g.rank

    def finish(self, error: Optional[BaseException]) -> None:
        import torch.distributed as dist
        self.g.exchange(None, error, "to read its share")
        try:
            for k, t in self.items:
                src = dist.get_global_rank(self.group, self.owner[k])
                buf = t if t.is_contiguous() else t.contiguous()
                dist.broadcast(buf.reshape(-1).view(torch.uint8) if buf.dim() else buf.view(1).view(torch.uint8),
                               src, group=self.group)
                if buf is not t and self.owner[k] != self.g.rank:
                    t.copy_(buf)
        except Exception as e:
            raise self.g.lost(e, "the broadcast of the replicated tensors") from e


def _load_source(state: Any, path: str, strict: bool, group: Any) -> LoadIntoResult:
    sharing = _Sharing(group, path) if _Sharing.wanted(group) else None
    src: Optional[Source] = None
    try:
        error: Optional[BaseException] = None
        found = target = containers = {}
        missing: List[str] = []
        unexpected: List[str] = []
        try:
            if not os.path.exists(path):
                raise FileNotFoundError(errno.ENOENT, f"fastckpt.load_into: no checkpoint at {path}", path)
            src = open_source(path, verify=True)
            found, target, containers, missing, unexpected = _prepare(src, state, path, strict)
        except Exception as e:  # with a group: raised on every rank by the agreement
            if sharing is None:
                raise
            error = e
        if sharing is not None:
            sharing.agree(target, found, error)
        plan = _Plan(src)
        for p, t in target.items():
            if isinstance(t, torch.Tensor) and p in found and not (sharing and sharing.skip(key_name(p))):
                f = found[p]
                plan.add(key_name(p), t.detach(), f if f.device.type == "meta" else f.detach())
        try:
            with torch.no_grad():
                plan.run()
        except Exception as e:
            if sharing is None:
                raise
            error = e
        if sharing is not None:
            with torch.no_grad():
                sharing.finish(error)
        _set_values(target, found, containers)
    finally:
        if src is not None:
            src.close()
    return LoadIntoResult(missing, unexpected)


def _load_dcp(state: Any, path: str, group: Any, strict: bool) -> LoadIntoResult:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from ..dcp import FastReader
    md = read_dcp_metadata(path)
    flat, _ = flatten_state_dict(state)
    target = {(k,): v for k, v in flat.items()}
    found = {(k,): m for k, m in md.state_dict_metadata.items()}

    def shape_of(m):
        return tuple(m.size) if isinstance(m, TensorStorageMetadata) else None

    missing, unexpected = _check(path, target, found, strict, shape_of, lambda m: m.properties.dtype)
    dcp.load(state, storage_reader=FastReader(path), planner=DefaultLoadPlanner(allow_partial_load=not strict),
             process_group=group)
    return LoadIntoResult(missing, unexpected)


def load_into(state: Any, path: str, group: Any = None, strict: bool = True) -> LoadIntoResult:
    """The implementation of :func:`fastckpt.load_into` (its arguments checked there)."""
    if os.path.isdir(path) and sharded_index(path) is None and is_dcp_dir(path):
        return _load_dcp(state, path, group, strict)
    return _load_source(state, path, strict, group)

