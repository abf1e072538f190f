"""``fastckpt convert``: between fastckpt/torch.save files, safetensors files and DCP directories.

Every conversion streams: the source is opened as a :class:`fastckpt.sources.Source`
(an object tree of meta tensors plus reads of byte ranges), and the target is
written piece by piece through the engine (temporary name, fdatasync, rename,
directory fsync), so memory stays bounded whatever the checkpoint's size:

==================================  ============================================================
direction                           memory held at once
==================================  ============================================================
file/safetensors -> file            two CHUNK (8 MiB) buffers
file/safetensors -> safetensors     two CHUNK buffers (a non-contiguous view: its storage span)
file/safetensors -> DCP             about two tensors (FastWriter copies one ahead)
DCP -> anything                     one tensor (plus one more for DCP -> DCP)
DCP -> file under torchrun          one tensor per rank (fastckpt.cli.convert_ranks)
torch legacy / big-endian -> any    the whole checkpoint (loaded with fastckpt.load)
==================================  ============================================================

plus the engine's staging buffers (``buffer_size x buffer_count``).
"""

import collections
import contextlib
import json
import logging
import os
import pickle
import shutil
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._core.atomic import AtomicFile
from .. import knobs
from ..formats import zip as _zip
from ..formats import safetensors as _st
from ..formats.safetensors import LAYOUT_KEY, SEPARATOR, dtype_name
from ..sources.source import LazyValue, Source, Storage, byte_span, encode_layout, is_dense, storage_of, walk
from ..formats.pickler import DEFAULT_PROTOCOL, pickle_with_storages, tensor_reduce
from ..formats.torch_rules import StorageRef, storage_ref

log = logging.getLogger("fastckpt")

TARGETS = ("fastckpt", "torch", "safetensors", "dcp")

Progress = Optional[Callable[[int], None]]


class ConvertError(ValueError):
    """The source cannot be written in the target format (what and why in the message)."""


def key_str(path: Tuple) -> str:
    return SEPARATOR.join(str(k) for k in path) if path else "<root>"


@contextlib.contextmanager
def engine_for_streaming():
    """Knobs under which reads and a Writer can share the engine: a Writer keeps
    up to queue_depth staging buffers until it commits, so at least one more must
    exist for the reads that feed it (else a read waits for a buffer forever)."""
    cfg = knobs.config()
    over: Dict[str, int] = {}
    count = max(cfg.buffer_count, 2)
    if count != cfg.buffer_count:
        over["buffer_count"] = count
    if cfg.queue_depth > count - 1:
        over["queue_depth"] = count - 1
    if over:
        log.debug("fastckpt convert: engine knobs %s (reads and writes share the staging buffers)", over)
    with knobs.override(**over):
        yield


# ---------------------------------------------------------------- fastckpt / torch.save files

class _Streamed:
    """A storage of the new archive, streamed from the source by write_archive."""

    def __init__(self, source: Source, storage: Storage, progress: Progress):
        self.source = source
        self.storage = storage
        self.progress = progress

    def nbytes(self) -> int:
        return self.storage.nbytes

    def write_into(self, sink) -> int:
        crc = 0

        def consume(piece: torch.Tensor) -> None:
            nonlocal crc
            crc = sink.write_crc(piece, crc)
            if self.progress:
                self.progress(piece.numel())
        self.source.stream(self.storage, 0, self.storage.nbytes, consume)
        return crc


