"""The exchange of a collective load's shares over the process group
(fastckpt/_collective_load.py decides who reads what, and when; this module
moves the bytes).

* What the group's backend carries: ``torch.distributed.get_backend`` ->
  device type -> backend; :class:`DeviceOps` for a backend that carries
  device tensors (NCCL: :class:`_NcclOps`), chosen by :data:`device_ops` (a
  test hook: the tests drive it with the simulated device).
* :class:`HostExchange`: a result in host memory, broadcast in place.
* :class:`StagedRun`: a result on a device, round by round through the
  staging pipeline (fastckpt.staging.todevice.RoundRing of pool chunks, the device's copier),
  staged through host memory (gloo) or with device collectives (NCCL).
"""

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..staging import device as _staging
from ..staging.todevice import RoundRing
from .group import Group

log = logging.getLogger("fastckpt")

# A piece of at least this many bytes is broadcast in place; smaller ones are
# packed into buffers of about _PACK_BYTES (one collective each).
_INPLACE_MIN = 1 << 20
_PACK_BYTES = 16 << 20
# Staged: _DEPTH rounds' host buffers in use at once (one being read, one
# broadcast, one copied to the device).
_DEPTH = 3


# ---------------------------------------------------------------- what the group's backend carries

def backend_name(dist, group) -> str:
    """The group's backend, as torch.distributed names it ("gloo", "nccl",
    "cpu:gloo,cuda:nccl")."""
    return str(dist.get_backend(group))


def backends_of(backend: str) -> Dict[str, str]:
    """Device type -> the backend that carries its tensors in this group."""
    b = backend.lower()
    if ":" in b:
        return dict((d.strip(), n.strip()) for d, _, n in (pair.partition(":") for pair in b.split(",")))
    import torch.distributed as dist
    caps = getattr(dist.Backend, "backend_capability", {}) or {}
    devices = caps.get(b) or (["cpu"] if b in ("gloo", "mpi", "ucc") else [])
    return {d: b for d in devices}


class DeviceOps:
    """What the device-collectives transport asks of a backend that carries
    device tensors (NCCL). Every tensor is a uint8 tensor on one device of
    the rank."""

    def broadcast(self, t: torch.Tensor, src: int, group) -> Any:
        """Broadcast `t` from global rank `src`, asynchronously: a work with
        ``wait()``, after which the device's later work sees the bytes."""
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Device-to-device copy, ordered after the waited broadcast that filled `src`."""
        raise NotImplementedError

    def empty(self, nbytes: int) -> torch.Tensor:
        """A device buffer of `nbytes`."""
        raise NotImplementedError


class _NcclOps(DeviceOps):
    """NCCL: torch's stream semantics order everything. The copier's copy to
    the device makes the current stream wait for it, the broadcast's stream
    waits for the current stream when issued, and ``wait()`` makes the
    current stream wait for the broadcast (copies out then run after it)."""

    def __init__(self, device):
        self.device = device

    def broadcast(self, t, src, group):
        import torch.distributed as dist
        return dist.broadcast(t, src=src, group=group, async_op=True)

    def copy(self, dst, src):
        dst.copy_(src, non_blocking=True)

    def empty(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


def _default_device_ops(backends: Dict[str, str], copier: "_staging.DeviceCopier", device) -> Optional[DeviceOps]:
    if isinstance(copier, _staging.CudaCopier) and backends.get("cuda") == "nccl":
        return _NcclOps(device)
    return None


# (backends, copier, device) -> DeviceOps, or None where the group's backend
# does not carry that device's tensors. Tests replace it to drive the
# device-collectives transport on the simulated device.
device_ops: Callable[[Dict[str, str], "_staging.DeviceCopier", Any], Optional[DeviceOps]] = _default_device_ops


def unfit(path: str, backend: str, backends: Dict[str, str], map_location) -> Optional[ValueError]:
    """The error for a map_location (string or torch.device) whose tensors the
    group's backend carries neither on the device nor through host memory
    (known before the file is opened)."""
    if "cpu" in backends or not isinstance(map_location, (str, torch.device)):
        return None
    found = _staging.copier_for_location(map_location)
    if found is None:
        try:
            if torch.device(map_location).type != "cpu":
                return None  # not a device the staging knows: torch's own rules decide later
        except (RuntimeError, TypeError, ValueError):
            return None
        where = "CPU"
    elif device_ops(backends, *found) is None:
        where = str(found[1])
    else:
        return None
    return cannot_carry(path, backend, f"{where} tensors (map_location={map_location!r})")


def cannot_carry(path: str, backend: str, what: str) -> ValueError:
    return ValueError(f"cannot load {path!r} with group=: the group's backend {backend!r} does not carry {what}; "
                      "pass a gloo group (torch.distributed.new_group(backend='gloo')) or a map_location onto the "
                      "devices the group's backend carries; nothing was loaded")


# ---------------------------------------------------------------- host result: in place

class HostExchange:
    """The broadcasts of step 4 for a result in host memory (a backend that
    carries CPU tensors), issued asynchronously and waited for together."""

    def __init__(self, g: Group):
        self.g = g
        self.works: List[Any] = []
        self.after: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []  # (received, destinations) to copy out

    def send(self, src: int, parts: List[torch.Tensor]) -> None:
        """Broadcast from group rank `src` the concatenation of `parts` (uint8
        views of the destinations, on every rank)."""
        if len(parts) == 1:
            buf = parts[0]  # in place, on every rank
        elif self.g.rank == src:
            buf = torch.cat(parts)
        else:
            buf = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8)
            self.after.append((buf, parts))
        self.works.append(self.g.dist.broadcast(buf, src=global_rank(self.g, src), group=self.g.group, async_op=True))

    def wait(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except Exception as e:
            raise self.g.lost(e, "the exchange of the shares") from e
        for buf, parts in self.after:
            off = 0
            for p in parts:
                p.copy_(buf[off:off + p.numel()])
                off += p.numel()


def global_rank(g: Group, r: int) -> int:
    return g.dist.get_global_rank(g.group, r) if g.group is not None else r


# ---------------------------------------------------------------- device result: staged

class Dest:
    """Where this rank puts a record's bytes: a uint8 view of the result's
    storage and the storage's copier (None: host memory)."""
    __slots__ = ("view", "copier")

    def __init__(self, storage, copier):
        self.view = _staging.bytes_view(storage)
        self.copier = copier


