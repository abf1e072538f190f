"""What the power-loss tests save, and how they read it back from a crash state.

    python scenarios.py NAME MOUNTPOINT PARAMS_JSON      # run on a crashfs mount by harness.py

A scenario runs in a child process and saves checkpoints on the mount, marking where each save
began and where it returned (``begin KEY VERSION`` / ``end KEY VERSION``: a ``stat`` that crashfs
records in its op log). Its checks (``CHECKS``) say, for each key, which directory of a crash
state to read and how: a probe returns the version found (bitwise equal to what that version
saved), ``"absent"``, or ``"torn: why"``. harness.py decides which versions are acceptable at each
cut: the last one whose save returned, or one whose save was under way.
"""

import json
import os
import subprocess
import sys
import warnings
import zlib

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the worktree's fastckpt
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "support"))  # ports
import fastckpt  # noqa: E402
from states import page_aligned  # noqa: E402

MARK = ".crashfs-mark="


def mark(mnt: str, *words) -> None:
    try:
        os.stat(os.path.join(mnt, MARK + " ".join(map(str, words))))
    except FileNotFoundError:
        return
    raise RuntimeError("crashfs did not record a mark: is this a crashfs mount?")


def make_state(v: int, numel: int, part: str = "") -> dict:
    g = torch.Generator().manual_seed(v * 1000 + zlib.crc32(part.encode()) % 997)
    return {"version": v, f"w{part}": torch.randn(numel, generator=g),
            f"i{part}": torch.randint(-2**31, 2**31 - 1, (257,), generator=g, dtype=torch.int64),
            f"h{part}": torch.randn(3, 5, generator=g).to(torch.bfloat16)}


def same(got, want) -> bool:
    if set(got) != set(want):
        return False
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            if not (isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape
                    and torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))):
                return False
        elif g != w:
            return False
    return True


def make_staged_state(v: int, p: dict) -> dict:
    """Three tensors of p["numel"] float32 each (large enough for background staging to copy them
    after async_save returns: more than 1 MiB) with the small ones of each part."""
    out = {}
    for part in ("a", "b", "c"):
        out.update(make_state(v, p["numel"], part))
    return out


def _identify(obj, p, make=None) -> object:
    v = obj.get("version") if isinstance(obj, dict) else None
    if not isinstance(v, int):
        return f"torn: no version in {type(obj).__name__}"
    want = make(v, p) if make is not None else make_state(v, p["numel"])
    return v if same(obj, want) else f"torn: differs from version {v}"


# ---------------------------------------------------------------- probes (in the checker)
def probe_file(path: str, p: dict, make=None) -> object:
    """A checkpoint file, compared with what make(version, p) built (make_state by default)."""
    if not os.path.lexists(path):
        return "absent"
    try:
        return _identify(fastckpt.load(path, weights_only=True), p, make)
    except Exception as e:  # noqa: BLE001 - any failure to load is a torn checkpoint
        return f"torn: {type(e).__name__}: {str(e)[:160]}"


def probe_staged_file(path: str, p: dict) -> object:
    return probe_file(path, p, make_staged_state)


def probe_latest(mdir: str, p: dict, probe=None, missing: str = "missing") -> object:
    """`latest` names a complete checkpoint: the version found through it, read
    with `probe` (a checkpoint file by default; probe_dcp for the sharded manager)."""
    latest = os.path.join(mdir, "latest")
    if not os.path.lexists(latest):
        return "absent"
    with open(latest) as f:
        name = f.read().strip()
    if not name:
        return "torn: latest is empty"
    got = (probe or probe_file)(os.path.join(mdir, name), p)
    return f"torn: latest names {name}, which is {missing}" if got == "absent" else got


def probe_load_latest(mdir: str, p: dict) -> object:
    """What a restart resumes from: CheckpointManager.load_latest (skipping a damaged
    checkpoint counts as torn: a crash must never damage one under its final name)."""
    if not os.path.isdir(mdir):
        return "absent"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            r = fastckpt.CheckpointManager(mdir).load_latest()
        except Exception as e:  # noqa: BLE001
            return f"torn: {type(e).__name__}: {str(e)[:160]}"
    skipped = [str(w.message) for w in caught if "skipping" in str(w.message)]
    if skipped:
        return f"torn: {skipped[0][:160]}"
    if r is None:
        return "absent"
    got = _identify(r.state, p)
    return got if got == r.step or isinstance(got, str) else f"torn: step {r.step} holds version {got}"


