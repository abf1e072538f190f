"""One rank of test_ddp_resume.py::test_collective_async_save (gloo, CPU, world size 2 or 3):
CheckpointManager.async_save in replicated mode with collective=True (the default).

Checked on every rank:
* every rank snapshots and writes its share in the background (its share of the
  storages' bytes is about 1/world of them, counted where the collective save cuts
  the shares); the state changed right after async_save returned does not reach the
  checkpoint; the file is the single-process fastckpt.save of the state at the
  snapshot (every record but the serialization id, byte for byte);
* `latest` moves only once the collective commit is done, and every rank's future
  resolves after that; load_latest gives the saved state bitwise on every rank;
* two async_saves in a row: the second waits for the first (one background save
  in flight per manager), `latest` names the second;
* the training loop's group is not used by the background saves (a collective on
  it, run while a save is being written, completes and the save goes on);
* a rank whose snapshot fails (an unpicklable value on that rank only): async_save
  raises on every rank, nothing is written, `latest` unchanged;
* a rank whose writes fail (EIO): every rank's future fails, naming the path;
  `latest` and the directory unchanged, no temporary file; rank 0's `latest`
  update failing: every rank's future fails too; the next save succeeds;
* wait() and close().

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    python collective_async_worker.py CKPT_DIR
Rank 0 prints "ok" at the end; any failed check raises (non-zero exit).
"""
import concurrent.futures
import errno
import os
import sys
import zipfile

import torch
import torch.distributed as dist

from fastckpt import CheckpointManager, _C
from fastckpt.collective import save as _collective
import fastckpt


def state(v):
    g = torch.Generator().manual_seed(v)
    w = torch.randn(512, 1024, generator=g)  # 2 MiB: every rank gets a share of many blocks
    return {"model": {"w": w, "w_view": w[3:7], "b": torch.randn(1000, generator=g).half()},
            "optim": {"state": {0: {"exp_avg": torch.randn(300_001, generator=g), "step": torch.tensor(float(v))}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
            "empty": torch.empty(0), "step": v}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def scribble(sd):
    for v in sd.values():
        if isinstance(v, dict):
            scribble(v)
        elif isinstance(v, torch.Tensor) and v.numel():
            v.reshape(-1).view(torch.uint8).bitwise_not_()


def records(path):
    with zipfile.ZipFile(path) as z:
        return {i.filename: (i.header_offset, i.CRC, z.read(i)) for i in z.infolist()
                if not i.filename.endswith("serialization_id")}


def temps(d):
    return [n for n in os.listdir(d) if ".fastckpt-tmp." in n]


def main(ckpt: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    wrote = []  # this rank's share (bytes) of each collective save
    shares = _collective._shares

    def counting_shares(plan, w, size):
        bodies, out = shares(plan, w, size)
        wrote.append((sum(n for _i, _s, n, _o in out[rank]), sum(b for _head, b in bodies.values())))
        return bodies, out

    _collective._shares = counting_shares
    mgr = CheckpointManager(ckpt, keep_last=3)
    assert mgr.collective

    # 1. one async save: the snapshot is isolated, written by every rank, committed, then the future resolves.
    _C.fault_inject("write", nth=1, delay_ms=100, times=0, path_contains="step_00000001")
    src = state(1)
    fut = mgr.async_save(1, src)
    scribble(src)  # after the snapshot: must not reach the checkpoint
    assert not fut.done() and not fut.cancel()  # a collective write is not called off on one rank
    t = torch.ones(4)
    dist.all_reduce(t)  # the training loop's group stays usable while the save is written
    assert t.tolist() == [world] * 4
    res = fut.result(timeout=120)
    _C.fault_clear()
    assert res.path == os.path.join(ckpt, "step_00000001.pt"), res
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "step_00000001.pt\n"  # on every rank, once its future resolved
    assert len(wrote) == 1, wrote
    got = [None] * world
    dist.all_gather_object(got, wrote[0])
    total = got[0][1]
    assert all(t == total for _, t in got), got
    assert all(n > 0 for n, _ in got), f"a rank wrote no share: {got}"
    assert all(abs(n - total / world) < 0.25 * total / world for n, _ in got), f"shares not about 1/{world}: {got}"
    if rank == 0:
        print(f"shares {[n for n, _ in got]} of {total} bytes of storage bodies", flush=True)
    if rank == 0:
        fastckpt.save(state(1), os.path.join(ckpt, "..", "reference.pt"))
        assert records(res.path) == records(os.path.join(ckpt, "..", "reference.pt")), "not the single-process file"
    r = mgr.load_latest()
    assert r.step == 1 and same(r.state, state(1)), r.step

    # 2. two in a row: the second async_save waits for the first to be committed on every rank.
    _C.fault_inject("write", nth=1, delay_ms=50, times=0, path_contains="step_0000000")
    f2 = mgr.async_save(2, state(2))
    f3 = mgr.async_save(3, state(3))
    assert f2.done() and f2.exception() is None, f2  # done before the second was snapshotted
    f3.result(timeout=120)
    _C.fault_clear()
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "step_00000003.pt\n"
    assert same(mgr.load_latest().state, state(3))
    dist.barrier()
    before = sorted(os.listdir(ckpt))

    # 3. a snapshot fails on the last rank only: async_save raises on every rank, nothing is written.
    bad = state(4)
    if rank == world - 1:
        bad["hook"] = lambda: None
    try:
        mgr.async_save(4, bad)
    except Exception as e:  # noqa: BLE001
        assert rank == world - 1 or f"rank {world - 1}" in str(e), e
    else:
        raise AssertionError("a failed snapshot did not raise")
    dist.barrier()
    assert sorted(os.listdir(ckpt)) == before, (before, os.listdir(ckpt))

    # 4. the last rank's writes fail: every rank's future fails, naming the path; nothing moves.
    if rank == world - 1:
        _C.fault_inject("write", errno=errno.EIO, times=0, path_contains="step_00000005")
    f5 = mgr.async_save(5, state(5))
    exc = f5.exception(timeout=120)
    _C.fault_clear()
    assert exc is not None and "step_00000005.pt" in str(exc), repr(exc)
    dist.barrier()
    assert sorted(os.listdir(ckpt)) == before and not temps(ckpt), (before, os.listdir(ckpt))

    # 5. rank 0's `latest` update fails: every rank's future fails.
    if rank == 0:
        _C.fault_inject("rename", errno=errno.EIO, times=0, path_contains="latest")
    f6 = mgr.async_save(6, state(6))
    exc = f6.exception(timeout=120)
    _C.fault_clear()
    assert exc is not None and ("latest" in str(exc) or rank == 0), repr(exc)
    dist.barrier()
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "step_00000003.pt\n"
    mgr.wait()  # the failures were looked at: nothing to raise

    # 6. the next save succeeds; wait() and close().
    concurrent.futures.wait([mgr.async_save(7, state(7))])
    mgr.wait()
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "step_00000007.pt\n"
    r = mgr.load_latest()
    assert r.step == 7 and same(r.state, state(7)) and not temps(ckpt)
    mgr.async_save(8, state(8))
    mgr.close()
    assert mgr.steps()[-1] == 8 and not temps(ckpt)
    dist.barrier()
    if rank == 0:
        print("ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
