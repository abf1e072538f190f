"""Host staging for ``dcp.async_save``: a copy of the state dict in buffers kept across saves.

``FastWriter.stage(state_dict)`` copies every tensor (plain or the local shard
of a DTensor) into a host buffer of its own and returns a state dict of the
same structure whose tensors are those buffers; values that are not tensors
are copied (immutable ones are shared). Buffers are kept in a *slot* keyed by
the tensor's place in the state dict, and the next ``stage()`` copies into the
same buffers: repeated async saves of the same model allocate nothing.

A slot is busy from ``stage()`` until the save that writes it has finished
``write_data`` (or the staged dict has been garbage-collected, e.g. when a save
failed before writing). ``stage()`` never overwrites a busy slot: if the
previous save still runs, it stages into a second slot (and says so in a log
line), so an overlapping save costs memory, never correctness.

Ownership is generation-checked. Every ``stage()`` makes the slot it takes
belong to a new *generation*; a release names the generation it releases, and
releasing any other generation is a no-op. So the finalizer of an old staged
dict that is garbage-collected late (after its slot was released by its save
and taken again by a newer ``stage()``) cannot free the slot under the newer
save. The save that writes a staged dict finds its slot and generation from
the tensors it writes (:meth:`Stager.owner_of`), not from state kept on the
writer, so overlapping or out-of-order saves release exactly what they used.

Buffers for device tensors are exact-size host memory page-locked once
through :mod:`fastckpt.staging.device` (the device-to-host copies run on each
tensor's device's copy stream and ``stage()`` waits for each copy's own
event); others are plain memory aligned to 4 KiB.
"""

import collections
import copy
import io
import logging
import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _C
from . import device as _host_staging

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


def _aligned_empty(size, dtype: torch.dtype, copier) -> Tuple[torch.Tensor, Any]:
    """A 4 KiB-aligned host tensor, exactly `size`; page-locked through
    `copier` (a :class:`fastckpt.staging.device.HostBuffer`, returned too) when the
    source lives on a device."""
    nbytes = torch.Size(size).numel() * torch.empty((), dtype=dtype).element_size()
    if copier is not None:
        hb = copier.alloc_host(nbytes)
        return hb.tensor.view(dtype).view(size), hb
    return _C.empty_aligned(nbytes, 4096).view(dtype).view(size), None


class _Slot:
    def __init__(self):
        self.buffers: Dict[Tuple, torch.Tensor] = {}
        self.hosts: Dict[Tuple, Any] = {}  # page-locked HostBuffers behind device tensors' buffers
        self.generation = 0   # the stage() that owns the slot while busy
        self.busy = False


class Claim:
    """One staged generation of one slot: what a save releases when it is done."""

    __slots__ = ("slot", "generation")

    def __init__(self, slot: _Slot, generation: int):
        self.slot = slot
        self.generation = generation

    def __eq__(self, other):
        return isinstance(other, Claim) and other.slot is self.slot and other.generation == self.generation

    def __hash__(self):
        return hash((id(self.slot), self.generation))


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (meta, wrapper subclasses)
        return 0


