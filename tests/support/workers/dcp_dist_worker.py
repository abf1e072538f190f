"""One rank of the multi-process DCP tests (tests/python/dcp/test_dcp.py starts them).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python dcp_dist_worker.py SCENARIO WORKDIR

Scenarios: ``save`` (world size 2: writes the checkpoints the other scenarios
and the single-process tests load, and checks them at world size 2),
``load`` (any world size: loads them resharded and checks every value),
``kill`` (world size 2: rank 1 stalls inside a write so that the test can kill
it). Prints ``OK <scenario>`` and exits 0 when every check passed.
"""

import errno
import os
import sys
import time
import warnings
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from fastckpt import _C  # noqa: E402
from fastckpt.dcp import FastReader, FastWriter  # noqa: E402

warnings.filterwarnings("ignore")

RANK = int(os.environ.get("RANK", 0))
WS = int(os.environ.get("WORLD_SIZE", 1))

# name -> (shape, dtype, placement); placement None = a plain (replicated) tensor
SPECS = {
    "rows": ((7, 5), torch.float32, Shard(0)),          # uneven: 4+3 at 2 ranks, 3+3+1 at 3
    "cols": ((6, 9), torch.bfloat16, Shard(1)),
    "big": ((300, 257), torch.float32, Shard(0)),       # >= 64 KiB per shard: 4 KiB-aligned records
    "rep": ((4, 4), torch.int64, Replicate()),
    "plain": ((33,), torch.float64, None),
    "flags": ((10,), torch.bool, None),
    "scalar": ((), torch.float32, None),
}


def full_value(name, shape, dtype):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def make_state(mesh, scale=1.0, zero=False):
    sd = {}
    for name, (shape, dtype, pl) in SPECS.items():
        v = full_value(name, shape, dtype)
        if scale != 1.0 and dtype.is_floating_point:
            v = v * scale
        if zero:
            v = torch.zeros_like(v)
        sd[name] = v if pl is None else distribute_tensor(v, mesh, [pl])
    sd["meta"] = {"step": 0 if zero else 42, "tag": "" if zero else "fastckpt", "lr": [0.0, 0.0] if zero else [1e-3, 2e-3]}
    return sd


def check_state(sd, scale=1.0, what=""):
    for name, (shape, dtype, pl) in SPECS.items():
        want = full_value(name, shape, dtype)
        if scale != 1.0 and dtype.is_floating_point:
            want = want * scale
        got = sd[name]
        if isinstance(got, DTensor):
            got = got.full_tensor()
        assert got.dtype == dtype and tuple(got.shape) == shape, (what, name, got.dtype, got.shape)
        assert torch.equal(got, want), f"{what}: {name} differs"
    assert sd["meta"] == {"step": 42, "tag": "fastckpt", "lr": [1e-3, 2e-3]}, (what, sd["meta"])


def make_model(mesh):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g)
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def full_model_state(model, opt):
    msd, osd = get_state_dict(model, opt)
    full = lambda v: v.full_tensor() if isinstance(v, DTensor) else (v.clone() if isinstance(v, torch.Tensor) else v)
    return ({k: full(v) for k, v in msd.items()},
            {k: {kk: full(vv) for kk, vv in st.items()} for k, st in osd["state"].items()})


def equal_model_state(a, b, what):
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys(), what
    for k in ma:
        assert torch.equal(ma[k], mb[k]), f"{what}: model {k}"
    assert oa.keys() == ob.keys(), what
    for k in oa:
        for kk in oa[k]:
            assert torch.equal(oa[k][kk], ob[k][kk]), f"{what}: optimizer {k}.{kk}"


def no_temp_files(d):
    left = [n for n in os.listdir(d) if ".fastckpt-tmp." in n]
    assert not left, f"temporary files left in {d}: {left}"


def fd_count():
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------- scenarios

