"""A simulated device for the staging pipeline's tests (no GPU needed).

Tensors "on" ``sim:k`` are CPU tensors that the simulator registers by
storage pointer. Copies to and from them are applied LATE and OUT OF ORDER by
a background thread (random delays; with ``spontaneous=False`` only when an
event that covers them is synchronized); until then the destination holds
poison bytes. Events are per device and stream: one recorded on sim:0's
stream covers only copies issued on that stream before it.

The simulator checks the staging discipline and raises
:class:`StagingViolation` (also recorded in ``violations``) when

* a host buffer is handed to the disk writer (``check_ready``) while a copy
  into it is pending;
* a host buffer is given back for reuse or freed (``check_idle``) while a
  copy into or out of it is pending;
* a new copy targets a host range that a pending copy still writes.

``copy_`` / ``record_event`` are torch-like primitives (the copy on the
tensor's device's *current* stream, the event on the *current device's*
current stream) to express code written against torch.cuda's API, e.g. the
old FastWriter discipline.
"""

import random
import re
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from fastckpt.staging import device as _staging

POISON = 0xA5


class StagingViolation(AssertionError):
    pass


def _range(t) -> Tuple[int, int]:
    if isinstance(t, torch.UntypedStorage):
        return t.data_ptr(), t.data_ptr() + t.nbytes()
    p = t.data_ptr()
    return p, p + t.numel() * t.element_size()


def _overlap(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] != a[1] and b[0] != b[1]


class _Op:
    __slots__ = ("id", "dst", "src", "dst_range", "src_range", "stream", "due", "done", "host_dst")

    def __init__(self, oid, dst, src, stream, due, host_dst):
        self.id, self.dst, self.src, self.stream, self.due = oid, dst, src, stream, due
        self.dst_range, self.src_range = _range(dst), _range(src)
        self.done = False
        self.host_dst = host_dst


class SimEvent:
    def __init__(self, sim: "SimDevice", ops: List[_Op]):
        self.sim, self.ops = sim, ops

    def query(self) -> bool:
        with self.sim._cv:
            return all(o.done for o in self.ops)

    def synchronize(self) -> None:
        self.sim._demand(self.ops)