def dcp_state(v: int, numel: int, ranks) -> dict:
    sd = {}
    for r in ranks:
        sd.update(make_state(v, numel, part=f"r{r}"))
    return sd


def probe_dcp(d: str, p: dict, parts=(0, 1)) -> object:
    from fastckpt._core.dircommit import resolve
    d = resolve(d)  # as fastckpt's readers do: a copy an interrupted fallback commit left aside
    if not os.path.lexists(os.path.join(d, ".metadata")):
        return "absent"
    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastReader
    try:
        meta = FastReader(d).read_metadata()
        v = None
        sd = {k: torch.zeros_like(t) for k, t in dcp_state(0, p["numel"], parts).items()
              if isinstance(t, torch.Tensor)}
        sd["version"] = -1
        if set(meta.state_dict_metadata) != set(sd):
            return f"torn: .metadata holds {sorted(meta.state_dict_metadata)}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": single process on purpose
            dcp.load(sd, storage_reader=FastReader(d), no_dist=True)
        v = sd["version"]
        return v if same(sd, dcp_state(v, p["numel"], parts)) else f"torn: differs from version {v}"
    except Exception as e:  # noqa: BLE001
        return f"torn: {type(e).__name__}: {str(e)[:160]}"


def probe_latest_dir(mdir: str, p: dict) -> object:
    """Sharded manager: `latest` names a complete DCP checkpoint directory."""
    return probe_latest(mdir, p, probe_dcp, "missing or incomplete")


def probe_dcp1(d: str, p: dict) -> object:
    """A DCP checkpoint saved by one process (dcp_state of part r0)."""
    return probe_dcp(d, p, parts=(0,))


def probe_sharded_st(d: str, p: dict) -> object:
    """A sharded safetensors directory (fastckpt.safetensors.load_sharded), with the config.json
    saved beside its shards, which every re-save must keep."""
    import fastckpt.safetensors as fst
    from fastckpt._core.dircommit import resolve
    d = resolve(d)
    if not os.path.lexists(os.path.join(d, "model.safetensors.index.json")):
        return "absent"
    try:
        got = fst.load_sharded(d)
        with open(os.path.join(d, "config.json")) as f:
            if json.load(f) != {"kept": True}:
                return "torn: config.json changed"
        v = int(got["version"].item())
        got["version"] = v
        return v if same(got, make_state(v, p["numel"])) else f"torn: differs from version {v}"
    except Exception as e:  # noqa: BLE001
        return f"torn: {type(e).__name__}: {str(e)[:160]}"


# CHECKS[scenario]: (check name, mark key, directory or file relative to the mount, probe)
CHECKS = {
    "save": [("ck.pt", "ck.pt", "ck.pt", probe_file)],
    "async_save": [(k, k, k, probe_file) for k in ("a.pt", "b.pt", "c.pt")],
    "async_staged": [("s.pt", "s.pt", "s.pt", probe_staged_file)],
    "manager": [("latest", "latest", "m", probe_latest), ("load_latest", "latest", "m", probe_load_latest)],
    "dcp": [("dcp", "dcp", "d", probe_dcp)],
    "manager_sharded": [("latest", "latest", "s", probe_latest_dir)],
    # re-saves over an existing directory: save_sharded, a sharded manager re-saving its step 1,
    # fastckpt convert --to dcp --force (one process)
    "resave": [("st", "st", "st", probe_sharded_st), ("rs", "rs", "rs/step_00000001", probe_dcp1),
               ("cv", "cv", "cv", probe_dcp1)],
    "collective": [("col.pt", "col.pt", "col.pt", probe_file)],
    "full": [("full.pt", "full.pt", "full.pt", probe_file)],
    "manager_collective": [("latest", "latest", "mc", probe_latest), ("load_latest", "latest", "mc", probe_load_latest)],
    # the manager with a memory tier: checkpoints written from snapshots (a save of the snapshot's
    # step, and the persist that persist_on runs); a power cut empties the memory, so what counts
    # is the disk
    "manager_memory": [("latest", "latest", "mm", probe_latest), ("load_latest", "latest", "mm", probe_load_latest)],
}
# Scenarios whose processes write one file together: checked under crashfs's per-client model
# (a process's writes are durable only once it fsyncs the file itself, as on a shared filesystem).
PER_CLIENT = {"collective", "manager_collective", "full"}


