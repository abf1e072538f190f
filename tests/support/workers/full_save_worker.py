"""One rank of tests/python/collective/test_full_save.py: a full-size save of sharded
state (DTensors) by every rank, ``fastckpt.save(state, path, group=WORLD)``.

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    python full_save_worker.py CASE OUT_DIR [MODE]
Writes OUT_DIR/full.pt (every rank) and, on rank 0, OUT_DIR/ref.pt: a
single-process fastckpt.save of the gathered state (DTensor.full_tensor(), tied
tensors kept tied) with the same serialization id; OUT_DIR/full.expected holds
the gathered state (torch.save, for the test's comparisons). Prints one line
"REPORT <json>" (bytes this rank wrote, from /proc/self/io) or "ERR <type>: <msg>".
MODE: "ok"; "kill" (rank 1 is SIGKILLed in its writes: the others must fail,
nothing committed); "differ" (rank 1's plain tensor differs); "eio1", "enospc0",
"rename0" (every write of rank 1 fails with EIO, of rank 0 with ENOSPC, rank 0's
rename with EIO: injected into the engine).
"""
import copy
import errno
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support
from proc_io import io_counter  # noqa: E402

import fastckpt
import fastckpt.formats.archive
import fastckpt.safetensors

SID = b"0123456789012345678"