class SimDevice(_staging.DeviceCopier):
    def __init__(self, seed: int = 0, max_delay: float = 0.002, spontaneous: bool = True):
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.spontaneous = spontaneous
        self.current_device = 0
        self.violations: List[str] = []
        self._where: Dict[int, int] = {}      # storage pointer -> device index
        self._keep: List[Any] = []            # device storages (so pointers are not reused)
        self._ops: List[_Op] = []             # pending copies
        self._streams: Dict[Tuple[int, str], List[_Op]] = {}
        self._next = 0
        self._cv = threading.Condition()
        self._stop = False
        self.copies = 0
        self.to_host_bytes = 0                # bytes copied device -> host (to_host_async)
        self.locked_bytes = 0                 # host bytes page-locked through this device now
        self.peak_locked_bytes = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="sim-device")
        self._thread.start()

    # -- context

    def __enter__(self):
        self._reg = _staging.register(self)
        self._reg.__enter__()
        return self

    def __exit__(self, *exc):
        self._reg.__exit__(*exc)
        self.close()

    def close(self) -> None:
        with self._cv:
            for o in self._ops:
                o.due = 0.0
            self._cv.notify_all()
            while self._ops:
                self._cv.wait(0.05)
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    # -- device memory

    def tensor(self, t: torch.Tensor, device: int) -> torch.Tensor:
        """A copy of CPU tensor `t` that lives on sim:`device`."""
        d = t.detach().clone()
        self._register(d.untyped_storage(), device)
        return d

    def _register(self, st: torch.UntypedStorage, device: int) -> None:
        if st.nbytes():
            self._where[st.data_ptr()] = device
            self._keep.append(st)

    def device_index(self, t) -> Optional[int]:
        st = t if isinstance(t, torch.UntypedStorage) else t.untyped_storage()
        if st.device.type != "cpu" or not st.nbytes():
            return getattr(st, "_sim_device", None) if st.device.type == "cpu" else None
        return self._where.get(st.data_ptr())

    def to_device(self, st: torch.UntypedStorage, device: int) -> torch.UntypedStorage:
        """For map_location callables: `st` moved to sim:`device`, synchronously."""
        out = torch.UntypedStorage(st.nbytes())
        if st.nbytes():
            out.copy_(st)
            self._register(out, device)
        else:
            out._sim_device = device
            self._keep.append(out)
        return out

    # -- the copier interface

    def owns(self, t) -> bool:
        try:
            return self.device_index(t) is not None
        except Exception:
            return False

    def contiguous(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return t
        out = t.contiguous()
        self._register(out.untyped_storage(), self._dev(t))
        return out

    def device_key(self, t) -> Any:
        return f"sim:{self.device_index(t)}"

    def device_for(self, location: Any) -> Optional[Any]:
        m = re.fullmatch(r"sim:(\d+)", str(location))
        return f"sim:{m.group(1)}" if m else None

    def empty_device(self, nbytes: int, device: Any) -> torch.UntypedStorage:
        st = torch.UntypedStorage(nbytes)
        if nbytes:
            torch.empty(0, dtype=torch.uint8).set_(st).fill_(POISON)
        self._register(st, int(str(device).split(":")[1]))
        return st

    def _dev(self, t) -> int:
        k = self.device_index(t)
        if k is None:
            raise AssertionError("sim: not a sim tensor")
        return k

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor) -> SimEvent:
        op = self._issue(dst, src, (self._dev(src), "copy"), host_dst=True)
        with self._cv:
            self.to_host_bytes += dst.numel() * dst.element_size()
        return self._event_on(op.stream)

    def to_device_async(self, dst: torch.Tensor, src: torch.Tensor) -> SimEvent:
        op = self._issue(dst, src, (self._dev(dst), "copy"), host_dst=False)
        return self._event_on(op.stream)

    def _lock_pages(self, t: torch.Tensor):
        n = t.numel()
        with self._cv:
            self.locked_bytes += n
            self.peak_locked_bytes = max(self.peak_locked_bytes, self.locked_bytes)

        def undo():
            with self._cv:
                self.locked_bytes -= n
        return undo

    def check_ready(self, view: torch.Tensor) -> None:
        r = _range(view)
        with self._cv:
            bad = [o for o in self._ops if o.host_dst and _overlap(o.dst_range, r)]
        if bad:
            self._violate(f"host bytes handed to the writer while {len(bad)} copy(ies) into them are pending")

    def check_idle(self, view: torch.Tensor) -> None:
        r = _range(view)
        with self._cv:
            bad = [o for o in self._ops if (o.host_dst and _overlap(o.dst_range, r))
                   or (not o.host_dst and _overlap(o.src_range, r))]
        if bad:
            self._violate(f"host buffer reused or released while {len(bad)} copy(ies) using it are pending")

    # -- torch.cuda-like primitives (to express code written against that API)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)``: on the current stream of the sim tensor's device."""
        host_dst = self.device_index(dst) is None
        self._issue(dst.view(-1).view(torch.uint8) if dst.numel() else dst,
                    src.reshape(-1).view(torch.uint8) if src.numel() else src,
                    (self._dev(src if host_dst else dst), "current"), host_dst)

    def record_event(self, device: Optional[int] = None, stream: str = "current") -> SimEvent:
        """``torch.cuda.Event().record()``: on the current device's current stream."""
        return self._event_on((self.current_device if device is None else device, stream))

    # -- machinery

    def _violate(self, msg: str) -> None:
        self.violations.append(msg)
        raise StagingViolation(msg)

    def _issue(self, dst, src, stream, host_dst: bool) -> _Op:
        with self._cv:
            self._next += 1
            due = time.monotonic() + self.rng.random() * self.max_delay if self.spontaneous else float("inf")
            op = _Op(self._next, dst, src, stream, due, host_dst)
            clash = [o for o in self._ops if o.host_dst and _overlap(o.dst_range, op.dst_range)] if host_dst else []
            self._ops.append(op)
            self._streams.setdefault(stream, []).append(op)
            self.copies += 1
            dst.fill_(POISON)  # what the destination holds until the copy lands
            self._cv.notify_all()
        if clash:
            self._violate("a copy into a host buffer was issued while an earlier copy into it is pending")
        return op

    def _event_on(self, stream) -> SimEvent:
        with self._cv:
            ops = [o for o in self._streams.get(stream, []) if not o.done]
            self._streams[stream] = ops
        return SimEvent(self, ops)

    def _demand(self, ops: List[_Op]) -> None:
        with self._cv:
            now = time.monotonic()
            for o in ops:
                if not o.done:
                    o.due = min(o.due, now + self.rng.random() * 1e-4)
            self._cv.notify_all()
            while not all(o.done for o in ops):
                self._cv.wait(0.05)

    def _run(self) -> None:
        with self._cv:
            while not self._stop:
                if not self._ops:
                    self._cv.wait(0.05)
                    continue
                op = min(self._ops, key=lambda o: o.due)
                now = time.monotonic()
                if op.due > now:
                    self._cv.wait(min(op.due - now, 0.05))
                    continue
                op.dst.copy_(op.src)
                op.done = True
                self._ops.remove(op)
                self._cv.notify_all()
