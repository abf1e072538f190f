"""safetensors files through the engine: ``save_file`` / ``load_file`` / ``save_model`` /
``load_model`` (and ``save`` / ``load`` of bytes in memory) with the signatures and the
semantics of ``safetensors.torch``, and sharded
Hugging Face checkpoints (``save_sharded`` / ``load_sharded``: ``model-00001-of-0000N.safetensors``
plus ``model.safetensors.index.json``).

What differs is how the bytes move. A save writes the file with O_DIRECT through the engine's
aligned buffers, under a temporary name, makes it durable (fdatasync) and renames it into place:
a crash leaves the previous file or the new one, never a torn one. The header is padded with
spaces (which the format allows) so that the data starts on a 4 KiB boundary, and the tensors
whose sizes are multiples of 4 KiB come first, so that a load reads each of them with O_DIRECT
straight into its own memory. The files are standard safetensors files:
``safetensors.torch.load_file`` and every other reader read them unchanged.

A load parses and checks the header first (dtypes, shapes, every offset against the file's size,
the tensors tiling the data exactly, as the reference implementation insists), so that what it
allocates is never more than the file holds; then the engine reads every tensor in parallel into
memory of its own (every page touched, unlike a lazy mmap). safetensors files carry NO checksums:
a flipped bit inside tensor data cannot be detected by any reader, this one included; only the
structure is checked. Use ``fastckpt.save`` (CRC-32 per storage) where that matters.

Refused as ``safetensors.torch`` refuses them, with the same exception types: a non-dict, a value
that is not a tensor, a sparse or non-contiguous tensor, tensors that share memory (use
:func:`save_model`, which keeps one name per shared storage), non-string metadata. Also refused:
a tensor named ``__metadata__`` (the format's reserved key), dtypes the format has no name for, and
a 0-d ``float4_e2m1fn_x2`` tensor (safetensors refuses it too: the format counts its 4-bit values
in the last dimension).

``safe_open`` (lazy access to single tensors and slices of a file) is safetensors' own, re-exported
so that ``from fastckpt.safetensors import safe_open`` works where ``safetensors.torch``'s does;
fastckpt does not accelerate it (it needs the safetensors package; ImportError otherwise).
"""
import errno
import json
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch

from ._core import dircommit as _dircommit
from ._core import engine as _engine
from ._core import paths as _paths
from ._core.atomic import AtomicFile, write_file
from .staging import device as _staging
from .staging.todevice import LoadJob, load_into_device
from ._core.paths import check_save_target, raise_named_after_target
from .formats import safetensors as _st
from .formats.torch_rules import is_dtensor
from .errors import FormatError
from .torchsave.reader import host_block, host_storage, huge_pages, judge_huge_pages, settle_block

__all__ = ["save", "load", "save_file", "load_file", "save_model", "load_model", "save_sharded", "load_sharded",
           "safe_open"]


def __getattr__(name: str) -> Any:
    if name == "safe_open":  # safetensors' own lazy reader (see the module docstring)
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError("fastckpt.safetensors.safe_open is safetensors' own: pip install safetensors "
                              f"({e})") from e
        return safe_open
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD = 5 * 10 ** 9       # transformers' save_pretrained default, "5GB"
_PARALLEL_FILES = 4               # shards written or read at once

PathLike = Union[str, os.PathLike]


# ---------------------------------------------------------------- the checks safetensors.torch makes

def _storage_key(t: torch.Tensor) -> Optional[Tuple]:
    if t.device.type == "meta":
        return None
    s = t.untyped_storage()
    if s.data_ptr() == 0 or s.nbytes() == 0:
        return None
    return (t.device, s.data_ptr(), s.nbytes())


