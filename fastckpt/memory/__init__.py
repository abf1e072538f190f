"""The memory tier: snapshots in host memory, replicated to peer nodes (see :mod:`fastckpt.memory.tier`)."""

from .tier import BoundTier, MemoryTier, memory_root, namespace_of

__all__ = ["MemoryTier", "BoundTier", "memory_root", "namespace_of"]