# The copier of host buffers for a rank whose result stays on the host in a
# staged exchange (nothing to page-lock: no device copies from them).
HOST_COPIER = _staging.DeviceCopier()


def _used(part: List[Tuple[str, int, int, int]]) -> int:
    """Bytes of a part's region (up to its last piece's end)."""
    return part[-1][3] + part[-1][2] if part else 0


class StagedRun:
    """Step 4 of a collective load whose result is (in part) on a device:
    `rounds[j][k]` is holder k's part of round j, [(record, offset, length,
    at: its place in the part's region)], every region within `part` bytes;
    `chunk` the ring's pool chunk (the same on every rank); `reader` reads this
    rank's share with the engine (a fastckpt.torchsave.reader.Records on the file)."""

    def __init__(self, g: Group, path: str, holders: List[int], k_mine: int, reader, verify: Optional[bool],
                 rounds, part: int, chunk: int):
        self.g, self.path, self.holders, self.k_mine = g, path, holders, k_mine
        self.reader, self.verify = reader, verify
        self.rounds, self.part, self.chunk = rounds, part, chunk

    def run(self, dests: Dict[str, Dest], copier, ops: Optional[DeviceOps]):
        """Round by round: holders read into the ring, broadcasts of round j
        run while round j+1 is read, then round j goes to the destinations
        (`dests`: record -> Dest on this rank; `copier`: the ring's; `ops`:
        device collectives, or None: staged through host memory). Returns
        (this holder's piece CRCs in round order, or None; this rank's error)."""
        H = len(self.holders)
        chunk, part, rounds = self.chunk, self.part, self.rounds
        per_buf = chunk // part  # regions per pool buffer
        mine = self.k_mine
        crcs: Optional[List[Any]] = [] if mine >= 0 else None
        state = {"err": None}
        ring = None
        if ops is None:  # every rank receives into the ring
            ring = RoundRing(copier, -(-H // per_buf), _DEPTH, chunk)
        elif mine >= 0:  # only holders stage (their own part)
            ring = RoundRing(copier, 1, _DEPTH, chunk)
        where = str(copier.device_key(next(d.view for d in dests.values() if d.copier is copier and d.view.numel()))) \
            if copier is not HOST_COPIER else "cpu"
        pending = None
        done = False
        try:
            for rnd in rounds:
                bufs = None
                if ops is None or (mine >= 0 and rnd[mine]):
                    bufs = ring.next(lambda e: self._fail(state, e, where))
                region = self._region(bufs, mine, rnd, per_buf, part, ops) if mine >= 0 and rnd[mine] else None
                if region is not None and state["err"] is None:
                    try:
                        crcs += self.reader.read_into([(n, off, region[at:at + ln], self.verify is not False)
                                                       for n, off, ln, at in rnd[mine]])
                    except Exception as e:
                        state["err"] = e
                if ops is None:
                    regions = [self._region(bufs, k, rnd, per_buf, part, None) for k in range(H)]
                    works = [self.g.dist.broadcast(regions[k], src=global_rank(self.g, src), group=self.g.group,
                                                   async_op=True) for k, src in enumerate(self.holders) if rnd[k]]
                    step = (works, lambda rnd=rnd, regions=regions, bufs=bufs:
                            self._place(rnd, regions, bufs, per_buf, dests, state))
                else:
                    step = self._device_round(rnd, region, bufs, dests, ops, state)
                if pending is not None:
                    self._complete(pending)
                pending = step
            if pending is not None:
                self._complete(pending)
            done = True
        finally:
            if ring is not None:
                try:
                    ring.close()  # waits for the copies in flight
                except Exception as e:
                    if not done:
                        log.warning("fastckpt: %s: after an error, a copy to %s failed too: %s", self.path, where, e)
                    else:  # this rank's failure, said in the exchange after the broadcasts
                        self._fail(state, e, where)
        return crcs, state["err"]

    @staticmethod
    def _region(bufs, k: int, rnd, per_buf: int, part: int, ops) -> torch.Tensor:
        """Holder k's region of this round in the ring's buffers (device
        collectives: the holder's own part in its one buffer)."""
        if ops is not None:
            return bufs[0].hb.tensor[:_used(rnd[k])]
        at = (k % per_buf) * part
        return bufs[k // per_buf].hb.tensor[at:at + _used(rnd[k])]

    def _complete(self, step) -> None:
        works, then = step
        try:
            for w in works:
                w.wait()
        except Exception as e:
            raise self.g.lost(e, "the exchange of the shares") from e
        then()

    def _fail(self, state, e: BaseException, where) -> None:
        """The first failure of a copy on this rank: it still takes part in every broadcast."""
        if state["err"] is None:
            state["err"] = e if isinstance(e, OSError) else RuntimeError(
                f"cannot load {self.path!r}: copying its bytes to {where} failed ({type(e).__name__}: {e}); "
                "nothing was loaded")

    def _place(self, rnd, regions, bufs, per_buf: int, dests: Dict[str, Dest], state) -> None:
        """Staged through host memory: round `rnd`, received, to the destinations."""
        for k, part in enumerate(rnd):
            for n, off, ln, at in part:
                d = dests.get(n)
                if d is None or state["err"] is not None:
                    continue
                src = regions[k][at:at + ln]
                try:
                    if d.copier is None:
                        d.view[off:off + ln].copy_(src)
                    else:
                        bufs[k // per_buf].events.append(d.copier.to_device_async(d.view[off:off + ln], src))
                except Exception as e:
                    self._fail(state, e, d.copier.device_key(d.view) if d.copier is not None else "cpu")

    def _device_round(self, rnd, region, bufs, dests: Dict[str, Dest], ops: DeviceOps, state):
        """Device collectives: the holder copies its part from the ring to its
        own storages (and its small pieces to a packed device buffer); large
        pieces are broadcast in place, the packed ones copied out after."""
        works: List[Any] = []
        out: List[Tuple[torch.Tensor, List[Tuple[torch.Tensor, int]]]] = []
        for k, part in enumerate(rnd):
            mine = k == self.k_mine
            packed, size = [], 0
            for n, off, ln, at in part:
                if ln < _INPLACE_MIN:
                    size = -(-size // _staging.PACK_ALIGN) * _staging.PACK_ALIGN
                    packed.append((n, off, ln, at, size))
                    size += ln
            pack = ops.empty(size) if packed else None
            if mine and state["err"] is None:
                try:
                    for n, off, ln, at in part:
                        d = dests[n]
                        bufs[0].events.append(d.copier.to_device_async(d.view[off:off + ln], region[at:at + ln]))
                    for n, off, ln, at, p in packed:
                        bufs[0].events.append(dests[n].copier.to_device_async(pack[p:p + ln], region[at:at + ln]))
                except Exception as e:
                    self._fail(state, e, dests[part[0][0]].copier.device_key(dests[part[0][0]].view))
            src = global_rank(self.g, self.holders[k])
            for n, off, ln, at in part:
                if ln >= _INPLACE_MIN:
                    works.append(ops.broadcast(dests[n].view[off:off + ln], src, self.g.group))
            if pack is not None:
                works.append(ops.broadcast(pack, src, self.g.group))
                if not mine:
                    out.append((pack, [(dests[n].view[off:off + ln], p) for n, off, ln, _, p in packed]))

        def copy_out():
            if state["err"] is not None:
                return
            try:
                for pack, targets in out:
                    for view, p in targets:
                        ops.copy(view, pack[p:p + view.numel()])
            except Exception as e:
                self._fail(state, e, "the device")
        return works, copy_out
