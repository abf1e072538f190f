"""The safetensors format (https://github.com/huggingface/safetensors, "Format"):
an 8-byte little-endian header length, a JSON header, then the tensors' bytes.
Bytes in, plans out (no I/O): the dtype table, the one layout every fastckpt
writer of safetensors files uses (``save_file``, ``save_sharded``, ``fastckpt
convert``), and the header parser every reader uses.

The layout: tensors whose size is a whole number of 4 KiB pages first, the
others after them, within each part the larger elements first (so every tensor
starts at a multiple of its element size), and the header padded with spaces
so that the data starts on a 4 KiB boundary: the first part's tensors are then
each 4 KiB-aligned in the file, and an O_DIRECT read lands them straight in
their memory.
"""

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import FormatError
from .torch_rules import itemsize

__all__ = ["MAX_HEADER", "ALIGN", "LAYOUT_KEY", "SEPARATOR", "ST_DTYPES", "ST_NAMES", "VALUES_PER_ELEMENT",
           "dtype_name", "file_shape", "Entry", "plan", "read_header", "parse_header", "INDEX_SUFFIX", "index_name",
           "parse_index"]

MAX_HEADER = 100 << 20          # the largest header readers accept (the reference implementation's limit)
ALIGN = 4096                    # the data starts on, and page-sized tensors keep, this alignment
LAYOUT_KEY = "fastckpt.layout"  # __metadata__ entry: the nesting of the flattened names
SEPARATOR = "."                 # joins nested keys into safetensors names

# safetensors dtype names
_ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U64": "uint64",
             "U32": "uint32", "U16": "uint16", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
             "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
             "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2"}