def _end_ptr(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel() * t.element_size() if t.numel() else t.data_ptr()


def _shared_groups(tensors: Dict[str, torch.Tensor]) -> List[Set[str]]:
    """Names whose tensors overlap in memory, grouped (one set per group, singletons included):
    tensors on one storage are one group only where their byte ranges overlap."""
    by_storage: Dict[Tuple, List[str]] = {}
    for name, t in tensors.items():
        key = _storage_key(t)
        if key is not None:
            by_storage.setdefault(key, []).append(name)
    groups: List[Set[str]] = []
    for names in by_storage.values():
        areas = sorted((tensors[n].data_ptr(), _end_ptr(tensors[n]), n) for n in names)
        groups.append({areas[0][2]})
        stop = areas[0][1]
        for start, end, name in areas[1:]:
            if start >= stop:
                groups.append({name})
            else:
                groups[-1].add(name)
            stop = max(stop, end)
    return groups


def _check_tensors(tensors: Any) -> None:
    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    sparse = []
    for k, v in tensors.items():
        if not isinstance(k, str):
            raise TypeError(f"tensor names must be str, not {type(k).__name__} ({k!r})")
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"Key `{k}` is invalid, expected torch.Tensor but received {type(v)}")
        if v.layout != torch.strided:
            sparse.append(k)
    if sparse:
        raise ValueError(f"You are trying to save sparse tensors: {sparse}, which safetensors does not support; "
                         "make them dense with .to_dense() first")
    dts = {k: v for k, v in tensors.items() if is_dtensor(v)}
    shared = [g for g in _shared_groups({k: v for k, v in tensors.items() if k not in dts}) if len(g) > 1]
    by_id: Dict[int, Set[str]] = {}
    for k, v in dts.items():
        by_id.setdefault(id(v), set()).add(k)
    shared += [g for g in by_id.values() if len(g) > 1]
    if shared:
        raise RuntimeError(f"Some tensors share memory, this would store them twice on disk and they would "
                           f"load as separate tensors: {shared}. Save with fastckpt.safetensors.save_model, "
                           "which keeps one name per shared storage")
    for k, v in tensors.items():
        if not v.is_contiguous():
            raise ValueError(f"You are trying to save a non contiguous tensor: `{k}`; call .contiguous() on it "
                             "first (or save only the full tensor and slice it after loading)")
        _st.file_shape(k, v.dtype, tuple(v.shape))  # a dtype or a shape the format cannot record: ValueError
        if v.device.type == "meta":
            raise NotImplementedError(f"tensor `{k}` is on the meta device: it has no data to save")
    if "__metadata__" in tensors:
        raise ValueError("a tensor named '__metadata__': the safetensors format reserves that key for the metadata")


