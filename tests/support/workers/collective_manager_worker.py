"""One rank of test_ddp_resume.py::test_collective_manager_two_ranks (gloo, CPU):
the manager in replicated mode with collective=True (the default): every rank
writes a share of each checkpoint and reads a share of it; retention and
`latest`; fallback from a damaged checkpoint on every rank alike; an EIO on
one rank's writes fails the save on every rank and leaves `latest` and the
directory as they were; collective=False has rank 0 write alone.

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    python collective_manager_worker.py CKPT_DIR
Rank 0 prints "ok" at the end; any failed check raises (non-zero exit).
"""
import errno
import os
import sys
import warnings

import torch
import torch.distributed as dist

from fastckpt import CheckpointManager, _C
from fastckpt.collective import save as _collective, load as _collective_load
from fastckpt.formats import zip as _zip


def main(ckpt: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    # What this rank was given to write and to read (the splits are the collectives' own).
    wrote, read = [], []
    shares, pieces = _collective._shares, _collective_load._pieces

    def counting_shares(plan, w, size):
        bodies, out = shares(plan, w, size)
        wrote.append(sum(n for _i, _s, n, _o in out[rank]))
        return bodies, out

    def counting_pieces(archive, names, readers):
        out = pieces(archive, names, readers)
        read.append(sum(n for _name, _o, n in out[rank]) if readers == world else -1)
        return out

    _collective._shares, _collective_load._pieces = counting_shares, counting_pieces

    def state(v):
        g = torch.Generator().manual_seed(v)
        model = {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(1024, generator=g)}
        optim = {"state": {0: {"exp_avg": torch.randn(256, 1024, generator=g), "step": torch.tensor(float(v))}},
                 "param_groups": [{"lr": 0.1, "params": [0]}]}
        return {"model": model, "optim": optim, "step": v}

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    mgr = CheckpointManager(ckpt, keep_last=2)
    assert mgr.collective
    assert mgr.load_latest() is None
    for v in (1, 2, 3):
        path = mgr.save(v, state(v))
        assert path is not None and path.name == f"step_{v:08d}.pt", path
    assert len(wrote) == 3 and all(n > 1 << 19 for n in wrote), wrote  # every rank wrote a share (of ~2 MiB)
    assert mgr.steps() == [2, 3], mgr.steps()
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "step_00000003.pt\n"
    assert torch.equal(torch.load(path, weights_only=True)["model"]["w"], state(3)["model"]["w"])

    r = mgr.load_latest()
    assert r.step == 3 and same(r.state, state(3))
    assert len(read) == 1 and read[0] > 1 << 19, read  # every rank read a share

    # Into the state the job has (load_into with the manager's group): filled in place, the same values.
    target = state(0)
    ptr = target["model"]["w"].data_ptr()
    r = mgr.load_latest(state=target)
    assert r.step == 3 and r.state is target and same(target, state(3)) and target["model"]["w"].data_ptr() == ptr

    # A damaged checkpoint is skipped on every rank alike.
    dist.barrier()
    if rank == 0:
        rec = _zip.Archive.open(str(path)).records["data/0"]
        with open(path, "r+b") as f:
            f.seek(rec.data_offset + 100)
            b = f.read(1)
            f.seek(rec.data_offset + 100)
            f.write(bytes([b[0] ^ 1]))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = mgr.load_latest()
    assert r.step == 2 and same(r.state, state(2)), r.step
    assert any("damaged" in str(w.message) for w in caught), [str(w.message) for w in caught]

    # An EIO on rank 1's writes: every rank raises, nothing moves.
    before = sorted(os.listdir(ckpt))
    if rank == 1:
        _C.fault_inject("write", errno=errno.EIO, times=0, path_contains="step_00000004")
    try:
        mgr.save(4, state(4))
    except (OSError, RuntimeError) as e:
        assert "step_00000004" in str(e), e
    else:
        raise AssertionError("the save with a failing rank succeeded")
    finally:
        _C.fault_clear()
    dist.barrier()
    assert sorted(os.listdir(ckpt)) == before, (before, os.listdir(ckpt))

    # collective=False: rank 0 alone writes; every rank reads the whole file.
    mgr.close()
    n = len(wrote)
    mgr0 = CheckpointManager(ckpt, keep_last=2, collective=False)
    path = mgr0.save(5, state(5))
    assert (path is not None) == (rank == 0), path
    assert len(wrote) == n, "collective=False wrote through the collective save"
    r = mgr0.load_latest()
    assert r.step == 5 and same(r.state, state(5)) and len(read) == 3, read
    mgr0.close()
    dist.barrier()
    if rank == 0:
        print("ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
