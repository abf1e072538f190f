"""Host staging for ``dcp.async_save``: a copy of the state dict in memory kept across saves.

``FastWriter.stage(state_dict)`` copies every tensor (plain or the local shard
of a DTensor) into one snapshot of the staging layer's snapshot component
(:mod:`fastckpt.staging.snapshot`: one host arena, each tensor on a 64-byte
boundary) and returns a state dict of the same structure whose tensors view
that arena; values that are not tensors are copied (immutable ones are
shared). The next ``stage()`` takes the arena again (it fits: same state, or
a little larger): repeated async saves of the same model allocate nothing.

A snapshot is busy from ``stage()`` until the save that writes it has
finished ``write_data`` (or the staged dict has been garbage-collected, e.g.
when a save failed before writing). ``stage()`` never overwrites a busy
snapshot's arena: if the previous save still runs, it stages into a second
arena (and says so in a log line), so an overlapping save costs memory, never
correctness.

Ownership is per snapshot: each ``stage()`` takes a new :class:`Snapshot`
(the *claim*), and releasing a claim that was released already is a no-op.
So the finalizer of an old staged dict that is garbage-collected late (after
its arena was released by its save and taken again by a newer ``stage()``)
cannot free the arena under the newer save. The save that writes a staged
dict finds its claim from the tensors it writes (:meth:`Stager.owner_of`),
not from state kept on the writer, so overlapping or out-of-order saves
release exactly what they used.

The arena is host memory page-locked once through
:mod:`fastckpt.staging.device` when the state holds device tensors (the
device-to-host copies run on each tensor's device's copy stream and
``stage()`` waits for each copy's own event); else plain memory aligned to
4 KiB.
"""

import collections
import copy
import io
import logging
import os
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch

from .snapshot import Snapshot, Snapshotter

log = logging.getLogger("fastckpt")

_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size,
              torch.layout, torch.memory_format)


class StagedStateDict(dict):
    """The staged copy (a dict subclass only so that it can be weak-referenced)."""


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
        return DTensor
    except ImportError:  # pragma: no cover (torch < 2.4)
        return None


# A staged generation: the snapshot a save releases when it is done.
Claim = Snapshot

_stagers: "weakref.WeakSet[Stager]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # After fork() only the forking thread exists: a lock another thread held
    # then would stay held in the child. (A snapshot busy with a save of the
    # parent stays busy: the child stages into another arena.)
    for st in list(_stagers):
        st._lock = threading.Lock()
        st.snapshots._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Stager:
    """State-dict staging for FastWriter over a :class:`Snapshotter`."""

    def __init__(self):
        self._lock = threading.Lock()
        self.snapshots = Snapshotter()
        self._busy = 0   # snapshots taken and not released (for the log line)
        _stagers.add(self)

    @property
    def allocations(self) -> int:
        """Arenas allocated so far (tests check reuse)."""
        return self.snapshots.allocations

    def release(self, claim: Optional[Claim]) -> bool:
        """Free `claim`'s arena for reuse if that claim still holds it (else a
        no-op: it was released already and the arena may belong to a newer
        stage()). Returns whether the arena was freed."""
        if claim is None or not self.snapshots.release(claim, keep=None):
            return False
        with self._lock:
            self._busy -= 1
        return True

    def owner_of(self, t: torch.Tensor) -> Optional[Claim]:
        """The staged generation whose buffer `t` is (or views), if a busy one's."""
        return self.snapshots.owner_of(t)

    def close(self) -> None:
        """Free the arenas no save is using."""
        self.snapshots.clear()

    # -- staging

    def stage(self, state_dict: Dict[str, Any]) -> StagedStateDict:
        tensors: List[torch.Tensor] = []
        for v in state_dict.values():
            _leaves(v, tensors)
        with self._lock:
            if self._busy:
                log.info("fastckpt.dcp: the previous async save still uses its staging buffers; "
                         "staging into a second set (%d in all)", self._busy + 1)
            self._busy += 1
        try:
            claim = self.snapshots.take(tensors)
        except BaseException:
            with self._lock:
                self._busy -= 1
            raise
        try:
            copies = iter(claim.views)
            out = StagedStateDict()
            for k, v in state_dict.items():
                out[k] = _rebuild(v, copies)
        except BaseException:
            self.release(claim)
            raise
        # A late collection of `out` releases this claim only, never a newer owner's.
        weakref.finalize(out, self.release, claim)
        return out


def _staged_here(obj: Any) -> Optional[torch.Tensor]:
    """The tensor of `obj` that goes into the snapshot (a plain tensor, the
    local shard of a DTensor), or None."""
    DTensor = _dtensor_type()
    if DTensor is not None and isinstance(obj, DTensor):
        return obj._local_tensor.detach()
    if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter) \
            and obj.layout == torch.strided:
        return obj.detach()
    return None


def _leaves(obj: Any, out: List[torch.Tensor]) -> None:
    """The tensors to snapshot, in the order :func:`_rebuild` takes them."""
    t = _staged_here(obj)
    if t is not None:
        out.append(t)
    elif isinstance(obj, torch.Tensor):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            _leaves(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _leaves(v, out)


def _rebuild(obj: Any, copies: Iterator[torch.Tensor]) -> Any:
    """`obj` with every tensor of :func:`_leaves` replaced by its copy."""
    if _staged_here(obj) is not None:
        local = next(copies)
        DTensor = _dtensor_type()
        if DTensor is not None and isinstance(obj, DTensor):
            return DTensor(local, obj._spec, requires_grad=False)
        return local
    if isinstance(obj, torch.Tensor):
        # ShardedTensor and other tensor types: torch's own staging, no reuse
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
        staged = _create_cpu_state_dict({"v": obj})
        return _copy_state_dict({"v": obj}, staged)["v"]
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, collections.OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _rebuild(v, copies)
        return out
    if isinstance(obj, list):
        return [_rebuild(v, copies) for v in obj]
    if isinstance(obj, tuple):
        vals = [_rebuild(v, copies) for v in obj]
        return type(obj)(*vals) if hasattr(obj, "_fields") else tuple(vals)
    if isinstance(obj, _IMMUTABLE):
        return obj
    if isinstance(obj, io.BytesIO):
        return io.BytesIO(obj.getvalue())
    return copy.deepcopy(obj)
