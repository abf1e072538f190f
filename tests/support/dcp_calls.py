"""Calling torch.distributed.checkpoint in a test."""


def dcp_unwrapped(fn, *args, **kw):
    """Call fn; dcp wraps a rank's exception in a CheckpointException (a
    BaseException) even without a process group: re-raise the single
    underlying exception as itself."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        return fn(*args, **kw)
    except CheckpointException as ce:
        errors = [f[0] if isinstance(f, tuple) else f for f in ce.failures.values()]
        if len(errors) == 1 and isinstance(errors[0], BaseException):
            raise errors[0] from None
        raise
