"""One rank of test_ddp_resume.py::test_sharded_manager_two_ranks (gloo, CPU): sharded
save, load, fallback from a damaged checkpoint, asynchronous sharded saves; an
EIO on one rank propagates on every rank (no fallback); a rollback makes
`latest` authoritative and sets the newer steps aside; the job ends with
destroy_process_group() and no gc.collect()/close().

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    python sharded_worker.py CKPT_DIR
Rank 0 prints "ok" at the end; any failed check raises (non-zero exit).
"""
import errno
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fastckpt import CheckpointManager


def main(ckpt: str) -> None:
    dist.init_process_group("gloo")
    run(ckpt)
    # No gc.collect() or close() before this: the manager frees its
    # own gloo group at exit, before interpreter finalization, by itself.
    dist.destroy_process_group()


def run(ckpt: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))

    def state(v):
        full = torch.arange(64, dtype=torch.float32).reshape(16, 4) + v
        return {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.full((3,), float(v))},
                "step": v}

    def check(expected, got):
        assert torch.equal(expected["model"]["w"].to_local(), got["model"]["w"].to_local())
        assert torch.equal(expected["model"]["b"], got["model"]["b"])
        assert expected["step"] == got["step"], (expected["step"], got["step"])

    mgr = CheckpointManager(ckpt, keep_last=2, sharded=True)
    assert mgr.load_latest(state=state(0)) is None
    for v in (1, 2, 3):
        mgr.save(v, state(v))
    names = sorted(os.listdir(os.path.join(ckpt, "step_00000003")))
    assert ".metadata" in names and {f"__{r}_0.distcp" for r in range(world)} <= set(names), names
    assert mgr.steps() == [2, 3], mgr.steps()
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "step_00000003\n"

    target = state(0)
    r = mgr.load_latest(state=target)
    assert r.step == 3 and r.state is target
    check(state(3), target)

    # Damage rank 1's shard of the newest checkpoint: every rank falls back to step 2.
    dist.barrier()
    if rank == 0:
        shard = os.path.join(ckpt, "step_00000003", "__1_0.distcp")
        os.truncate(shard, os.path.getsize(shard) // 2)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = mgr.load_latest(state=state(0))
    assert r.step == 2, r.step
    check(state(2), r.state)
    assert any("skipping checkpoint" in str(w.message) and "step_00000003" in str(w.message) for w in caught)

    # Asynchronous sharded saves: staged on return, written in the background (on the
    # manager's own gloo group) while this thread runs collectives of its own.
    src = state(4)
    fut = mgr.async_save(4, src)
    src["model"]["w"].to_local().mul_(-1)  # after staging: must not reach the checkpoint
    src["model"]["b"].zero_()
    for _ in range(20):
        t = torch.ones(1000)
        dist.all_reduce(t)
        assert t[0].item() == world
    fut.result(timeout=60)
    mgr.async_save(5, state(5))
    mgr.wait()
    assert mgr.steps() == [4, 5], mgr.steps()
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "step_00000005\n"
    r = mgr.load_latest(state=state(0))
    assert r.step == 5
    check(state(5), r.state)
    target = state(0)
    from torch.distributed.checkpoint import load
    from fastckpt.dcp import FastReader
    load(target, storage_reader=FastReader(os.path.join(ckpt, "step_00000004")))
    check(state(4), target)
    assert not [n for n in os.listdir(ckpt) if ".fastckpt-tmp." in n]

    # EIO while rank 1 reads step 5 is not damage: every rank raises,
    # nobody falls back to step 4.
    from fastckpt import _C
    if rank == 1:
        _C.fault_inject("read", nth=1, errno=errno.EIO, times=0, path_contains="step_00000005")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        try:
            mgr.load_latest(state=state(0))
        except OSError as e:
            assert e.errno == errno.EIO, e
        else:
            raise AssertionError("load_latest fell back or succeeded despite EIO")
    _C.fault_clear()
    dist.barrier()

    # a rollback (step 1 after 4, 5): `latest` names step 1, load_latest
    # loads it on every rank, steps 4 and 5 are set aside in abandoned/.
    mgr.save(1, state(11))
    r = mgr.load_latest(state=state(0))
    assert r.step == 1, r.step
    check(state(11), r.state)
    assert mgr.steps() == [1], mgr.steps()
    assert sorted(os.listdir(os.path.join(ckpt, "abandoned"))) == ["step_00000004", "step_00000005"]

    dist.barrier()
    if rank == 0:
        print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