def _check_metadata(metadata: Any) -> Dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of str to str, not {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str: {k!r}: {v!r}")
    return dict(metadata)


# ---------------------------------------------------------------- writing

def _plan(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]]) -> Tuple[bytes, List[str], int]:
    """The one safetensors layout (:func:`fastckpt.formats.safetensors.plan`) of these tensors."""
    return _st.plan({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, metadata)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _check_byteorder() -> None:
    if sys.byteorder != "little":
        raise NotImplementedError("fastckpt.safetensors writes little-endian files on little-endian machines only")


def _fill(w: Any, head: bytes, order: List[str], size: int, tensors: Dict[str, torch.Tensor], where: str) -> None:
    """Write the planned file (:func:`_plan`'s `head`, `order`, `size`) into `w` (anything with
    AtomicFile's ``write`` and ``position``): the header, then every tensor's bytes in data order."""
    w.write(head)
    for n in order:
        t = tensors[n]
        if t.numel() == 0:
            continue
        # a device tensor: one host copy at a time (the largest tensor bounds the memory)
        w.write(_bytes_of(t if t.device.type == "cpu" else t.cpu()))
    if w.position != size:
        raise RuntimeError(f"{where}: wrote {w.position} bytes, planned {size}")


class _InMemory:
    """AtomicFile's ``write`` / ``position`` into a bytearray of the planned size."""

    def __init__(self, size: int):
        self.data = bytearray(size)
        self._view = torch.frombuffer(self.data, dtype=torch.uint8)
        self.position = 0

    def write(self, chunk: Union[bytes, torch.Tensor]) -> None:
        src = chunk if isinstance(chunk, torch.Tensor) else torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
        self._view[self.position:self.position + src.numel()].copy_(src)
        self.position += src.numel()


def _write_file(tensors: Dict[str, torch.Tensor], filename: PathLike, metadata: Optional[Dict[str, str]]) -> None:
    """Plan, write and commit one safetensors file (AtomicFile: the previous file or the complete
    new one at `filename`; its errors name `filename`)."""
    _check_byteorder()
    path = check_save_target(os.fsdecode(os.fspath(filename)))
    head, order, size = _plan(tensors, metadata)
    with AtomicFile(path, size) as w:
        _fill(w, head, order, size, tensors, path)


def save_file(tensors: Dict[str, torch.Tensor], filename: PathLike, metadata: Optional[Dict[str, str]] = None, *,
              group: Any = None) -> None:
    """``safetensors.torch.save_file``, durable and atomic: the file at `filename` is the previous
    one or the complete new one, whatever happens during the call.

    ``group``: a ``torch.distributed`` process group whose every rank calls this with the same
    names and a path on a filesystem they share: the values may be DTensors (FSDP2, tensor
    parallelism), and the file holds their full tensors, each rank writing the bytes of its own
    shards (plain tensors, which must agree across ranks, are written once); no rank gathers
    anything (fastckpt/collective/full.py). Every rank returns after the commit or raises."""
    _check_tensors(tensors)
    metadata = _check_metadata(metadata) if metadata is not None else None
    if group is not None:
        _write_file_together(tensors, filename, metadata, group)
        return
    _write_file(tensors, filename, metadata)


def _write_file_together(tensors: Dict[str, torch.Tensor], filename: PathLike, metadata: Optional[Dict[str, str]],
                         group: Any) -> None:
    """save_file with ``group`` (also a shard of save_sharded's)."""
    from .collective import full as _full
    from .collective.group import Group
    _check_byteorder()
    path = os.path.abspath(os.fsdecode(os.fspath(filename)))
    head, order, _size = _plan(tensors, metadata)
    _full.save_safetensors(tensors, path, Group(group, path), head, order)


def save(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """``safetensors.torch.save``: the safetensors file of `tensors` as bytes, checked as
    :func:`save_file` checks them, in fastckpt's layout (the data starts at 4 KiB), which every
    safetensors reader reads."""
    _check_tensors(tensors)
    metadata = _check_metadata(metadata) if metadata is not None else None
    _check_byteorder()
    head, order, size = _plan(tensors, metadata)
    w = _InMemory(size)
    _fill(w, head, order, size, tensors, "fastckpt.safetensors.save")
    return bytes(w.data)


def load(data: bytes) -> Dict[str, torch.Tensor]:
    """``safetensors.torch.load``: the tensors of the safetensors file held in `data` (bytes or any
    bytes-like object), each in memory of its own, on the CPU. The header is checked as a file's is
    (:class:`fastckpt.FormatError` for anything invalid): nothing is allocated that `data` does not
    hold."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"fastckpt.safetensors.load: expected bytes, got {type(data).__name__}")
    mv = memoryview(data).cast("B")
    where = "<bytes>"
    n, _meta, entries, problems = _st.read_header(lambda k, o: bytes(mv[o:o + k]), len(mv), where)
    if problems:
        raise FormatError(f"{problems[0]} (the tensors must tile the data exactly: not valid safetensors data)")
    import numpy as np  # a dependency of fastckpt's; imported here, off `import fastckpt`'s path
    start = 8 + n
    out: Dict[str, torch.Tensor] = {}
    huge = huge_pages(sum(e.end - e.begin for e in entries))  # decided once for all the tensors
    for e in entries:
        k = e.end - e.begin
        buf = host_storage(k, huge=huge)
        if k:  # one copy, from the caller's bytes (read-only) straight into the tensor's own memory
            buf.numpy()[:] = np.frombuffer(mv, dtype=np.uint8, count=k, offset=start + e.begin)
        out[e.name] = torch.empty(0, dtype=e.dtype).set_(buf.untyped_storage()).view(e.shape)
    return out


# ---------------------------------------------------------------- reading

def _location(device: Union[str, int, torch.device]) -> Any:
    """`device` as torch takes it (an int is a CUDA device index); "cpu" for the host."""
    if isinstance(device, int):
        return f"cuda:{device}"
    if isinstance(device, torch.device):
        return "cpu" if device.type == "cpu" else device
    return "cpu" if str(device) == "cpu" else device


class _File:
    """An open safetensors file and its parsed header (:func:`fastckpt.formats.safetensors.parse_header`):
    ``entries``, ``metadata``, ``data_start``; every read goes to this open file."""

    def __init__(self, path: str):
        self.path = path
        self.f = _paths.open_for_reading(path)
        try:
            fd = self.f.fileno()
            size = os.fstat(fd).st_size
            n, self.metadata, self.entries, problems = _st.read_header(lambda k, o: os.pread(fd, k, o), size, path)
            self.data_start = 8 + n
            if problems:
                raise FormatError(f"{problems[0]} (the tensors must tile the data exactly: not a valid safetensors "
                                  "file)")
        except BaseException:
            self.f.close()
            raise

    def close(self) -> None:
        self.f.close()


def _open(filename: PathLike) -> _File:
    return _File(os.fsdecode(os.fspath(filename)))


def _read(src: _File, location: Any) -> Dict[str, torch.Tensor]:
    """Every tensor of the open file, read in parallel by the engine: into host memory (one block laid
    out as the file's data is, each tensor a storage of its own in it: :func:`host_block`), or through
    the staging pipeline's pinned buffers into device memory of each tensor's own."""
    entries = sorted(src.entries, key=lambda e: e.begin)
    host = location == "cpu"
    staged = None if host else _staging.copier_for_location(location)
    # any other device (no staging copier for it): host memory, then .to(it); an invalid one fails here
    other = None if host or staged is not None else torch.device(location)
    fd = src.f.fileno()
    if staged is None:
        spans = [(e.begin, e.end, e.dtype.itemsize) for e in entries]
        size = entries[-1].end if entries else 0  # the tensors tile the data (checked by _File)
        huge = huge_pages(size)
        whole, parts = host_block(size, src.data_start, spans, huge=huge)
        if size:
            _engine.read_ranges(src.path, [(whole, src.data_start)], fd, fresh_huge=judge_huge_pages(huge))
        del whole
        storages = [p.untyped_storage() for p in settle_block(src.data_start, spans, parts)]
    else:
        copier, dev = staged
        storages, jobs = [], []
        for e in entries:
            n = e.end - e.begin
            dst = copier.empty_device(n, dev)
            if n:
                jobs.append(LoadJob(e.name, src.data_start + e.begin, n, dst, copier))
            storages.append(dst)

        def read(rs, crc):
            return _engine.read_ranges(src.path, rs, fd, crc).get("crcs")
        if jobs:
            load_into_device(read, jobs, False)
    out = {e.name: torch.empty(0, dtype=e.dtype, device=st.device).set_(st).view(e.shape)
           for e, st in zip(entries, storages)}
    if other is not None:
        out = {k: v.to(other) for k, v in out.items()}
    return {e.name: out[e.name] for e in src.entries}  # the header's order


BACKENDS = ("mmap", "pread")  # the values safetensors.torch (0.8) takes for ``backend``


def _check_backend(backend: Any) -> None:
    """``backend`` as safetensors.torch checks it: a str (else TypeError), one of :data:`BACKENDS`
    (else safetensors' SafetensorError where safetensors is installed, ValueError otherwise)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, not {type(backend).__name__}")
    if backend not in BACKENDS:
        msg = f'backend "{backend}" is invalid (expected one of: ' + ", ".join(f'"{b}"' for b in BACKENDS) + ")"
        try:
            from safetensors import SafetensorError
        except ImportError:
            raise ValueError(msg) from None
        raise SafetensorError(msg)


def load_file(filename: PathLike, device: Union[str, int, torch.device] = "cpu", *,
              backend: str = "mmap") -> Dict[str, torch.Tensor]:
    """``safetensors.torch.load_file``: every tensor of the file on `device`, read in parallel by the
    engine (each in memory of its own; every page read, none left to fault in later). A file that is
    not a valid safetensors file is a :class:`fastckpt.FormatError` naming it; the format has no
    checksums, so damaged tensor data goes undetected (see the module's docstring).

    ``backend`` is safetensors' (``"mmap"`` or ``"pread"``), checked as safetensors checks it; the
    engine reads the same way for both (parallel reads into memory of the tensors' own, as
    ``"pread"`` does; nothing stays mapped as with ``"mmap"``)."""
    _check_backend(backend)
    location = _location(device)
    src = _open(filename)
    try:
        return _read(src, location)
    finally:
        src.close()


def load_metadata(filename: PathLike) -> Dict[str, str]:
    """The file's ``__metadata__`` (``safe_open(...).metadata()``), reading the header only."""
    src = _open(filename)
    try:
        return dict(src.metadata)
    finally:
        src.close()


# ---------------------------------------------------------------- models (shared tensors)

def _complete(t: torch.Tensor) -> bool:
    s = t.untyped_storage()
    return t.data_ptr() == s.data_ptr() and t.numel() * t.element_size() == s.nbytes()


def _names_to_drop(state_dict: Dict[str, torch.Tensor], preferred: Optional[Set[str]] = None) -> Dict[str, List[str]]:
    """For each group of names sharing memory: the name kept (a tensor covering its whole storage; of
    several, one of `preferred` first, then the first in sorted order) -> the names dropped, as
    ``safetensors.torch`` chooses them (so that either library loads what the other saved)."""
    drop: Dict[str, List[str]] = {}
    for group in _shared_groups(state_dict):
        if len(group) < 2:
            continue
        complete = sorted(n for n in group if _complete(state_dict[n]))
        if not complete:
            raise RuntimeError(f"tensors {sorted(group)} share memory and none of them covers the whole storage: "
                               "refusing to save or load them (saving would store more than the model holds)")
        keep = complete[0]
        if preferred:
            mine = [n for n in complete if n in preferred]
            keep = mine[0] if mine else keep
        drop[keep] = sorted(n for n in group if n != keep)
    return drop


def save_model(model: torch.nn.Module, filename: PathLike, metadata: Optional[Dict[str, str]] = None,
               force_contiguous: bool = True) -> None:
    """``safetensors.torch.save_model``: the model's state dict with one name per shared storage (tied
    weights); each dropped name goes into the metadata as ``dropped -> kept`` unless already there."""
    state_dict = model.state_dict()
    metadata = _check_metadata(metadata) if metadata is not None else None
    for keep, names in _names_to_drop(state_dict).items():
        for n in names:
            metadata = {} if metadata is None else metadata
            metadata.setdefault(n, keep)
            del state_dict[n]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    try:
        save_file(state_dict, filename, metadata=metadata)
    except ValueError as e:
        raise ValueError(f"{e}. Or use save_model(..., force_contiguous=True)") from None


def load_model(model: torch.nn.Module, filename: PathLike, strict: bool = True,
               device: Union[str, int, torch.device] = "cpu", *, backend: str = "mmap") -> Tuple[Set[str], List[str]]:
    """``safetensors.torch.load_model``: load the file into `model`; returns (missing, unexpected)
    names, the names a shared storage was saved under counting as present; raises with ``strict``.
    ``backend``: as :func:`load_file`'s."""
    state_dict = load_file(filename, device=device, backend=backend)
    dropped = _names_to_drop(model.state_dict(), preferred=set(state_dict))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing)
    for names in dropped.values():
        for n in names:
            if n in missing:
                missing.remove(n)
            else:
                unexpected.append(n)
    if strict and (missing or unexpected):
        msg = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            msg += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            msg += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(msg)
    return missing, unexpected  # a set and a list, as safetensors.torch returns them


# ---------------------------------------------------------------- sharded Hugging Face checkpoints

def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    for unit, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10 ** 9), ("MB", 10 ** 6),
                       ("KB", 10 ** 3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[:-len(unit)]) * mult)
    return int(s)


def shard_names(state_dict: Dict[str, torch.Tensor], max_shard_size: Union[int, str] = DEFAULT_SHARD,
                weights_name: str = "model.safetensors") -> Dict[str, List[str]]:
    """file name -> the tensor names in it: tensors in the state dict's order, a new shard when the next
    tensor would take the current one past `max_shard_size` (a larger tensor gets a shard of its own);
    names as transformers writes them (``model-00001-of-00003.safetensors``), one file without a suffix."""
    limit = _parse_size(max_shard_size)
    shards: List[List[str]] = [[]]
    size = 0
    for name, t in state_dict.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    if len(shards) == 1:
        return {weights_name: shards[0]}
    stem, ext = os.path.splitext(weights_name)
    total = len(shards)
    return {f"{stem}-{i + 1:05d}-of-{total:05d}{ext}": names for i, names in enumerate(shards)}


def save_sharded(state_dict: Dict[str, torch.Tensor], save_directory: PathLike,
                 max_shard_size: Union[int, str] = DEFAULT_SHARD, metadata: Optional[Dict[str, str]] = None,
                 weights_name: str = "model.safetensors", *, group: Any = None) -> Dict[str, List[str]]:
    """A Hugging Face sharded checkpoint in `save_directory`, replaced atomically as a set: the
    shards (written in parallel, each durable) and the index (``model.safetensors.index.json``:
    ``{"metadata": {"total_size": ...}, "weight_map": {...}}``) are written into a temporary
    sibling directory, which the one directory commit then puts at `save_directory` (an existing
    one is exchanged with it in one ``renameat2(RENAME_EXCHANGE)``, fastckpt/_core/dircommit.py):
    after a crash at any moment, `save_directory` holds the old checkpoint or the complete new
    one, under the names transformers writes. Other files of an existing `save_directory` (a
    model's ``config.json``, tokenizer files) are carried into the new one (hard links); its old
    shards and index are not. One shard: no index, the file is ``weights_name``. Returns file name
    -> tensor names. `metadata` goes into every shard.

    ``group``: every rank of the process group calls this with the same names and a directory they
    share; values may be DTensors, and each shard file is written as :func:`save_file` with
    ``group`` writes one (every rank its own shards' bytes, full tensors in the files), rank 0
    making the temporary directory, writing the index and committing the set."""
    _check_tensors(state_dict)
    metadata = _check_metadata(metadata if metadata is not None else {"format": "pt"})
    directory = os.path.abspath(os.fsdecode(os.fspath(save_directory))).rstrip(os.sep)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, f"cannot save a sharded checkpoint to {directory!r}: it exists and "
                                 "is not a directory", directory)
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    shards = shard_names(state_dict, max_shard_size, weights_name)
    index_name = _st.index_name(weights_name)
    index_path = os.path.join(directory, index_name)
    if group is not None:
        _save_sharded_together(state_dict, directory, shards, index_name, metadata, weights_name, group)
        return shards
    keep = _not_the_checkpoint(directory, weights_name, index_name)
    tmp = _dircommit.new_directory(directory)
    try:
        # Each shard is committed inside the new directory as soon as it is written: its writer
        # gives back its staging buffers then (a written writer left open holds some until its
        # commit, and a pool thread's next shard would wait for them forever). The directory
        # commit below is what makes the set of files appear at once.
        with ThreadPoolExecutor(min(_PARALLEL_FILES, len(shards))) as ex:
            futs = [ex.submit(_write_file, {n: state_dict[n] for n in names}, os.path.join(tmp, f), metadata)
                    for f, names in shards.items()]
            errors = []
            for fu in futs:
                try:
                    fu.result()
                except BaseException as e:  # noqa: BLE001 - wait for every shard before removing tmp
                    errors.append(e)
            if errors:
                raise errors[0]
        _write_index(tmp, index_name, shards, state_dict)
        _dircommit.commit_directory(tmp, directory, keep=keep)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.filename and tmp in os.fsdecode(e.filename):
            raise_named_after_target(e, index_path)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return shards