ST_DTYPES: Dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in _ST_NAMES.items() if hasattr(torch, v)}
ST_NAMES: Dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}
# The format counts values, and a torch element of these dtypes packs several of them (float4_e2m1fn_x2:
# two 4-bit values in its one byte): a file shape's last dimension is the torch shape's times this.
# Every other dtype holds one value per element. F6_E2M3 / F6_E3M2 stay unknown until torch has them.
_VALUES_PER_ELEMENT = {"float4_e2m1fn_x2": 2}
VALUES_PER_ELEMENT: Dict[torch.dtype, int] = {getattr(torch, v): k for v, k in _VALUES_PER_ELEMENT.items()
                                              if hasattr(torch, v)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class Entry:
    """One tensor of a file: its bytes are data[begin:end]; ``shape`` is the torch shape (the
    header's for every dtype but a packed one, see :data:`VALUES_PER_ELEMENT`)."""
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int
    end: int


def file_shape(name: str, dtype: torch.dtype, shape: Sequence[int]) -> List[int]:
    """The shape the header records for tensor `name` of torch `dtype` and `shape`: the torch shape,
    its last dimension times :data:`VALUES_PER_ELEMENT` for a packed dtype. ValueError, naming the
    tensor, for a dtype without a safetensors name or a 0-d tensor of a packed dtype (no last
    dimension to count its values in; safetensors refuses it too)."""
    if dtype not in ST_NAMES:
        raise ValueError(f"tensor `{name}`: dtype {dtype_name(dtype)} has no safetensors name")
    k = VALUES_PER_ELEMENT.get(dtype, 1)
    if k == 1:
        return list(shape)
    if not shape:
        raise ValueError(f"tensor `{name}`: a 0-d {dtype_name(dtype)} tensor cannot be saved in safetensors, which "
                         f"counts its {k} packed values in the last dimension; reshape it to (1,) first")
    return list(shape[:-1]) + [shape[-1] * k]


def _where(path: str, name: str) -> str:
    """Where a header entry's problem is, for its error (built only then: a thousand entries would
    spend a millisecond on it)."""
    return f"{path}: tensor {name!r}"


def _torch_shape(dtype: torch.dtype, shape: List[int], path: str, name: str) -> Tuple[int, ...]:
    """The torch shape of header entry `name` of `dtype` and file `shape` (:func:`file_shape` undone)."""
    k = VALUES_PER_ELEMENT.get(dtype, 1)
    if k == 1:
        return tuple(shape)
    if not shape or shape[-1] % k:
        raise FormatError(f"{_where(path, name)}: shape {shape} counts {dtype_name(dtype)} values, {k} to an element: its last "
                          f"dimension must be a multiple of {k}")
    return tuple(shape[:-1]) + (shape[-1] // k,)


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = itemsize(dtype)
    for s in shape:
        n *= s
    return n


def plan(tensors: Mapping[str, Tuple[torch.dtype, Sequence[int]]],
         metadata: Optional[Dict[str, str]]) -> Tuple[bytes, List[str], int]:
    """The layout of a file of ``tensors`` (name -> (dtype, shape)): (the header
    with its 8-byte length, padded so that the data starts on :data:`ALIGN`;
    the names in data order; the file's size). ValueError: a dtype without a
    safetensors name or a shape the format cannot record (:func:`file_shape`), or a header larger
    than readers accept."""
    shapes = {n: file_shape(n, dt, shape) for n, (dt, shape) in tensors.items()}
    size = {n: _nbytes(dt, shape) for n, (dt, shape) in tensors.items()}

    def part(n: str) -> int:
        return 0 if size[n] and size[n] % ALIGN == 0 else 1

    order = sorted(tensors, key=lambda n: (part(n), -itemsize(tensors[n][0]), n))
    header: Dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    pos = 0
    for n in order:
        header[n] = {"dtype": ST_NAMES[tensors[n][0]], "shape": shapes[n], "data_offsets": [pos, pos + size[n]]}
        pos += size[n]
    h = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    h += b" " * ((-(8 + len(h))) % ALIGN)
    if len(h) > MAX_HEADER:
        raise ValueError(f"the safetensors header would be {len(h)} bytes, more than readers accept ({MAX_HEADER})")
    return len(h).to_bytes(8, "little") + h, order, 8 + len(h) + pos


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise FormatError(f"duplicate key {k!r} in the JSON header")
        d[k] = v
    return d


def header_length(head: bytes, file_size: int, path: str) -> int:
    """The header's length from the file's first 8 bytes, checked against the file's size."""
    if len(head) < 8:
        raise FormatError(f"{path}: {file_size} bytes is too short for a safetensors file")
    n = int.from_bytes(head[:8], "little")
    if n > MAX_HEADER or 8 + n > file_size:
        raise FormatError(f"{path}: truncated or not a safetensors file: header of {n} bytes in a "
                          f"{file_size}-byte file")
    return n


def read_header(pread: Callable[[int, int], bytes], file_size: int, path: str):
    """(the header's length, its __metadata__, its tensors, its problems) of a
    ``file_size``-byte file whose bytes ``pread(n, offset)`` returns: the one
    reading of a header every reader uses (the caller does the I/O)."""
    n = header_length(pread(8, 0), file_size, path)
    raw = pread(n, 8)
    if len(raw) != n:
        raise FormatError(f"{path}: truncated while reading the {n}-byte header")
    return (n,) + parse_header(raw, file_size, path)


def parse_header(raw: bytes, file_size: int, path: str) -> Tuple[Dict[str, str], List[Entry], List[str]]:
    """The header ``raw`` (the JSON after the 8-byte length) of a ``file_size``-byte
    file: (its __metadata__, its tensors, the problems found: gaps, overlaps or
    bytes after the last tensor, which the reference implementation refuses).
    FormatError for what cannot be read at all; every message names ``path``."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: the safetensors header is not a JSON object")
    buf_len = file_size - 8 - len(raw)
    meta = header.pop("__metadata__", None)
    if meta is not None and (not isinstance(meta, dict)
                             or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    entries: List[Entry] = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise FormatError(f"{_where(path, name)}: header entry is not an object")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in ST_DTYPES:
            raise FormatError(f"{_where(path, name)}: unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise FormatError(f"{_where(path, name)}: invalid shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or type(offs[0]) is not int or type(offs[1]) is not int
                or not 0 <= offs[0] <= offs[1]):
            raise FormatError(f"{_where(path, name)}: invalid data_offsets {offs!r}")
        dtype = ST_DTYPES[dt]
        torch_shape = _torch_shape(dtype, shape, path, name)
        want = _nbytes(dtype, torch_shape)
        if offs[1] - offs[0] != want:
            raise FormatError(f"{_where(path, name)}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, "
                              f"a {dt} tensor of shape {shape} needs {want}")
        if offs[1] > buf_len:
            raise FormatError(f"{_where(path, name)}: bytes {offs[0]}..{offs[1]} of the data lie past the end of the file "
                              f"(the data has {buf_len} bytes: truncated?)")
        entries.append(Entry(name, dtype, torch_shape, offs[0], offs[1]))
    # What the reference implementation also insists on: the tensors tile the data exactly.
    problems: List[str] = []
    pos = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin > pos:
            problems.append(f"{path}: {e.begin - pos} unused bytes before tensor {e.name!r} (data offset {pos})")
        elif e.begin < pos and e.end > e.begin:
            problems.append(f"{path}: tensor {e.name!r} overlaps the tensor before it (data offset {e.begin})")
        pos = max(pos, e.end)
    if pos != buf_len:
        problems.append(f"{path}: the file has {buf_len - pos} bytes after the last tensor's data")
    return dict(meta or {}), entries, problems


INDEX_SUFFIX = ".index.json"  # model.safetensors -> model.safetensors.index.json (a sharded set's index)


def index_name(weights_name: str) -> str:
    """The index file of the sharded set whose single-file name is `weights_name`
    (Hugging Face's rule: ``model.safetensors`` -> ``model.safetensors.index.json``)."""
    return (weights_name[:-len(".safetensors")] + ".safetensors" + INDEX_SUFFIX
            if weights_name.endswith(".safetensors") else weights_name + INDEX_SUFFIX)


def parse_index(raw: bytes, path: str) -> Dict[str, str]:
    """The weight map (tensor name -> shard file name) of the sharded set's index
    `raw` (read from `path`), checked: a JSON object whose ``weight_map`` maps
    names to plain file names of the index's directory (no path separators, no
    ``..``). FormatError naming `path` otherwise."""
    if len(raw) > MAX_HEADER:
        raise FormatError(f"{path}: {len(raw)} bytes is too large for an index")
    try:
        index = json.loads(raw.decode("utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise TypeError("weight_map must map names to file names")
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{path}: not a safetensors index ({e})") from None
    for f in sorted(set(weight_map.values())):
        if os.path.basename(f) != f or f in ("", ".", ".."):
            raise FormatError(f"{path}: shard {f!r} is not a file name in the directory")
    return weight_map
