"""One rank of a collective load (tests/python/collective/test_collective_load.py).

    python collective_load_worker.py STORE RANK WORLD PATH CASE MODE

Joins a gloo group through a FileStore, loads PATH with group= and compares
what it got with collective_worker.build(CASE); prints "READ <bytes>" (the
storage bytes this rank read from the file) and, last, "OK" or
"ERR <type>: <message>". MODE: ok; missing1 (rank 1's path does not exist: it
gets everything from its peers); missing_all (no rank's path exists); other1
(rank 1 loads PATH + ".other", a different file); fault (rank 1's share reads
fail with EIO); kill (rank 1 SIGKILLs itself after reading its share, before
the collective that reports it); kill_exchange (the same, after that
collective, while the shares are broadcast); cuda_map (map_location=
"cuda:0" on a machine without CUDA: every rank raises torch's error);
meta (map_location="meta"); unsafe (weights_only=False).

Modes onto the simulated device (tests/python/collective/test_collective_load_device.py;
rank r loads with map_location="sim:<r % 2>" and compares with a plain CPU load
of the file; prints "STATS {...}" and "ORDER <r/w...>": this rank's reads of
its share (r) and waits for broadcasts (w), in order):
sim (the group's real backend, gloo: staged through host memory); sim_nccl
(the backend reported as "nccl" and a test-only DeviceOps that carries sim
tensors: a broadcast of a sim tensor is gloo's broadcast of its memory after
the copies issued to its device landed, as NCCL's stream waits for the current
one); sim_missing1 / sim_nccl_missing1 (rank 1 has no file: it reads
nothing and gets every byte from its peers); sim_mixed (rank 1 loads with map_location="cpu"); sim_fail /
sim_nccl_fail (rank 1's 3rd copy to the device raises); sim_sync_fail (rank
1's 3rd copy fails when its event is waited for, as CUDA reports it); nccl_cpu (the
backend reported as "nccl", map_location="cpu") and nccl_sim (the same, onto
sim:<r % 2>, without the test DeviceOps): errors before the file is opened
("OPENED <n>": how often this rank opened the file).
On a machine with CUDA (benchmarks/gpu_check.sh): gpu_nccl (an NCCL group,
map_location="cuda:0": device collectives) and gpu_gloo (a gloo group,
map_location="cuda:0": staged through host memory); each compares with a
plain CPU load and prints "STATS {...}" with the process's peak host RSS.
CASE "large" (only here): about 64 MB in a few large tensors and 300 small ones.
"""
import datetime
import errno
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support
from workers import collective_worker  # noqa: E402



def _kind(e: BaseException) -> str:
    """The error's type as the tests read it: fastckpt.errors.RanksFailed (another
    rank failed) is the OSError (EIO) it is, so the ERR lines say OSError."""
    from fastckpt.errors import RanksFailed
    return "OSError" if type(e) is RanksFailed else type(e).__name__