def _write_index(tmp: str, index_name: str, shards: Dict[str, List[str]], state_dict: Dict[str, torch.Tensor]) -> None:
    """The index of a sharded checkpoint of more than one file (none for one)."""
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state_dict.values())},
                 "weight_map": {n: f for f, names in shards.items() for n in names}}
        write_file(os.path.join(tmp, index_name), json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")


def _save_sharded_together(state_dict: Dict[str, torch.Tensor], directory: str, shards: Dict[str, List[str]],
                           index_name: str, metadata: Dict[str, str], weights_name: str, group: Any) -> None:
    """save_sharded with ``group``: rank 0 makes the temporary directory, every shard is written by
    every rank (one after the other), rank 0 writes the index and commits the directory."""
    from .collective.group import Group
    g = Group(group, directory)
    tmp, err = None, None
    try:
        if g.rank == 0:
            try:
                keep = _not_the_checkpoint(directory, weights_name, index_name)
                tmp = _dircommit.new_directory(directory)
            except Exception as e:
                err = e
        tmp = g.exchange(tmp, err, "to make the temporary directory")[0]
        for f, names in shards.items():
            _write_file_together({n: state_dict[n] for n in names}, os.path.join(tmp, f), metadata, group)
        err = None
        if g.rank == 0:
            try:
                _write_index(tmp, index_name, shards, state_dict)
                _dircommit.commit_directory(tmp, directory, keep=keep)
                tmp = None
            except Exception as e:
                err = e
        g.exchange(None, err, "to commit")
    except BaseException as e:
        if g.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.filename and tmp and tmp in os.fsdecode(e.filename):
            raise_named_after_target(e, os.path.join(directory, index_name))
        raise


def _not_the_checkpoint(directory: str, weights_name: str, index_name: str):
    """Which entries of an existing checkpoint directory a new sharded save keeps: all but the
    single file, the index, the shards it names and any file named as a shard of `weights_name`."""
    stem, ext = os.path.splitext(weights_name)
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}" + re.escape(ext))
    named: set = set()
    try:
        with open(os.path.join(directory, index_name), "rb") as f:
            wm = json.loads(f.read(_st.MAX_HEADER).decode("utf-8")).get("weight_map", {})
        named = {v for v in wm.values() if isinstance(v, str)}
    except (OSError, ValueError, AttributeError):
        pass
    return lambda n: n not in (weights_name, index_name) and n not in named and not shard.fullmatch(n)


