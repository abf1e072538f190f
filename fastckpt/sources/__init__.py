"""Checkpoints opened for reading piece by piece, whatever their format: a
:class:`Source` is a checkpoint's object tree with meta tensors as leaves and
the reading of any byte range of its storages (:mod:`fastckpt.sources.source`);
the kinds of sources are :mod:`fastckpt.sources.zip` (torch.save zip archives),
:mod:`fastckpt.sources.safetensors` (safetensors files and sharded sets),
:mod:`fastckpt.sources.dcp` (DCP directories) and, with :func:`open_source`,
:mod:`fastckpt.sources.kinds`; :mod:`fastckpt.sources.into` fills a state from any of them.
The ``fastckpt`` command (inspect, verify, convert) reads checkpoints through
them."""

from .dcp import DcpSource
from .kinds import LoadedSource, is_dcp_dir, open_source, sniff
from .safetensors import SafetensorsSource, ShardedSafetensorsSource
from .zip import ZipSource
from .source import Source, Storage, storage_of, walk

__all__ = ["Source", "Storage", "storage_of", "walk", "ZipSource", "SafetensorsSource", "ShardedSafetensorsSource", "DcpSource", "LoadedSource",
           "open_source", "sniff", "is_dcp_dir"]
