"""One rank of tests/python/sources/test_load_into_dtensor.py (gloo, CPU): fastckpt.load_into of
full-size files (fastckpt.save, stock torch.save, safetensors; a DCP directory) into DTensor targets
(Shard(0), Shard(1), uneven shards, bf16 and int64, Replicate, a 2-D mesh at 4 ranks; an FSDP2
model and its Adam state); each rank's
local shard must equal its slice of the full tensor, and the bytes this rank had the engine read
must be about 1/W of the sharded tensors' bytes (counted at fastckpt._C.read_ranges; /proc/self/io
printed beside it). Partial and _StridedShard targets are refused, naming the key and the placement.

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    python load_into_worker.py DIR      (DIR holds what full_state() wrote, see write_files)
Prints "OK load_into rank R"; any failed check raises (non-zero exit).
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import fastckpt
from fastckpt import _C

SLACK = 64 << 10  # the zip directory and data.pkl each rank reads


def full_state():
    """The full tensors: name -> (tensor, placements on a 1-D mesh or None for the 2-D one)."""
    g = torch.Generator().manual_seed(0)
    return {
        "s0": torch.randn(256, 512, generator=g),
        "s1": torch.randn(256, 512, generator=g),
        "uneven": torch.randn(7, 8192, generator=g),
        "bf": torch.randn(128, 1024, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-2**62, 2**62, (64, 1024), generator=g, dtype=torch.int64),
        "two_d": torch.randn(256, 512, generator=g),
        "rep": torch.randn(256, 256, generator=g),
        **{f"p{i}": torch.randn(64, 256, generator=g) for i in range(8)},  # plain tensors: replicated
    }


def fsdp_model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7))


def fsdp_step(model, opt) -> None:
    torch.manual_seed(42)
    model(torch.randn(4, 16)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def write_files(d: str) -> None:
    """What the test writes before starting the ranks (single process)."""
    import torch.distributed.checkpoint as dcp
    from fastckpt import safetensors as st
    from fastckpt.dcp import FastWriter
    full = full_state()
    fastckpt.save(full, os.path.join(d, "full.pt"))
    torch.save(full, os.path.join(d, "stock.pt"))
    st.save_file(full, os.path.join(d, "full.safetensors"))
    dcp.save(full, storage_writer=FastWriter(os.path.join(d, "dcp")))
    m = fsdp_model(0)  # a model and its Adam state, trained in one process
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    fsdp_step(m, opt)
    fastckpt.save({"model": m.state_dict(), "optim": opt.state_dict()}, os.path.join(d, "fsdp.pt"))


def placements(world: int):
    p = {"s0": [Shard(0)], "s1": [Shard(1)], "uneven": [Shard(0)], "bf": [Shard(0)], "i64": [Shard(1)]}
    if world == 4:
        p["two_d"] = [Shard(0), Shard(1)]  # on a (2, 2) mesh
    return p


class Counter:
    """Bytes of destination ranges passed to the engine's read_ranges."""

    def __init__(self):
        self.n = 0
        self.real = _C.read_ranges

    def __call__(self, eng, path, ranges, *a, **kw):
        for r in ranges:
            d = r[0]
            self.n += d.numel() * d.element_size() if isinstance(d, torch.Tensor) else len(d)
        assert not kw.get("fill"), "a load_into source planned fill buffers: count their holes too"
        return self.real(eng, path, ranges, *a, **kw)


def rchar() -> int:
    """This process's read bytes from /proc/self/io (reads through io_uring may not count: printed only)."""
    try:
        with open("/proc/self/io") as f:
            return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])
    except (OSError, KeyError, ValueError):
        return 0


def targets(world: int):
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2)) if world == 4 else None
    full = full_state()
    out = {}
    for k, p in placements(world).items():
        m = mesh2 if k == "two_d" else mesh
        out[k] = distribute_tensor(torch.zeros_like(full[k]), m, p)
    rep = {"rep": distribute_tensor(torch.zeros_like(full["rep"]), mesh, [Replicate()]),
           **{k: torch.zeros_like(v) for k, v in full.items() if k.startswith("p")}}
    return full, out, rep, mesh


def check_local(full, state) -> None:
    for k, dt in state.items():
        if not isinstance(dt, DTensor):
            assert torch.equal(dt, full[k]), (k, dist.get_rank())
            continue
        shape, off = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        want = full[k]
        for d, (o, n) in enumerate(zip(off, shape)):
            want = want.narrow(d, o, n)
        local = dt.to_local()
        assert local.dtype == want.dtype and torch.equal(local, want), (k, dist.get_rank())


