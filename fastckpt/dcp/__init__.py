"""fastckpt.dcp: torch.distributed.checkpoint storage through fastckpt's engine.

``FastWriter`` and ``FastReader`` are a StorageWriter/StorageReader pair for
``dcp.save``, ``dcp.async_save`` and ``dcp.load``; their checkpoints are stock
DCP directories (``.metadata`` + ``__<rank>_<n>.distcp``) that the stock
``FileSystemReader`` loads, and ``FastReader`` loads the stock
``FileSystemWriter``'s. See docs/FORMAT.md, section 2.

Both are imported on first use, so that ``import fastckpt`` works with a torch
built without ``torch.distributed``.
"""

__all__ = ["FastWriter", "FastReader"]


def __getattr__(name):
    if name == "FastWriter":
        from .writer import FastWriter
        return FastWriter
    if name == "FastReader":
        from .reader import FastReader
        return FastReader
    raise AttributeError(f"fastckpt has no attribute {name!r}")