def scenario_save(work, mesh):
    ck = lambda n: os.path.join(work, n)
    sd = make_state(mesh)

    w = FastWriter(ck("fast"))
    dcp.save(sd, storage_writer=w)
    assert all(st["direct"] for st in w.last_write_stats), w.last_write_stats
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(ck("stock")))
    # several files per rank, and one file per item
    dcp.save(sd, storage_writer=FastWriter(ck("threads"), thread_count=2))
    dcp.save(sd, storage_writer=FastWriter(ck("per_item"), single_file_per_rank=False))
    # checkpoint_id= replaces the path the writer/reader was made with
    dcp.save(sd, checkpoint_id=ck("ckid"), storage_writer=FastWriter(os.path.join(work, "unused-w")))
    assert not os.path.exists(os.path.join(work, "unused-w"))
    dist.barrier()
    if RANK == 0:
        names = sorted(os.listdir(ck("threads")))
        assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"], names

    # load back at world size 2: FastReader (own and stock files), stock reader (own files)
    for name, reader in [("fast", FastReader(ck("fast"))), ("stock", FastReader(ck("stock"))),
                         ("fast", dcp.FileSystemReader(ck("fast"))), ("threads", FastReader(ck("threads"))),
                         ("per_item", FastReader(ck("per_item"))), ("ckid", FastReader(os.path.join(work, "x")))]:
        tgt = make_state(mesh, zero=True)
        dcp.load(tgt, storage_reader=reader, checkpoint_id=ck(name) if name == "ckid" else None)
        check_state(tgt, what=f"ws2 {name} {type(reader).__name__}")
        if isinstance(reader, FastReader) and name == "fast":
            st = reader.last_read_stats
            assert st["slow"] == 0 and st["fast"] == len(SPECS) and st["verified"] == st["items"], st

    # model + optimizer (FSDP2, Adam)
    model, opt = make_model(mesh)
    train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=FastWriter(ck("model")))
    expected = full_model_state(model, opt)
    if RANK == 0:
        torch.save(expected, ck("model_expected.pt"))
    model2, opt2 = make_model(mesh)
    msd2, osd2 = get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, storage_reader=FastReader(ck("model")))
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    equal_model_state(full_model_state(model2, opt2), expected, "ws2 model")

    # async_save twice with one writer: staged buffers reused; the checkpoint holds
    # the values at the time of the call, whatever happens to the model afterwards
    w = FastWriter(ck("async1"))
    src = make_state(mesh)
    fut = dcp.async_save(src, storage_writer=w)
    allocs = w.staging_allocations
    with torch.no_grad():
        for name, (_, dtype, _) in SPECS.items():
            if dtype.is_floating_point:
                src[name].mul_(2)  # after staging: must not reach async1
    fut.result()
    fut = dcp.async_save(src, checkpoint_id=ck("async2"), storage_writer=w)
    fut.result()
    assert w.staging_allocations == allocs, (allocs, w.staging_allocations)
    for name, scale in (("async1", 1.0), ("async2", 2.0)):
        tgt = make_state(mesh, zero=True)
        dcp.load(tgt, storage_reader=FastReader(ck(name)))
        check_state(tgt, scale=scale, what=f"ws2 {name}")
    w.close()

    # ENOSPC on rank 1 only: the whole save fails, on every rank, cleanly
    base = fd_count()
    if RANK == 1:
        _C.fault_inject("write", nth=1, errno=errno.ENOSPC, path_contains="__1_")  # its first data write
    try:
        dcp.save(sd, storage_writer=FastWriter(ck("enospc")))
    except CheckpointException as e:  # on every rank (a BaseException)
        msg = str(e)
        assert "No space left on device" in msg and "__1_0.distcp" in msg, msg
    else:
        raise AssertionError("the save with ENOSPC on rank 1 succeeded")
    if RANK == 1:
        assert _C.fault_fired() >= 1
        _C.fault_clear()
    assert fd_count() == base, (base, fd_count())
    dist.barrier()
    assert not os.path.exists(os.path.join(ck("enospc"), ".metadata"))
    no_temp_files(ck("enospc"))
    for n in ("fast", "stock", "threads", "per_item", "ckid", "model", "async1", "async2"):
        no_temp_files(ck(n))


def scenario_load(work, mesh):
    ck = lambda n: os.path.join(work, n)
    for name, make in [("fast", FastReader), ("stock", FastReader), ("fast", dcp.FileSystemReader),
                       ("threads", FastReader), ("per_item", dcp.FileSystemReader), ("async2", FastReader)]:
        tgt = make_state(mesh, zero=True)
        reader = make(ck(name))
        dcp.load(tgt, storage_reader=reader)
        check_state(tgt, scale=2.0 if name == "async2" else 1.0, what=f"ws{WS} {name} {make.__name__}")
        if make is FastReader and name == "fast":
            # resharded: this rank reads its pieces, not the other ranks' bytes
            st = reader.last_read_stats
            total = sum(os.path.getsize(os.path.join(ck(name), f)) for f in os.listdir(ck(name)))
            assert st["bytes_requested"] < total / 2, (st, total)
    model, opt = make_model(mesh)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, storage_reader=FastReader(ck("model")))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    expected = torch.load(ck("model_expected.pt"), weights_only=True)
    equal_model_state(full_model_state(model, opt), expected, f"ws{WS} model")


def scenario_kill(work, mesh):
    # 4 MiB per rank, written 1 MiB at a time (FASTCKPT_BUFFER_SIZE=1M): rank 1
    # stalls on its second write, and the test kills it there.
    sd = {"w": distribute_tensor(torch.randn(WS * 1024, 1024), mesh, [Shard(0)])}
    if RANK == 1:
        _C.fault_inject("write", nth=2, delay_ms=60000, path_contains="__1_0")
    dcp.save(sd, storage_writer=FastWriter(os.path.join(work, "ck")))
    raise AssertionError("the save finished although rank 1 was to be killed")


def main():
    scenario, work = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (WS,))
        t = time.perf_counter()
        globals()[f"scenario_{scenario}"](work, mesh)
        dist.barrier()
        print(f"OK {scenario} rank {RANK} in {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