# ---------------------------------------------------------------- the saves (in the child)
def run_save(mnt, p):
    for v in range(1, p["saves"] + 1):
        mark(mnt, "begin", "ck.pt", v)
        fastckpt.save(make_state(v, p["numel"]), os.path.join(mnt, "ck.pt"))
        mark(mnt, "end", "ck.pt", v)


def run_async_save(mnt, p):
    for v in range(1, p["saves"] + 1):
        mark(mnt, "begin", "a.pt", v)
        fastckpt.async_save(make_state(v, p["numel"]), os.path.join(mnt, "a.pt")).result()
        mark(mnt, "end", "a.pt", v)
        # two in flight at once (the second may wait for the first's snapshot slot)
        mark(mnt, "begin", "b.pt", v)
        mark(mnt, "begin", "c.pt", v)
        fb = fastckpt.async_save(make_state(v, p["numel"]), os.path.join(mnt, "b.pt"))
        fc = fastckpt.async_save(make_state(v, p["numel"]), os.path.join(mnt, "c.pt"))
        fb.result()
        mark(mnt, "end", "b.pt", v)
        fc.result()
        mark(mnt, "end", "c.pt", v)


def run_async_staged(mnt, p):
    """async_save with background staging: it returns before the large tensors are copied, and the
    knobs in the environment say who copies them (p["mode"] "split": the caller a share, the staging
    thread the rest) or whether they are written straight from their memory ("through"; "mixed":
    one of the three off its page phase, so the staging thread copies it, the others sent live). Each
    save's result must show that mode, so that the run cannot pass without exercising it."""
    path = os.path.join(mnt, "s.pt")
    for v in range(1, p["saves"] + 1):
        mark(mnt, "begin", "s.pt", v)
        sd = make_staged_state(v, p)
        if p["mode"] == "mixed":  # "wa" (first in the file) 64 bytes past a page: the staging thread copies it, the others go live
            sd["wa"] = page_aligned(sd["wa"], 64)
        res = fastckpt.async_save(sd, path, background_staging=True).result()
        mark(mnt, "end", "s.pt", v)
        if p["mode"] == "through":
            assert res.through_bytes > 0, res
        elif p["mode"] == "mixed":
            assert res.through_bytes == sd["wb"].nbytes + sd["wc"].nbytes, res
        else:
            assert res.through_bytes == 0 and fastckpt.knobs.get("async_caller_copy") > 0, res


def run_manager(mnt, p):
    n = p["saves"]
    with fastckpt.CheckpointManager(os.path.join(mnt, "m"), keep_last=2) as mgr:
        for step in range(1, n + 1):
            mark(mnt, "begin", "latest", step)
            mgr.save(step, make_state(step, p["numel"]))
            mark(mnt, "end", "latest", step)
        for step in range(n + 1, 2 * n + 1):
            mark(mnt, "begin", "latest", step)
            mgr.async_save(step, make_state(step, p["numel"])).result()  # durable, `latest` names it
            mark(mnt, "end", "latest", step)


def run_manager_memory(mnt, p):
    import shutil
    import tempfile
    from fastckpt.manager.memory import persist_newest
    mem = tempfile.mkdtemp(prefix="fastckpt-powerloss-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        mgr = fastckpt.CheckpointManager(os.path.join(mnt, "mm"), keep_last=2,
                                         memory=fastckpt.MemoryTier(directory=mem))
        for step in range(1, 2 * p["saves"] + 1):
            state = make_state(step, p["numel"])
            mgr.snapshot(step, state)
            mark(mnt, "begin", "latest", step)
            if step % 2:
                mgr.save(step, state)  # written from the snapshot
            else:
                persist_newest(mgr, mgr._memory)  # what persist_on's handler runs
            mark(mnt, "end", "latest", step)
        mgr.close()
    finally:
        shutil.rmtree(mem, ignore_errors=True)


