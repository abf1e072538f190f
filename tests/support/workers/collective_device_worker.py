"""One rank of a collective save of state on the simulated device
(tests/python/collective/test_collective_device.py).

    python collective_device_worker.py STORE RANK WORLD PATH CASE MODE

Joins a gloo group through a FileStore, moves collective_worker.build(CASE)
onto sim:0 / sim:1 of a SimDevice of its own (tests/support/sim_device.py;
shared storages stay shared), saves it to PATH with group= under small
staging buffers, and prints

    HOST <bytes copied device -> host> <peak page-locked bytes> <pool bytes>
    LENT <staging buffers still lent>
    VIOLATIONS <count>

then "OK" or "ERR <type>: <message>" on its last line. MODE: ok; cpu_some
(every third storage stays on the CPU); fault (rank 1's engine writes fail
with EIO); fail_<stage>_<rank>: that rank's device copies fail (RuntimeError)
from the start (stage "sample"), once the temporary file exists ("share") or
once every share is written ("rest").
"""
import datetime
import errno
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support
from workers import collective_worker as worker  # noqa: E402
from sim_device import SimDevice  # noqa: E402

BUFFER_SIZE = 16 << 10  # the engine's buffer_size here: the staging pool's chunk is 4x this


class FailingSim(SimDevice):
    """A simulated device whose device-to-host copies raise once `fail` is set."""

    fail = False

    def to_host_async(self, dst, src):
        if self.fail:
            raise RuntimeError("sim: injected device copy failure")
        return super().to_host_async(dst, src)



def _kind(e: BaseException) -> str:
    """The error's type as the tests read it: fastckpt.errors.RanksFailed (another
    rank failed) is the OSError (EIO) it is, so the ERR lines say OSError."""
    from fastckpt.errors import RanksFailed
    return "OSError" if type(e) is RanksFailed else type(e).__name__

def to_sim(sim: SimDevice, obj, memo=None, cpu_some: bool = False):
    """`obj` with every tensor on sim:0 or sim:1 (alternating per storage;
    with `cpu_some`, every third storage stays on the CPU); tensors that share
    a storage on the host share one on the device."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = st._cdata  # the storage itself (empty ones share data_ptr 0)
        if key not in memo:
            where = len(memo) % (3 if cpu_some else 2)
            memo[key] = st if where == 2 else sim.to_device(st, where)
        return torch.empty(0, dtype=obj.dtype).set_(memo[key], obj.storage_offset(), obj.size(), obj.stride())
    if isinstance(obj, dict):
        return {k: to_sim(sim, v, memo, cpu_some) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_sim(sim, v, memo, cpu_some) for v in obj)
    return obj


def main() -> int:
    store, rank, world, path, case, mode = sys.argv[1:7]
    rank, world = int(rank), int(world)
    import torch.distributed as dist

    import fastckpt
    from fastckpt import _C, serialization
    from fastckpt.collective import save as _collective, stage as _collective_stage
    from fastckpt.staging import device as _staging

    fastckpt.formats.archive.new_serialization_id = lambda: worker.SID
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    fail_stage = None
    if mode.startswith("fail_"):
        _, stage, who = mode.split("_")
        fail_stage = stage if int(who) == rank else None
    with fastckpt.knobs.override(buffer_size=BUFFER_SIZE), FailingSim(seed=rank) as sim:
        obj = to_sim(sim, worker.build(case), cpu_some=mode == "cpu_some")
        if rank == 1 and mode == "fault":
            _C.fault_inject("write", errno=errno.EIO, times=0)
        if fail_stage is not None:
            after = {"sample": None, "share": "to create the temporary file", "rest": "to write its share"}[fail_stage]
            sim.fail = after is None
            exchange = _collective.Group.exchange

            def failing(self, mine, err, what):
                out = exchange(self, mine, err, what)
                if what == after:
                    sim.fail = True
                return out

            _collective.Group.exchange = failing
        try:
            fastckpt.save(obj, path, group=dist.group.WORLD)
            verdict = "OK"
        except Exception as e:
            verdict = f"ERR {_kind(e)}: {e}"
        finally:
            _C.fault_clear()
        pools = [_staging.pool_for(sim, 4 * BUFFER_SIZE), _staging.pool_for(sim, _collective_stage.check_chunk())]
        print("HOST", sim.to_host_bytes, sim.peak_locked_bytes, sum(p.chunk * p.count for p in pools), flush=True)
        print("LENT", sum(p._lent for p in pools), flush=True)
        print("VIOLATIONS", len(sim.violations), flush=True)
        print(verdict, flush=True)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    worker.run_main(main)