def load_sharded(directory: PathLike, device: Union[str, int, torch.device] = "cpu",
                 weights_name: str = "model.safetensors") -> Dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint directory: the shards its index names (read in
    parallel, each checked as :func:`load_file` checks one; a tensor the index maps to a shard that
    does not hold it, or a shard holding a tensor twice, is a FormatError), or the single file."""
    directory = _dircommit.resolve(os.fsdecode(os.fspath(directory)))  # a set left aside by an interrupted commit
    index_path = os.path.join(directory, _st.index_name(weights_name))
    if not os.path.exists(index_path):
        return load_file(os.path.join(directory, weights_name), device)
    size = os.path.getsize(index_path)
    if size > _st.MAX_HEADER:
        raise FormatError(f"{index_path}: {size} bytes is too large for an index")
    with open(index_path, "rb") as f:
        weight_map = _st.parse_index(f.read(), index_path)
    files = sorted(set(weight_map.values()))
    with ThreadPoolExecutor(min(_PARALLEL_FILES, max(1, len(files)))) as ex:
        parts = list(ex.map(lambda f: (f, load_file(os.path.join(directory, f), device)), files))
    out: Dict[str, torch.Tensor] = {}
    for f, tensors in parts:
        for name, t in tensors.items():
            if weight_map.get(name) != f:
                raise FormatError(f"{os.path.join(directory, f)}: holds tensor {name!r}, which {index_path} "
                                  f"maps to {weight_map.get(name)!r}")
            out[name] = t
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise FormatError(f"{index_path}: names {missing[:5]} (of {len(missing)}) are in no shard")
    return {n: out[n] for n in weight_map}