def _spawn_ranks(mnt, p, role, world=2):
    from ports import free_port
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, role, mnt, json.dumps(p)], env=env))
    rcs = [pr.wait() for pr in procs]
    if any(rcs):
        raise SystemExit(f"{role} ranks exited with {rcs}")


def run_dcp(mnt, p):
    _spawn_ranks(mnt, p, "dcp_rank")


def run_manager_sharded(mnt, p):
    _spawn_ranks(mnt, p, "manager_sharded_rank")


def run_dcp_rank(mnt, p):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastWriter
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    try:
        for v in range(1, p["saves"] + 1):
            dist.barrier()
            if rank == 0:
                # a re-save into the same directory: the old checkpoint or the complete new one,
                # never neither (FastWriter writes it beside and exchanges the directories)
                mark(mnt, "begin", "dcp", v)
            dist.barrier()
            state, writer = make_state(v, p["numel"], part=f"r{rank}"), FastWriter(os.path.join(mnt, "d"))
            if v % 2:
                dcp.save(state, storage_writer=writer)
            else:  # every other one through dcp.async_save: durable once its future is done
                dcp.async_save(state, storage_writer=writer).result()
            dist.barrier()
            if rank == 0:
                mark(mnt, "end", "dcp", v)
    finally:
        dist.destroy_process_group()


def run_manager_sharded_rank(mnt, p):
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    try:
        n = p["saves"]
        with fastckpt.CheckpointManager(os.path.join(mnt, "s"), keep_last=2, sharded=True) as mgr:
            for step in range(1, 2 * n + 1):
                dist.barrier()
                if rank == 0:
                    mark(mnt, "begin", "latest", step)
                state = make_state(step, p["numel"], part=f"r{rank}")
                if step <= n:
                    mgr.save(step, state)
                else:
                    mgr.async_save(step, state).result()  # rank 0: durable, and `latest` names it
                if rank == 0:
                    mark(mnt, "end", "latest", step)
            mgr.wait()
    finally:
        dist.destroy_process_group()


def run_collective(mnt, p):
    _spawn_ranks(mnt, p, "collective_rank", world=3)


def run_collective_rank(mnt, p):
    """fastckpt.save(obj, path, group=pg) at world size 3, every rank its share of one
    temporary file through the mount, rank 0 the rest and the commit."""
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    if str(rank) in p.get("skip_sync_ranks", "").split(","):  # test_powerloss's check of the check
        os.environ["FASTCKPT_TEST_SKIP_SYNC"] = "data"
    dist.init_process_group("gloo")
    try:
        for v in range(1, p["saves"] + 1):
            dist.barrier()
            if rank == 0:
                mark(mnt, "begin", "col.pt", v)
            dist.barrier()
            fastckpt.save(make_state(v, p["numel"]), os.path.join(mnt, "col.pt"), group=dist.group.WORLD)
            if rank == 0:  # every rank returns only after the commit
                mark(mnt, "end", "col.pt", v)
    finally:
        dist.destroy_process_group()


def run_full(mnt, p):
    _spawn_ranks(mnt, p, "full_rank", world=2)


