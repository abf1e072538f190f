"""One rank of tests/python/manager/test_manager_remote_ranks.py (gloo, CPU): CheckpointManager(replicate_to=...)
where every rank uploads its part of each step.

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    python remote_ranks_worker.py SCENARIO WORKDIR TIERS_JSON

TIERS_JSON: {"<tier name>": {"sharded": url, "collective": url, "opts": storage_options, "fault": kind}}.
SCENARIO "ok": for each tier, a sharded manager (each rank uploads its own files; step 3 fails
on rank 1 by the test's doing: no manifest, named on rank 0 and rank 1, step 2 restored by a
fresh manager) and a collective manager (each rank a share of the file's parts; an async save;
a fresh node restores bitwise). SCENARIO "kill": a sharded manager; rank 1 is SIGKILLed by the
test while it uploads step 2: rank 0 names it after peer_timeout, writes no manifest.
Prints "OK <scenario> rank <r>" at the end; any failed check raises (non-zero exit).
"""
import json
import os
import sys
import time
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fastckpt import CheckpointManager
from fastckpt.remote import open_store, read_manifest
from fastckpt.remote.team import RanksFailed


def expect_failure(fn, *needles):
    try:
        fn()
    except OSError as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return e
    raise AssertionError(f"{fn} did not fail")


def sharded_state(mesh, v):
    full = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024) + v
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": v}


def own_bytes(d, rank):
    """The sizes of the files of sharded checkpoint ``d`` that ``rank`` uploads."""
    names = os.listdir(d)
    mine = [n for n in names if n.startswith(f"__{rank}_")] + ([".metadata"] if rank == 0 else [])
    return sum(os.path.getsize(os.path.join(d, n)) for n in mine)


def sharded(tier, t, work, rank, world, mesh):
    url, opts = t["sharded"], t["opts"]
    d = os.path.join(work, f"{tier}-sharded")
    sent = 0
    with CheckpointManager(d, keep_last=1, sharded=True, replicate_to=url, storage_options=opts) as m:
        for v in (1, 2):
            (m.save if v == 1 else m.async_save)(v, sharded_state(mesh, v))
            m.wait()
            assert m.wait_remote() == v, (v, m.remote_status())
            sent += own_bytes(m.path_for(v), rank)
            assert m.remote_status()["bytes_uploaded"] == sent, (m.remote_status(), sent)  # only its own files
        # step 3: rank 1's upload fails (the test made it so); no manifest; the local checkpoint stands
        m.save(3, sharded_state(mesh, 3))
        if rank == 0:
            e = expect_failure(m.wait_remote, "rank 1:", f"{url}/step_3", "no manifest written")
            assert isinstance(e, RanksFailed) and list(e.failures) == [1], e
        elif rank == 1:
            expect_failure(m.wait_remote, f"{url}/step_3/__1_0.distcp")
        else:
            expect_failure(m.wait_remote, "rank 1")
        assert m.remote_status()["last_error_step"] == 3
        got = sharded_state(mesh, 0)
        assert m.load_latest(state=got).step == 3 and got["step"] == 3
    # local retention (keep_last=1) applied once the uploads ended
    assert sorted(n for n in os.listdir(d) if n.startswith("step_")) == ["step_00000003"]
    if rank == 0:
        assert [s for s in read_steps(url, opts)] == [1, 2], read_steps(url, opts)
        man = read_manifest(open_store(url, opts), 2)
        assert sorted(f["path"] for f in man["files"]) == [".metadata"] + [f"__{r}_0.distcp" for r in range(world)]
    # a fresh node: step 3 was never completed remotely, step 2 is restored on every rank
    got = sharded_state(mesh, 0)
    with CheckpointManager(os.path.join(work, f"{tier}-sharded-new"), sharded=True, replicate_to=url,
                           storage_options=opts) as m2:
        r = m2.load_latest(state=got)
        assert r.step == 2 and torch.equal(got["w"].to_local(), sharded_state(mesh, 2)["w"].to_local()), r


def read_steps(url, opts):
    from fastckpt.remote import list_steps
    return list_steps(open_store(url, opts))


def collective(tier, t, work, rank, world):
    url, opts = t["collective"], t["opts"]
    d = os.path.join(work, f"{tier}-collective")
    g = torch.Generator().manual_seed(5)
    states = {v: {"w": torch.randn(3_200_000, generator=g), "step": v} for v in (1, 2)}  # 12.8 MB: 3 parts of 5 MiB
    with CheckpointManager(d, replicate_to=url, storage_options=opts) as m:
        assert m.collective
        m.save(1, states[1])
        assert m.wait_remote() == 1
        size = os.path.getsize(m.path_for(1))
        shared = t["shared_uploads"]
        parts = [5 << 20, 5 << 20, size - (10 << 20)]
        mine = {0: parts[0], 1: parts[1] + parts[2]} if world == 2 else None
        want = (mine[rank] if shared else (size if rank == 0 else 0))
        assert m.remote_status()["bytes_uploaded"] == want, (m.remote_status(), want)
        if rank == 0:
            man = read_manifest(open_store(url, opts), 1)
            with open(m.path_for(1), "rb") as f:
                assert man["files"] == [{"path": m.name_for(1), "size": size, "crc32": zlib.crc32(f.read())}], man
        m.async_save(2, states[2])  # committed by rank 0 on the writer thread
        m.wait()
        assert m.wait_remote() == 2
    with CheckpointManager(os.path.join(work, f"{tier}-collective-new"), replicate_to=url, storage_options=opts) as m2:
        r = m2.load_latest()
        assert r.step == 2 and torch.equal(r.state["w"], states[2]["w"]), r.step


def kill(t, work, rank, mesh):
    url, opts = t["sharded"], t["opts"]
    m = CheckpointManager(os.path.join(work, "kill"), sharded=True, replicate_to=url, storage_options=opts)
    m.save(1, sharded_state(mesh, 1))
    assert m.wait_remote() == 1
    m.save(2, sharded_state(mesh, 2))  # rank 1's upload of it stalls; the test SIGKILLs rank 1
    print(f"SAVED 2 rank {rank}", flush=True)
    if rank != 0:
        time.sleep(600)
    t0 = time.monotonic()
    e = expect_failure(m.wait_remote, "rank 1 gave no sign of life", "no manifest written")
    assert isinstance(e, RanksFailed) and time.monotonic() - t0 < 60, e
    assert read_steps(url, opts) == [1]
    print(f"OK kill rank {rank}", flush=True)
    os._exit(0)  # rank 1 is dead: no collective can end this job cleanly


def main(scenario, work, tiers):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    if scenario == "kill":
        kill(tiers["s3"], work, rank, mesh)
    for tier, t in tiers.items():
        sharded(tier, t, work, rank, world, mesh)
        collective(tier, t, work, rank, world)
    dist.barrier()
    print(f"OK {scenario} rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