def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and (b.device.type == "meta" or torch.equal(a, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def build(case: str):
    if case != "large":
        return collective_worker.build(case)
    g = torch.Generator().manual_seed(99)
    out = {"a": torch.randn(8 << 20, generator=g), "b": torch.randn(2 << 20, generator=g, dtype=torch.float64),
           "c": torch.randint(0, 255, (5 << 20,), generator=g, dtype=torch.uint8),
           "d": torch.randn(3000, 1001, generator=g).half(), "step": 12}
    out["small"] = [torch.randn(1 + i % 97, generator=g) for i in range(300)]
    out["a_view"] = out["a"][100:5000]
    return out


SIM_MODES = ("sim", "sim_nccl", "sim_missing1", "sim_nccl_missing1", "sim_mixed", "sim_fail", "sim_nccl_fail", "sim_sync_fail", "nccl_sim")


def sim_setup(mode: str, rank: int, log):
    """The simulated device for `mode` and the load's map_location."""
    import torch.distributed as dist

    import sim_device
    from fastckpt.collective import exchange as _collective_exchange

    class FailingSim(sim_device.SimDevice):
        def to_device_async(self, dst, src):
            self.uploads = getattr(self, "uploads", 0) + 1
            ev = super().to_device_async(dst, src)
            if self.uploads == 3 and mode == "sim_sync_fail":  # as CUDA says it: when the copy is waited for

                class Failed(sim_device.SimEvent):
                    def synchronize(self):
                        super().synchronize()
                        raise RuntimeError("sim: the copy engine failed")
                return Failed(self, ev.ops)
            if self.uploads == 3:
                raise RuntimeError("sim: the copy engine failed")
            return ev

    fails = mode in ("sim_fail", "sim_nccl_fail", "sim_sync_fail") and rank == 1
    sim = (FailingSim if fails else sim_device.SimDevice)(seed=rank)
    sim.__enter__()
    moved = [0]
    upload = sim.to_device_async

    def counted(dst, src):
        moved[0] += src.numel()
        return upload(dst, src)
    sim.to_device_async = counted
    sim.moved = moved

    class SimOps(_collective_exchange.DeviceOps):
        """Carries sim tensors: gloo's broadcast of their memory, after every
        copy already issued to the device landed (as NCCL's stream waits for
        the current stream, which waits for the copier's events)."""

        def __init__(self, device):
            self.index = int(str(device).split(":")[1])

        def _settle(self, *ts):
            for t in ts:
                if sim.device_index(t) != self.index:
                    sim._violate(f"device collective on a tensor not on sim:{self.index}")
            with sim._cv:
                ops = [o for o in sim._ops if not o.host_dst and o.stream[0] == self.index]
            sim._demand(ops)

        def broadcast(self, t, src, group):
            self._settle(t)
            return dist.broadcast(t, src=src, group=group, async_op=True)

        def copy(self, dst, src):
            self._settle(dst, src)
            dst.copy_(src)

        def empty(self, nbytes):
            return torch.empty(0, dtype=torch.uint8).set_(sim.empty_device(nbytes, f"sim:{self.index}"))

    if mode.startswith("sim_nccl"):
        _collective_exchange.device_ops = lambda backends, copier, device: SimOps(device) if copier is sim else None
    if mode.startswith("sim_nccl"):
        _collective_exchange.backend_name = lambda dist, group: "nccl"
    # The order of this rank's reads of its share and waits for broadcasts.
    broadcast = dist.broadcast

    def logged(*args, **kwargs):
        w = broadcast(*args, **kwargs)

        class Work:
            def wait(self):
                log.append("w")
                return w.wait()
        return Work()
    dist.broadcast = logged
    ml = "cpu" if mode == "sim_mixed" and rank == 1 else f"sim:{rank % 2}"
    return sim, ml


def sim_check(sim, got, path: str, rank: int, ml: str, case: str):
    """None, or what is wrong with `got` (the load onto `ml`)."""
    import fastckpt
    want = fastckpt.load(path.replace(".absent", ""))  # a plain load into host memory: what every rank must get
    if not same(want, got):
        return "the loaded object differs from a plain load"
    if not same(build(case), got):
        return "the loaded object differs from the saved one"
    tensors = [v for v in got.values() if isinstance(v, torch.Tensor)]
    tensors += [v for v in got.get("small", []) if isinstance(v, torch.Tensor)]
    for t in tensors:
        if not t.numel():
            continue
        where = sim.device_key(t) if sim.owns(t) else "cpu"
        if where != ml:
            return f"a tensor is on {where}, not {ml}"
    if sim.violations:
        return f"staging violations: {sim.violations}"
    return None


def gpu_main(path: str, case: str, rank: int) -> int:
    """gpu_nccl / gpu_gloo: the collective load onto cuda:0, checked against a plain CPU load."""
    import json
    import resource

    import torch.distributed as dist

    import fastckpt
    try:
        got = fastckpt.load(path, group=dist.group.WORLD, map_location="cuda:0")
        torch.cuda.synchronize()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        on = {v.device.type for v in got.values() if isinstance(v, torch.Tensor)}
        want = fastckpt.load(path)
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else [t.cpu() for t in v] if k == "small" else v
               for k, v in got.items()}
        print("STATS", json.dumps({"peak_rss": rss, "devices": sorted(on)}), flush=True)
        print("OK" if on == {"cuda"} and same(want, cpu) else "ERR mismatch: not the plain load's, or not on cuda",
              flush=True)
    except Exception as e:
        print(f"ERR {_kind(e)}: {e}", flush=True)
    dist.destroy_process_group()
    return 0


def main() -> int:
    store, rank, world, path, case, mode = sys.argv[1:7]
    rank, world = int(rank), int(world)
    import torch.distributed as dist

    import fastckpt
    from fastckpt import _C, serialization
    from fastckpt.collective import save as _collective

    if mode == "gpu_nccl":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if mode == "gpu_nccl" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=180))
    if mode.startswith("gpu_"):
        return gpu_main(path, case, rank)
    if (mode in ("missing1", "sim_missing1", "sim_nccl_missing1") and rank == 1) or mode == "missing_all":
        path += ".absent"
    if mode == "other1" and rank == 1:
        path += ".other"
    read = [0]
    read_into = fastckpt.torchsave.reader.Records.read_into

    def counting(self, items, fd=None, heads=None, fresh_huge=False):
        shares = [it for it in items if it[0].startswith("data/")]
        read[0] += sum(it[2].numel() for it in shares)
        if shares and mode == "fault" and rank == 1:
            _C.fault_inject("read", errno=errno.EIO, times=0)
        return read_into(self, items, fd, heads, fresh_huge)

    fastckpt.torchsave.reader.Records.read_into = counting
    log = []
    if mode in SIM_MODES or mode.startswith("nccl_"):
        from fastckpt._core import paths as _paths
        from fastckpt.staging import device as _staging
        opened = [0]
        open_for_reading = _paths.open_for_reading

        def counted_open(p):
            opened[0] += 1
            return open_for_reading(p)
        _paths.open_for_reading = counted_open
        host = [0]
        host_storages = fastckpt.torchsave.reader.host_storages

        def counted_host(records, runs, *rest):  # the host memory of a load's storages
            host[0] += sum(r[0] for r in records)
            return host_storages(records, runs, *rest)
        fastckpt.torchsave.reader.host_storages = counted_host

        def reading(self, items, fd=None, heads=None, fresh_huge=False):
            if any(it[0].startswith("data/") for it in items):
                log.append("r")
            return counting(self, items, fd, heads, fresh_huge)
        fastckpt.torchsave.reader.Records.read_into = reading
        sim, ml = sim_setup(mode, rank, log) if mode in SIM_MODES else (None, "cpu")
        if mode.startswith("nccl_"):  # the group's backend reported as NCCL's (the collectives still gloo's)
            from fastckpt.collective import exchange as _collective_exchange
            _collective_exchange.backend_name = lambda dist, group: "nccl"
    exchange = _collective.Group.exchange

    def dying(self, mine, err, what):
        if mode == "kill" and rank == 1 and what == "to read its share":
            os.kill(os.getpid(), signal.SIGKILL)
        out = exchange(self, mine, err, what)
        if mode == "kill_exchange" and rank == 1 and what == "to read its share":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    _collective.Group.exchange = dying
    kwargs = {}
    if mode == "cuda_map":
        kwargs["map_location"] = "cuda:0"
    if mode == "meta":
        kwargs["map_location"] = "meta"
    if mode == "unsafe":
        kwargs["weights_only"] = False
    if mode in SIM_MODES or mode.startswith("nccl_"):
        import json
        try:
            got = fastckpt.load(path, group=dist.group.WORLD, map_location=ml)
        except Exception as e:
            got, wrong = None, e
        # What the collective load did (before the plain load that checks it).
        print("READ", read[0], flush=True)
        print("OPENED", opened[0], flush=True)
        print("ORDER", "".join(log), flush=True)
        stats = {"peak_locked": sim and sim.peak_locked_bytes, "to_device": sim and sim.moved[0],
                 "host_storage": host[0], "chunk": _staging.default_chunk()}
        if got is not None:
            try:
                wrong = sim_check(sim, got, path, rank, ml, case)
            except Exception as e:
                wrong = e
        if sim is not None:
            sim.__exit__(None, None, None)
            stats["violations"] = sim.violations
        print("STATS", json.dumps(stats), flush=True)
        if isinstance(wrong, Exception):
            print(f"ERR {_kind(wrong)}: {wrong}", flush=True)
        else:
            print(f"ERR mismatch: {wrong}" if wrong else "OK", flush=True)
        dist.destroy_process_group()
        return 0
    try:
        got = fastckpt.load(path, group=dist.group.WORLD, **kwargs)
        print("READ", read[0], flush=True)
        want = collective_worker.build(case)
        if not same(want, got):
            print("ERR mismatch: the loaded object differs from the saved one", flush=True)
        elif case == "mixed" and mode != "meta" and \
                got["big_view"].untyped_storage().data_ptr() != got["big"].untyped_storage().data_ptr():
            print("ERR mismatch: a view lost its storage", flush=True)
        else:
            print("OK", flush=True)
    except Exception as e:
        print("READ", read[0], flush=True)
        print(f"ERR {_kind(e)}: {e}", flush=True)
    finally:
        _C.fault_clear()
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    collective_worker.run_main(main)