def _refused(target, path, placement: str) -> None:
    """load_into refuses `target` (key s0) naming the key and the placement."""
    try:
        fastckpt.load_into(target, path, strict=False)
    except fastckpt.StateMismatchError as e:
        assert "s0" in str(e) and placement in str(e), e
    else:
        raise AssertionError(f"a {placement} target was loaded")


def main(d: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    counter = Counter()
    _C.read_ranges = counter
    for name in ("full.pt", "stock.pt", "full.safetensors"):
        full, state, rep, mesh = targets(world)
        sharded_bytes = sum(t.numel() * t.element_size() for k, t in full.items() if k in state)
        counter.n, io0 = 0, rchar()
        res = fastckpt.load_into(state, os.path.join(d, name), strict=False)
        got, io = counter.n, rchar() - io0
        assert sorted(res.unexpected_keys) == sorted(set(full) - set(state)), res
        assert res.missing_keys == [], res
        check_local(full, state)
        print(f"rank {rank} {name}: engine read {got} bytes, rchar {io}, sharded tensors {sharded_bytes}", flush=True)
        assert got < 1.5 * sharded_bytes / world + SLACK, (name, got, sharded_bytes, world)
        assert got > 0.5 * sharded_bytes / world, (name, got)  # the counter sees the reads at all
        # replicated tensors: without a group every rank reads them all; with one, each reads its share
        rep_bytes = sum(full[k].numel() * full[k].element_size() for k in rep)
        for group in (None, dist.group.WORLD):
            rep = targets(world)[2]
            counter.n = 0
            fastckpt.load_into(rep, os.path.join(d, name), group=group, strict=False)
            got = counter.n
            print(f"rank {rank} {name} group={group is not None}: engine read {got} of {rep_bytes} replicated bytes",
                  flush=True)
            if group is None:
                assert got >= rep_bytes, (name, got, rep_bytes)
            else:
                assert got < 1.5 * rep_bytes / world + SLACK, (name, got, rep_bytes, world)
            check_local(full, rep)
    # a DCP directory: torch.distributed.checkpoint reshards it
    full, state, rep, mesh = targets(world)
    state.update(rep)
    res = fastckpt.load_into(state, os.path.join(d, "dcp"), strict=False)
    assert sorted(res.unexpected_keys) == sorted(set(full) - set(state)), res
    check_local(full, state)
    # FSDP2 (fully_shard): a model and its Adam state (DTensors, uneven Shard(0)) from a full-size file
    from torch.distributed.fsdp import fully_shard
    ref = torch.load(os.path.join(d, "fsdp.pt"), weights_only=True)
    m = fsdp_model(1)
    fully_shard(m[0], mesh=mesh)
    fully_shard(m[2], mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.Adam(m.parameters(), lr=0.5)
    fsdp_step(m, opt)  # its state exists (other values)
    state = {"model": m.state_dict(), "optim": opt.state_dict()}
    assert fastckpt.load_into(state, os.path.join(d, "fsdp.pt")) == ([], [])
    opt.load_state_dict(state["optim"])
    for k, v in ref["model"].items():
        assert torch.equal(m.state_dict()[k].full_tensor(), v), k
    for i, p in enumerate(m.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k].full_tensor(), ref["optim"]["state"][i][k]), (i, k)
    assert opt.param_groups[0]["lr"] == 1e-2
    # Partial: refused before anything is read, naming the key and the placement
    bad = {"s0": DTensor.from_local(torch.zeros(256, 512), mesh, [Partial()], run_check=False)}
    _refused(bad, os.path.join(d, "full.pt"), "Partial")
    assert torch.count_nonzero(bad["s0"].to_local()) == 0
    from torch.distributed.tensor.placement_types import _StridedShard
    strided = {"s0": DTensor.from_local(torch.zeros(256 // world, 512), mesh, [_StridedShard(0, split_factor=2)],
                                        run_check=False)}
    _refused(strided, os.path.join(d, "full.pt"), "_StridedShard")
    # with a group, one rank's failure raises on every rank (none is left waiting)
    where = os.path.join(d, "full.pt" if rank != 1 else "missing.pt")
    try:
        fastckpt.load_into(targets(world)[2], where, group=dist.group.WORLD, strict=False)
    except FileNotFoundError as e:
        assert rank == 1 and e.filename == where, e
    except fastckpt.errors.RanksFailed as e:
        assert rank != 1 and "rank 1" in str(e) and "missing.pt" in str(e), e
    else:
        raise AssertionError("a missing file on rank 1 raised nothing")
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK load_into rank {rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
