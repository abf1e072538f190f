"""Checkpoints opened without loading them: what ``fastckpt inspect``, ``verify`` and ``convert``
read, and what :func:`fastckpt.load_into` reads into the state it fills. This module opens them
(:func:`open_source`, :func:`sniff`) and holds :class:`LoadedSource`; the other kinds are in
:mod:`fastckpt.sources.zip`, :mod:`fastckpt.sources.safetensors` and :mod:`fastckpt.sources.dcp`.

A :class:`Source` gives a checkpoint's object tree with *meta* tensors as
leaves (dtype, shape, stride and storage offset, no data; each knows its
:class:`Storage` through :func:`storage_of`), and reads any byte range of a
storage on demand, so that a caller holds at most the piece it is working on:

- :class:`ZipSource`: fastckpt and stock ``torch.save`` archives. The zip
  directory is parsed by :mod:`fastckpt.formats.zip`; ``data.pkl`` is unpickled as
  ``torch.load(weights_only=True, map_location="meta")`` would (no code from the file
  runs and no storage is read): a plain state dict by CPython's C unpickler
  (:mod:`fastckpt.torchsave.plain`, as ``fastckpt.load`` does), anything else by torch's
  own weights-only unpickler; storages are read through the engine.
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

import os
import pickle
import struct
import sys
from typing import Any, Optional

from ..torchsave.load import load_path
from ..errors import FormatError
from .._core import paths as _paths
from ..formats import safetensors as _st
from .source import Source
from .dcp import DcpSource
from .safetensors import SafetensorsSource, ShardedSafetensorsSource
from .zip import ZipSource

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
    with _paths.open_for_reading(path) as f:
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