_stagers: "weakref.WeakSet[Stager]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # After fork() only the forking thread exists: a lock another thread held
    # then would stay held in the child. (A slot busy with a save of the parent
    # stays busy: the child stages into another one.)
    for st in list(_stagers):
        st._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Stager:
    def __init__(self):
        self._lock = threading.Lock()
        self._slots: List[_Slot] = []
        self._generation = 0
        self._owners: Dict[int, Claim] = {}   # storage pointer of a busy slot's buffer -> its claim
        self.allocations = 0                  # buffers allocated so far (tests check reuse)
        _stagers.add(self)

    # -- slots

    def _take_slot(self) -> Claim:
        with self._lock:
            self._generation += 1
            for s in self._slots:
                if not s.busy:
                    break
            else:
                if self._slots:
                    log.info("fastckpt.dcp: the previous async save still uses its staging buffers; "
                             "staging into a second set (%d in all)", len(self._slots) + 1)
                s = _Slot()
                self._slots.append(s)
            s.busy = True
            s.generation = self._generation
            return Claim(s, s.generation)

    def release(self, claim: Optional[Claim]) -> bool:
        """Free `claim`'s slot for reuse if that generation still owns it (else a
        no-op: the slot was released already and may belong to a newer stage()).
        Returns whether the slot was freed."""
        if claim is None:
            return False
        with self._lock:
            s = claim.slot
            if not s.busy or s.generation != claim.generation:
                return False
            s.busy = False
            for k in [k for k, c in self._owners.items() if c == claim]:
                del self._owners[k]
            return True

    def owner_of(self, t: torch.Tensor) -> Optional[Claim]:
        """The staged generation whose buffer `t` is (or views), if a busy slot's."""
        with self._lock:
            ptr = _storage_ptr(t) if self._owners else 0
            return self._owners.get(ptr) if ptr else None

    def close(self) -> None:
        with self._lock:
            self._slots = [s for s in self._slots if s.busy]

    # -- staging

    def stage(self, state_dict: Dict[str, Any]) -> StagedStateDict:
        claim = self._take_slot()
        slot = claim.slot
        try:
            used: Dict[Tuple, torch.Tensor] = {}
            hosts: Dict[Tuple, Any] = {}
            copies: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (host bytes, device bytes)
            out = StagedStateDict()
            try:
                for k, v in state_dict.items():
                    out[k] = self._walk(v, (k,), slot, used, (hosts, copies))
            finally:
                # every copy on its device's copy stream, each waited for on its own event
                _host_staging.snapshot_into(copies)
            slot.buffers = used  # buffers of keys no longer in the state dict are dropped
            slot.hosts = hosts
            with self._lock:
                for buf in used.values():
                    ptr = _storage_ptr(buf)
                    if ptr:
                        self._owners[ptr] = claim
        except BaseException:
            self.release(claim)
            raise
        # A late collection of `out` releases this generation only, never a newer owner's.
        weakref.finalize(out, self.release, claim)
        return out

    def _buffer(self, path: Tuple, t: torch.Tensor, slot: _Slot, used: Dict[Tuple, torch.Tensor],
                hosts: Dict[Tuple, Any], copier) -> torch.Tensor:
        buf = slot.buffers.get(path)
        hb = slot.hosts.get(path)
        if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                or (hb.copier if hb is not None else None) is not copier):
            buf, hb = _aligned_empty(t.shape, t.dtype, copier)
            self.allocations += 1
        used[path] = buf
        if hb is not None:
            hosts[path] = hb
        return buf

    def _copy(self, path, t: torch.Tensor, slot, used, pending) -> torch.Tensor:
        hosts, copies = pending
        t = t.detach()
        copier = _host_staging.copier_for(t)
        buf = self._buffer(path, t, slot, used, hosts, copier)
        if copier is not None:
            if t.numel():
                src = copier.contiguous(t)
                copies.append((buf.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)))
        else:
            buf.copy_(t)
        return buf

    def _walk(self, obj: Any, path: Tuple, slot: _Slot, used, pending) -> Any:
        DTensor = _dtensor_type()
        if DTensor is not None and isinstance(obj, DTensor):
            local = self._copy(path, obj._local_tensor, slot, used, pending)
            return DTensor(local, obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided:
                return self._copy(path, obj, slot, used, pending)
            # ShardedTensor and other tensor types: torch's own staging, no reuse
            from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
            staged = _create_cpu_state_dict({"v": obj})
            return _copy_state_dict({"v": obj}, staged)["v"]
        if isinstance(obj, dict):
            out = type(obj)() if type(obj) in (dict, collections.OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self._walk(v, path + (k,), slot, used, pending)
            return out
        if isinstance(obj, list):
            return [self._walk(v, path + (i,), slot, used, pending) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            vals = [self._walk(v, path + (i,), slot, used, pending) for i, v in enumerate(obj)]
            return type(obj)(*vals) if hasattr(obj, "_fields") else tuple(vals)
        if isinstance(obj, _IMMUTABLE):
            return obj
        if isinstance(obj, io.BytesIO):
            return io.BytesIO(obj.getvalue())
        return copy.deepcopy(obj)
