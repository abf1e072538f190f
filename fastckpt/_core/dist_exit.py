"""Collectives and process groups that must not reach into interpreter exit.

A gloo worker thread that releases a tensor whose Python object is already
gone must take the GIL to free that object; during interpreter finalization
that thread is killed inside a noexcept destructor: "terminate called
without an active exception", SIGABRT, after a job that otherwise finished.
Two ways fastckpt could get there, both closed here:

- **A collective's last work.** A gloo worker marks a collective complete
  before it drops its own references to the collective's tensors; torch's
  ``all_gather_object`` frees its Python tensors as soon as ``wait()``
  returns, so when the calling program exits at once (the manager's last
  agreement before ``close()`` and exit), the worker's late release can fall
  into finalization. :func:`all_gather_object` and
  :func:`broadcast_object_list` (what every fastckpt collective exchanges
  objects with) return only after the workers let go of their tensors.
- **A destroyed group torch still references.** ``torch.distributed.nn.functional``
  (imported by DDP, DCP and others) binds the default group as a default
  argument when it is first imported after ``init_process_group``; that
  reference keeps a destroyed gloo group alive until interpreter
  finalization, where freeing it aborts the process (see
  :func:`drop_torch_refs_to_destroyed_groups`). Every fastckpt collective
  (the collective save and load, the manager, FastWriter and FastReader)
  calls :func:`register` so that those references are dropped at exit while
  the interpreter is fully alive.
"""
import atexit
import logging
import pickle
import sys
import threading
import time
import types
from typing import Any, List, Optional

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


# ------------------------------------------------------------------ object collectives

SETTLE_TIMEOUT = 10.0  # seconds to wait for a worker to let go of a finished collective's tensors
_parked: List[Any] = []  # tensors a worker still held after SETTLE_TIMEOUT: kept alive to the end


def _device(group) -> Any:
    """Where the group's object collectives run: the current CUDA device for
    an NCCL-only group (as torch's own object collectives), else the CPU."""
    import torch
    import torch.distributed as dist
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def settle(tensors, timeout: Optional[float] = None) -> bool:
    """Waits until nothing but their Python objects holds ``tensors`` (a
    completed collective's worker thread drops its references just after it
    marks the work complete), so that freeing them later needs no other
    thread to take the GIL. True when they settled; after ``timeout``
    (default :data:`SETTLE_TIMEOUT`) the stragglers are kept alive for the
    rest of the process instead, and False is returned."""
    pending = [t for t in tensors if t._use_count() > 1]
    deadline = time.monotonic() + (SETTLE_TIMEOUT if timeout is None else timeout)
    pause = 0.0001
    while pending:
        if time.monotonic() >= deadline:
            log.debug("fastckpt: %d collective tensor(s) still held by a worker; kept alive", len(pending))
            _parked.extend(pending)
            return False
        time.sleep(pause)  # releases the GIL, which the worker may need
        pause = min(pause * 2, 0.005)
        pending = [t for t in pending if t._use_count() > 1]
    return True


def _to_tensor(obj: Any, device) -> Any:
    import torch
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), len(data)


def _from_tensor(t, n: int) -> Any:
    return pickle.loads(t[:n].cpu().numpy().tobytes())


def all_gather_object(object_list: List[Any], obj: Any, group=None) -> None:
    """``torch.distributed.all_gather_object``: fills ``object_list`` (one slot
    per rank of ``group``) with every rank's ``obj``; a barrier too. Returns
    once the group's workers hold none of its tensors (see the module's
    docstring). The objects are pickled: the ranks of a job trust each other."""
    import torch
    import torch.distributed as dist
    world = dist.get_world_size(group)
    if len(object_list) != world:
        raise ValueError(f"all_gather_object needs a list of {world} slots, not {len(object_list)}")
    device = _device(group)
    mine, n = _to_tensor(obj, device)
    size = torch.tensor([n], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    used = [size, *sizes]
    ok = False
    try:
        dist.all_gather(sizes, size, group=group)
        counts = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
        padded[:n] = mine
        outs = [torch.empty(max(counts), dtype=torch.uint8, device=device) for _ in range(world)]
        used += [padded, *outs]
        dist.all_gather(outs, padded, group=group)
        ok = True
    finally:
        settle(used, None if ok else 0.0)  # a failed collective's work may never let go: keep its tensors
    object_list[:] = [_from_tensor(t, c) for t, c in zip(outs, counts)]


def broadcast_object_list(object_list: List[Any], src: int, group=None) -> None:
    """``torch.distributed.broadcast_object_list``: ``object_list`` of global
    rank ``src`` replaces every rank's, slot by slot. Returns once the
    group's workers hold none of its tensors (see the module's docstring)."""
    import torch
    import torch.distributed as dist
    device = _device(group)
    sender = dist.get_rank() == src
    if sender:
        payload, n = _to_tensor(list(object_list), device)
        size = torch.tensor([n], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    used, ok = [size], False
    try:
        dist.broadcast(size, src=src, group=group)
        n = int(size.item())
        if not sender:
            payload = torch.empty(n, dtype=torch.uint8, device=device)
        used.append(payload)
        dist.broadcast(payload, src=src, group=group)
        ok = True
    finally:
        settle(used, None if ok else 0.0)
    if not sender:
        got = _from_tensor(payload, n)
        if len(got) != len(object_list):
            raise ValueError(f"broadcast_object_list: rank {src} sent {len(got)} objects, "
                             f"this rank has {len(object_list)} slots")
        object_list[:] = got