def build(case: str, world: int):
    """(the state to save, every rank alike: DTensors and plain values)."""
    g = torch.Generator().manual_seed(7)

    def rnd(*shape, dtype=torch.float32):
        if dtype.is_floating_point:
            return torch.randn(*shape, generator=g).to(dtype)
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)

    if case == "fsdp":  # FSDP2 on a CPU mesh: model and Adam state after two steps
        from torch.distributed.fsdp import fully_shard
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(37, 300), torch.nn.ReLU(), torch.nn.Linear(300, 1030),
                                    torch.nn.Linear(1030, 5))
        mesh = init_device_mesh("cpu", (world,))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(torch.randn(4, 37, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
        return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}
    mesh = init_device_mesh("cpu", (world,))
    big = rnd(2048, 1024)  # 8 MiB: the per-rank byte counts
    tied = distribute_tensor(rnd(130, 33), mesh, [Shard(0)])
    state = {
        "big": distribute_tensor(big, mesh, [Shard(0)]),
        "tp_cols": distribute_tensor(rnd(64, 1000, dtype=torch.bfloat16), mesh, [Shard(1)]),
        "uneven": distribute_tensor(rnd(7, 5), mesh, [Shard(0)]),
        "uneven_cols": distribute_tensor(rnd(3, 7, dtype=torch.int64), mesh, [Shard(1)]),
        "replicated": distribute_tensor(rnd(300, 17), mesh, [Replicate()]),
        "scalar": distribute_tensor(torch.tensor(2.5), mesh, [Replicate()]),
        "ints": distribute_tensor(rnd(1000, dtype=torch.int64), mesh, [Shard(0)]),
        "tied": tied, "tied_again": tied,
        "plain": torch.arange(10.0), "plain_big": rnd(100_000), "meta": {"lr": 0.1, "names": ["a", "b"]},
        "partial": DTensor.from_local(torch.full((4, 3), 1.0), mesh, [Partial()]),
        "empty": distribute_tensor(torch.zeros(0, 4), mesh, [Shard(0)]),
        # small shards next to blocks other ranks write O_DIRECT: rank 0's buffered writes of them
        # once failed the file's writeback with EIO (a large folio over a neighbour's direct block)
        "w64": distribute_tensor(rnd(256, 64), mesh, [Shard(0)]), "b256": distribute_tensor(rnd(256), mesh, [Shard(0)]),
        "w10": distribute_tensor(rnd(10, 256), mesh, [Shard(0)]), "b10": distribute_tensor(rnd(10), mesh, [Shard(0)]),
    }
    if case == "2d" and world == 4:
        m2 = init_device_mesh("cpu", (2, 2))
        state.update({
            "2d_rows_cols": distribute_tensor(rnd(50, 40), m2, [Shard(0), Shard(1)]),
            "2d_rep_rows": distribute_tensor(rnd(33, 8, dtype=torch.bfloat16), m2, [Replicate(), Shard(0)]),
            "2d_cols_rep": distribute_tensor(rnd(9, 600), m2, [Shard(1), Replicate()]),
            "2d_rows_rows": distribute_tensor(rnd(4097, 3), m2, [Shard(0), Shard(0)]),
        })
    if case == "strided":
        from torch.distributed.tensor.placement_types import _StridedShard
        state = {"w": DTensor.from_local(torch.zeros(4, 4), mesh, [_StridedShard(0, split_factor=2)],
                                          shape=torch.Size((4 * world, 4)), stride=(4, 1))}
    return state


def gather(obj, memo=None):
    """The full state: every DTensor as its full tensor (the same object, the same full tensor)."""
    memo = {} if memo is None else memo
    if isinstance(obj, DTensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.full_tensor().clone()  # its own storage (an uneven gather leaves padding)
        return memo[id(obj)]
    if isinstance(obj, dict):  # a copy, so that a state dict keeps its _metadata
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = gather(v, memo)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(gather(v, memo) for v in obj)
    return obj


def _flat(state):
    """The tensors a safetensors file can hold: the model's for FSDP, else the top-level ones but the
    second name of the tied tensor (safetensors refuses shared tensors)."""
    if "model" in state:
        return dict(state["model"])
    return {k: v for k, v in state.items() if torch.is_tensor(v) and k != "tied_again"}


def main(case: str, out: str, mode: str = "ok") -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    fastckpt.formats.archive.new_serialization_id = lambda: SID
    state = build(case, world)
    if mode == "differ" and rank == 1:
        state["plain"][3] += 1
    path = os.path.join(out, "full.pt")
    faults = {"eio1": (1, "write", errno.EIO), "enospc0": (0, "write", errno.ENOSPC), "rename0": (0, "rename", errno.EIO)}
    if mode in faults and rank == faults[mode][0]:
        from fastckpt import _C
        fastckpt.save({"warm": torch.zeros(1)}, os.path.join(out, f"warm{rank}.pt"))  # the engine made first
        os.unlink(os.path.join(out, f"warm{rank}.pt"))
        armed = faults[mode]
    else:
        armed = None
    if mode == "kill" and rank == 1:
        from fastckpt._core import engine
        orig = engine.region_file

        def dying(*a, **k):
            w = orig(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
            return w
        engine.region_file = dying
    if case != "strided":
        full = gather(state)
        if rank == 0:
            fastckpt.save(full, os.path.join(out, "ref.pt"))
            torch.save(full, os.path.join(out, "full.expected"))
    dist.barrier()
    before = (io_counter("wchar"), io_counter("write_bytes"))
    if armed is not None:
        _C.fault_inject(armed[1], errno=armed[2], times=0)
    try:
        fastckpt.save(state, path, group=dist.group.WORLD)
    except Exception as e:
        print(f"ERR {type(e).__name__}: {e}", flush=True)
        return
    after = (io_counter("wchar"), io_counter("write_bytes"))
    report = {"rank": rank, "wchar": after[0] - before[0], "write_bytes": after[1] - before[1]}
    # The same tensors as a safetensors file and as a sharded Hugging Face set, written by every rank.
    flat = _flat(state)
    full_flat = _flat(full)
    if rank == 0:
        fastckpt.safetensors.save_file(full_flat, os.path.join(out, "ref.safetensors"), {"format": "pt"})
        fastckpt.safetensors.save_sharded(full_flat, os.path.join(out, "ref_hf"), max_shard_size="1MB")
    dist.barrier()
    before = io_counter("write_bytes")
    fastckpt.safetensors.save_file(flat, os.path.join(out, "full.safetensors"), {"format": "pt"},
                                   group=dist.group.WORLD)
    report["st_write_bytes"] = io_counter("write_bytes") - before
    fastckpt.safetensors.save_sharded(flat, os.path.join(out, "hf"), max_shard_size="1MB", group=dist.group.WORLD)
    print("REPORT " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
