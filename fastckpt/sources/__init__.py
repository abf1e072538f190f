"""Checkpoints opened for reading piece by piece, whatever their format: a
:class:`Source` is a checkpoint's object tree with meta tensors as leaves and
the reading of any byte range of its storages (:mod:`fastckpt.sources.source`);
the kinds of sources (torch.save zip archives, safetensors files and sharded
sets, DCP directories) and :func:`open_source` are in :mod:`fastckpt.sources.kinds`.
The ``fastckpt`` command (inspect, verify, convert) reads checkpoints through
them."""

from .kinds import DcpSource, LoadedSource, SafetensorsSource, ShardedSafetensorsSource, ZipSource, is_dcp_dir, open_source, sniff
from .source import Source, Storage, storage_of, walk

__all__ = ["Source", "Storage", "storage_of", "walk", "ZipSource", "SafetensorsSource", "ShardedSafetensorsSource", "DcpSource", "LoadedSource",
           "open_source", "sniff", "is_dcp_dir"]