def pickle_tree(tree: Any, source: Source, progress: Progress = None) -> Tuple[bytes, List[_Streamed]]:
    """data.pkl for `tree` exactly as torch.save writes it (protocol 2, storages as
    persistent ids numbered in order of first use, views and shared storages kept),
    and the storages to stream, in key order."""
    keys: Dict[int, StorageRef] = {}
    order: List[_Streamed] = []

    def pstorage(t: torch.Tensor) -> Tuple[StorageRef, bool]:
        s = storage_of(t)
        p = keys.get(id(s))
        untyped = p.pid[1] is torch.UntypedStorage if p is not None else False
        if p is None:
            p, untyped = storage_ref(s.dtype, s.nbytes, s.location or "cpu", str(len(order)), untyped=s.untyped)
            keys[id(s)] = p
            order.append(_Streamed(source, s, progress))
        if not untyped and t.dtype != s.dtype:
            raise ConvertError(f"a storage is viewed as both {dtype_name(s.dtype)} and {dtype_name(t.dtype)}, "
                               "which torch.save cannot write")
        return p, untyped

    def reduce(obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if isinstance(obj, torch.nn.Parameter):
            return (torch._utils._rebuild_parameter,
                    (obj.detach(), obj.requires_grad, collections.OrderedDict()))
        if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
            raise ConvertError(f"a {obj.layout} tensor: only dense (strided) tensors can be converted")
        p, untyped = pstorage(obj)
        return tensor_reduce(p, untyped, obj.dtype, obj.storage_offset(), obj.shape, obj.stride(),
                             obj.requires_grad, torch._utils.get_tensor_metadata(obj))

    data_pkl, live = pickle_with_storages(tree, pickle, DEFAULT_PROTOCOL, reducer_override=reduce)
    if live:  # every tensor was reduced above: only a bare storage object gets here
        raise ConvertError("a bare storage object (not a tensor's): it cannot be converted")
    return data_pkl, order


def archive_options(torch_layout: bool) -> Tuple[Optional[int], Optional[int]]:
    """(alignment, direct_min) of write_archive for the fastckpt layout (torch's configured
    alignment, large records 4 KiB-aligned) or, with `torch_layout`, torch.save's own."""
    return (_zip.TORCH_ALIGNMENT, None) if torch_layout else (None, _zip.DIRECT_MIN)


def write_file(source: Source, dst: str, torch_layout: bool = False, progress: Progress = None) -> Dict[str, Any]:
    """A torch.save archive: fastckpt's layout (docs/FORMAT.md 1.3: large storage
    records 4 KiB-aligned, the others packed at torch's alignment), or with
    `torch_layout` torch.save's own (every record 64-byte aligned)."""
    from ..torchsave.writer import write_archive
    data_pkl, storages = pickle_tree(source.tree(values=True), source, progress)
    alignment, direct_min = archive_options(torch_layout)
    write_archive(dst, data_pkl, storages, alignment=alignment, direct_min=direct_min)
    return {"storages": len(storages), "bytes": sum(s.nbytes() for s in storages)}


# ---------------------------------------------------------------- safetensors

def _flat_tensors(tree: Any, drop_non_tensors: bool):
    """[(name, tensor)] of every tensor, named by its path joined with SEPARATOR;
    non-tensor values refused (or dropped)."""
    tensors: List[Tuple[str, torch.Tensor]] = []
    others: List[str] = []
    for path, v, kind in walk(tree):
        if kind == "tensor":
            tensors.append((key_str(path), v))
        elif kind == "value":
            others.append(f"{key_str(path)} ({_type_name(v)})")
    if others and not drop_non_tensors:
        shown = ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        raise ConvertError(f"safetensors files hold only tensors; the checkpoint also holds {len(others)} other "
                           f"value{'s' if len(others) != 1 else ''}: {shown}. Convert to fastckpt, torch or dcp "
                           "to keep them, or pass --drop-non-tensors to leave them out")
    if others:
        log.warning("fastckpt convert: leaving out %d non-tensor values: %s", len(others), ", ".join(others))
    return tensors, others


def _type_name(v: Any) -> str:
    return "object (not read)" if isinstance(v, LazyValue) else type(v).__name__


def _strip(tree: Any) -> Any:
    """`tree` with only tensors and the containers that hold them."""
    if isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            s = _strip(v)
            if s is not _NOTHING:
                out[k] = s
        return out if out or not tree else _NOTHING
    if type(tree) in (list, tuple):
        kept = [_strip(v) for v in tree]
        if any(s is _NOTHING for s in kept):
            if all(s is _NOTHING for s in kept):
                return _NOTHING
            raise ConvertError("a list mixes tensors and other values; --drop-non-tensors cannot keep its "
                               "positions (convert to fastckpt, torch or dcp instead)")
        return type(tree)(kept)
    return _NOTHING


_NOTHING = object()


def plan_safetensors(source: Source, drop_non_tensors: bool = False):
    """The safetensors file of `source` (from its tree of meta tensors: nothing is read): (the header
    bytes, [(name, tensor)] in file order, the file's size, the non-tensor values left out). The one
    layout, :func:`fastckpt.formats.safetensors.plan`: what save_file writes."""
    tree = source.tree(values=False)
    tensors, dropped = _flat_tensors(tree, drop_non_tensors)
    if dropped:
        tree = _strip(tree)
        if tree is _NOTHING:
            tree = {}
    entries: List[Tuple[str, torch.Tensor]] = []   # written, in file order
    name_of: Dict[Tuple, str] = {}                 # alias key -> name written
    tensor_name: Dict[int, str] = {}
    seen: Dict[str, Tuple] = {}
    for name, t in tensors:
        if t.layout != torch.strided:
            raise ConvertError(f"{name}: a {t.layout} tensor; safetensors holds dense tensors only")
        try:
            _st.file_shape(name, t.dtype, tuple(t.shape))  # a dtype or a shape the format cannot record
        except ValueError as e:
            raise ConvertError(str(e)) from None
        s = storage_of(t)
        alias = (id(s), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.is_conj(), t.is_neg())
        if name == "__metadata__":
            raise ConvertError("a tensor named '__metadata__': safetensors reserves that name for its metadata")
        if name in seen:
            raise ConvertError(f"two tensors would both be named {name!r} once nested keys are joined with "
                               f"{SEPARATOR!r}; rename one (or convert to another format)")
        seen[name] = alias
        if alias in name_of:  # the same tensor again (tied weights): stored once
            tensor_name[id(t)] = name_of[alias]
            continue
        name_of[alias] = name
        tensor_name[id(t)] = name
        entries.append((name, t))
    flat = (type(tree) in (dict, collections.OrderedDict) and len(entries) == len(tensors)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tree.items()))
    metadata: Dict[str, str] = {}
    if getattr(source, "metadata", None):
        metadata.update({k: v for k, v in source.metadata.items() if k != LAYOUT_KEY})
    metadata.setdefault("format", "pt")
    if not flat:
        try:
            metadata[LAYOUT_KEY] = json.dumps(encode_layout(tree, lambda t: tensor_name[id(t)]),
                                              separators=(",", ":"))
        except TypeError as e:
            raise ConvertError(f"the checkpoint's nesting cannot be recorded in safetensors metadata: {e}") \
                from None
    # The one safetensors layout (fastckpt.formats.safetensors.plan): what save_file writes.
    head, order, total = _st.plan({name: (t.dtype, tuple(t.shape)) for name, t in entries}, metadata)
    by_name = dict(entries)
    return head, [(name, by_name[name]) for name in order], total, dropped


