"""The lowest layer: the engine handle, atomic commits, temporary names, paths
and ownership checks. Imports only ``fastckpt._C``, ``fastckpt.errors`` and
``fastckpt.knobs``."""