def run_full_rank(mnt, p):
    """A full-size save of sharded state at world size 2: make_state's tensors as Shard(0) DTensors,
    fastckpt.save(state, path, group=pg) with every rank writing its shards' blocks of one
    temporary file through the mount, rank 0 the shared blocks, the rest and the commit; the file
    holds the full tensors (make_state's), so it is probed as the collective save's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    rank = int(os.environ["RANK"])
    if str(rank) in p.get("skip_sync_ranks", "").split(","):  # test_powerloss's check of the check
        os.environ["FASTCKPT_TEST_SKIP_SYNC"] = "data"
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2,))
        for v in range(1, p["saves"] + 1):
            state = {k: distribute_tensor(t, mesh, [Shard(0)]) if isinstance(t, torch.Tensor) else t
                     for k, t in make_state(v, p["numel"]).items()}
            dist.barrier()
            if rank == 0:
                mark(mnt, "begin", "full.pt", v)
            dist.barrier()
            fastckpt.save(state, os.path.join(mnt, "full.pt"), group=dist.group.WORLD)
            if rank == 0:  # every rank returns only after the commit
                mark(mnt, "end", "full.pt", v)
    finally:
        dist.destroy_process_group()


def run_manager_collective(mnt, p):
    _spawn_ranks(mnt, p, "manager_collective_rank", world=3)


def run_manager_collective_rank(mnt, p):
    """CheckpointManager in replicated mode at world size 3: each checkpoint a collective save
    (every rank its share), then `latest` and retention; saves, then async_saves (collective
    too, written by every rank's writer thread), two in a row: the second waits for the first."""
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    try:
        n = p["saves"]
        with fastckpt.CheckpointManager(os.path.join(mnt, "mc"), keep_last=2) as mgr:
            for step in range(1, n + 1):
                dist.barrier()
                if rank == 0:
                    mark(mnt, "begin", "latest", step)
                dist.barrier()
                mgr.save(step, make_state(step, p["numel"]))
                if rank == 0:
                    mark(mnt, "end", "latest", step)
            for step in range(n + 1, 2 * n + 1, 2):
                pair = [s for s in (step, step + 1) if s <= 2 * n]
                dist.barrier()
                if rank == 0:
                    for s in pair:
                        mark(mnt, "begin", "latest", s)
                dist.barrier()
                futs = [mgr.async_save(s, make_state(s, p["numel"])) for s in pair]
                for s, fut in zip(pair, futs):
                    fut.result()  # on every rank: durable, and `latest` names it
                    if rank == 0:
                        mark(mnt, "end", "latest", s)
            mgr.wait()
    finally:
        dist.destroy_process_group()


def run_resave(mnt, p):
    """Each writer of directories re-saves over its own existing checkpoint, ``saves`` times."""
    import fastckpt.safetensors as fst
    from fastckpt.cli.command import main
    from fastckpt._core.atomic import write_file
    from fastckpt._core.engine import fsync_dir
    os.mkdir(os.path.join(mnt, "st"))  # a model directory: a file that is not the checkpoint's, kept by every save
    write_file(os.path.join(mnt, "st", "config.json"), b'{"kept": true}')
    fsync_dir(mnt)
    for v in range(1, p["saves"] + 1):
        st = make_state(v, p["numel"])
        st["version"] = torch.tensor(v)
        mark(mnt, "begin", "st", v)
        fst.save_sharded(st, os.path.join(mnt, "st"), max_shard_size=str(2 * p["numel"]) + "B")
        mark(mnt, "end", "st", v)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mark(mnt, "begin", "rs", v)
            with fastckpt.CheckpointManager(os.path.join(mnt, "rs"), keep_last=None, sharded=True) as mgr:
                mgr.save(1, make_state(v, p["numel"], part="r0"))
            mark(mnt, "end", "rs", v)
            src = os.path.join(mnt, f"src{v}.pt")
            fastckpt.save(make_state(v, p["numel"], part="r0"), src)
            mark(mnt, "begin", "cv", v)
            dst = os.path.join(mnt, "cv")
            if main(["convert", src, dst, "--to", "dcp", "--quiet"] + (["--force"] if v > 1 else [])) != 0:
                raise SystemExit("fastckpt convert failed")
            mark(mnt, "end", "cv", v)


RUN = {"save": run_save, "resave": run_resave, "async_save": run_async_save, "async_staged": run_async_staged, "manager": run_manager, "dcp": run_dcp,
       "dcp_rank": run_dcp_rank, "manager_sharded": run_manager_sharded,
       "manager_sharded_rank": run_manager_sharded_rank, "collective": run_collective,
       "collective_rank": run_collective_rank, "full": run_full, "full_rank": run_full_rank, "manager_collective": run_manager_collective,
       "manager_collective_rank": run_manager_collective_rank, "manager_memory": run_manager_memory}

if __name__ == "__main__":
    import ctypes
    import signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the test
    RUN[sys.argv[1]](sys.argv[2], json.loads(sys.argv[3]))
