"""One rank of test_memory_sharded.py (gloo, CPU, one node): a sharded CheckpointManager with a
memory tier. Snapshots of DTensor state (each rank its shard), a restart restoring them in place
from memory, a shard that no longer fits (another placement) falling back to the disk.

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    python memory_sharded_worker.py CKPT_DIR
Prints "OK" at the end; any failed check raises."""
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fastckpt

ckpt = sys.argv[1]
dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


def state(v, placement=Shard(0)):
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4) + v
    return {"model": {"w": distribute_tensor(full, mesh, [placement]), "b": torch.full((3,), float(v))},
            "step": v, "note": f"v{v}"}


def check(want, got):
    assert torch.equal(want["model"]["w"].to_local(), got["model"]["w"].to_local())
    assert torch.equal(want["model"]["b"], got["model"]["b"])
    assert (want["step"], want["note"]) == (got["step"], got["note"]), (got["step"], got["note"])


mgr = fastckpt.CheckpointManager(ckpt, keep_last=2, sharded=True, memory=fastckpt.MemoryTier(keep=2))
mgr.save(1, state(1))
mgr.snapshot(2, state(2))
mgr.snapshot(3, state(3))
mgr._memory.wait()
dist.barrier()

again = fastckpt.CheckpointManager(ckpt, keep_last=2, sharded=True, memory=fastckpt.MemoryTier(keep=2))
target = state(0)
w_local = target["model"]["w"].to_local()
r = again.load_latest(state=target)
assert r.step == 3 and r.state is target and "/rank" in r.path, (r.step, r.path)
check(state(3), target)
assert target["model"]["w"].to_local().data_ptr() == w_local.data_ptr()  # filled in place

# the same state laid out otherwise (replicated): the snapshots do not fit; the disk's step 1 loads
other = fastckpt.CheckpointManager(ckpt, keep_last=2, sharded=True, memory=fastckpt.MemoryTier(keep=2))
target = state(0, Replicate())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r = other.load_latest(state=target)
assert r.step == 1 and "step_00000001" in r.path, (r.step, r.path)
check(state(1, Replicate()), target)
assert any("could not be restored" in str(w.message) for w in caught), [str(w.message) for w in caught]
other.close()
dist.destroy_process_group()
print("OK", flush=True)