def write_safetensors(source: Source, dst: str, drop_non_tensors: bool = False,
                      progress: Progress = None) -> Dict[str, Any]:
    head, entries, total, dropped = plan_safetensors(source, drop_non_tensors)
    pos = total - len(head)
    w = AtomicFile(dst, total)
    try:
        w.write(head)
        for name, t in entries:
            _write_tensor_bytes(source, t, w.write, progress)
        if w.position != total:
            raise RuntimeError(f"wrote {w.position} bytes, planned {total}")
        w.commit()
    except BaseException:
        w.abort()
        raise
    return {"tensors": len(entries), "bytes": pos, "dropped": dropped}


def _write_tensor_bytes(source: Source, t: torch.Tensor, write: Callable, progress: Progress) -> None:
    """The tensor's elements in C order, streamed when they are contiguous in its storage."""
    if t.numel() == 0:
        return
    if t.device.type == "meta" and is_dense(t) and not (t.is_conj() or t.is_neg()):
        lo, n = byte_span(t)

        def consume(piece: torch.Tensor) -> None:
            write(piece)
            if progress:
                progress(piece.numel())
        source.stream(storage_of(t), lo, n, consume)
        return
    data = source.materialize(t).contiguous()
    write(data.reshape(-1).view(torch.uint8))
    if progress:
        progress(data.numel() * data.element_size())


# ---------------------------------------------------------------- DCP

