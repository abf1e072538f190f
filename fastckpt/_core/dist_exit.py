"""Process groups that outlive destroy_process_group() into interpreter exit.

``torch.distributed.nn.functional`` (imported by DDP, DCP and others) binds
the default group as a default argument when it is first imported after
``init_process_group``; that reference keeps a destroyed gloo group alive
until interpreter finalization, where freeing it aborts the process (see
:func:`drop_torch_refs_to_destroyed_groups`). Every fastckpt collective (the
collective save and load, the manager, FastWriter and FastReader) calls :func:`register` so that those
references are dropped at exit while the interpreter is fully alive.
"""
import atexit
import logging
import sys
import threading
import types

log = logging.getLogger("fastckpt")
_registered = False
_lock = threading.Lock()


def drop_torch_refs_to_destroyed_groups() -> int:
    """``torch.distributed.nn.functional`` (imported by
    ``torch.distributed.checkpoint``, DDP and others) binds
    ``dist.group.WORLD`` as the default argument of its functions when it is
    first imported; imported after ``init_process_group``, that keeps the
    default group alive after ``destroy_process_group()``. Such a group dies
    only during interpreter finalization, and that is fatal with gloo: each
    of its worker threads keeps the last collective it ran, whose tensors
    hold Python objects, until the group is destroyed; releasing them then
    takes the GIL, and a thread that takes the GIL during finalization is
    killed inside a noexcept destructor: "terminate called without an
    active exception", SIGABRT.

    Called at exit, while the interpreter is fully alive: replaces those
    default arguments, where they name a group that was already destroyed
    (no longer registered), by None (which means the default group, as if
    the module had been imported before ``init_process_group``). If nothing
    else holds the group, it is freed here, through its Python object,
    whose destructor releases the GIL while it joins the worker threads.
    Live groups are left alone. Returns how many defaults were replaced."""
    mod = sys.modules.get("torch.distributed.nn.functional")
    if mod is None:
        return 0
    import torch.distributed as dist
    live = set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()
    n = 0
    for f in list(vars(mod).values()):
        if not isinstance(f, types.FunctionType) or not f.__defaults__:
            continue
        d = tuple(None if isinstance(x, dist.ProcessGroup) and x not in live else x for x in f.__defaults__)
        if any(x is not y for x, y in zip(d, f.__defaults__)):
            f.__defaults__ = d
            n += 1
    return n


def _at_exit() -> None:
    try:
        n = drop_torch_refs_to_destroyed_groups()
        if n:
            log.debug("fastckpt: dropped %d reference(s) torch kept to destroyed process groups", n)
    except Exception:  # noqa: BLE001 - never mask other exit handlers
        log.debug("fastckpt: could not drop torch's references to destroyed process groups", exc_info=True)


def register() -> None:
    """Once per process, from the first collective (after init_process_group,
    hence after torch's own exit handlers, so it runs before them)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True