def _check_for_dcp(tree: Any) -> None:
    if not isinstance(tree, dict):
        raise ConvertError(f"a DCP checkpoint holds a dict at the top; this checkpoint holds a {type(tree).__name__}")
    int_keys, empty = [], []
    for path, v, kind in walk(tree):
        if kind == "dict":
            if not v and path:
                empty.append(key_str(path))
            int_keys += [key_str(path + (k,)) for k in v if not isinstance(k, str)]
    if int_keys:
        log.warning("fastckpt convert: DCP stores every dict key as a string; %d non-string keys (%s%s) will come "
                    "back as strings (e.g. an optimizer's state keyed by parameter index)", len(int_keys),
                    ", ".join(int_keys[:5]), ", ..." if len(int_keys) > 5 else "")
    if empty:
        log.warning("fastckpt convert: DCP does not store empty dicts; %s will be missing from the result",
                    ", ".join(empty[:5]) + (", ..." if len(empty) > 5 else ""))


def write_dcp(source: Source, dst: str, progress: Progress = None) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from ..dcp import FastWriter

    tree = source.tree(values=True)
    _check_for_dcp(tree)
    stats = {"tensors": 0, "bytes": 0}

    class Planner(DefaultSavePlanner):
        def lookup_object(self, index):
            obj = super().lookup_object(index)
            if isinstance(obj, torch.Tensor) and obj.device.type == "meta":
                obj = source.materialize(obj).contiguous()
                n = obj.numel() * obj.element_size()
                stats["tensors"] += 1
                stats["bytes"] += n
                if progress:
                    progress(n)
            return obj

    # Written into a temporary sibling of dst and put in place once complete by the one directory
    # commit (an existing dst is exchanged with it atomically), so that a failed or interrupted
    # conversion leaves dst as it was (FastWriter alone would replace it in place). The temporary
    # name is this host's and process's: CheckpointManager.clean_temporaries removes it once this
    # process is gone.
    from .._core.dircommit import commit_directory, new_directory
    final = os.path.abspath(dst).rstrip(os.sep)
    tmp = new_directory(final)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "no process group: saving as a single process"
            warnings.simplefilter("ignore", FutureWarning)
            try:
                dcp.save(tree, storage_writer=FastWriter(tmp), planner=Planner())
            except CheckpointException as ce:
                errors = [f[0] if isinstance(f, tuple) else f for f in ce.failures.values()]
                if len(errors) == 1 and isinstance(errors[0], BaseException):
                    raise errors[0] from None
                raise
        commit_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stats


# ---------------------------------------------------------------- entry point

def infer_target(dst: str) -> Optional[str]:
    ext = os.path.splitext(dst)[1].lower()
    if ext == ".safetensors":
        return "safetensors"
    if ext in (".pt", ".pth", ".ckpt", ".bin", ".tar"):
        return "fastckpt"
    if os.path.isdir(dst) or ext == ".dcp" or dst.endswith(os.sep):
        return "dcp"
    return None


def convert(source: Source, dst: str, to: str, drop_non_tensors: bool = False,
            progress: Progress = None) -> Dict[str, Any]:
    """Write `source` to `dst` in format `to` (one of TARGETS)."""
    if not source.streamed:
        log.warning("fastckpt convert: %s (%s) is read whole into memory, not streamed", source.path,
                    getattr(source, "why", source.kind))
    with engine_for_streaming():
        if to == "fastckpt":
            return write_file(source, dst, False, progress)
        if to == "torch":
            return write_file(source, dst, True, progress)
        if to == "safetensors":
            return write_safetensors(source, dst, drop_non_tensors, progress)
        if to == "dcp":
            return write_dcp(source, dst, progress)
    raise ValueError(f"unknown target format {to!r}; one of {', '.join(TARGETS)}")


def total_bytes(source: Source, to: str) -> int:
    """What convert will read, for a progress bar."""
    tree = source.tree(values=False)
    seen, total = set(), 0
    for _, t, kind in walk(tree):
        if kind != "tensor":
            continue
        s = storage_of(t)
        if to in ("fastckpt", "torch"):
            if id(s) not in seen:
                seen.add(id(s))
                total += s.nbytes
        else:
            total += t.numel() * t.element_size()
    return total
