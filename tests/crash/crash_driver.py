#!/usr/bin/env python
"""Crash-consistency driver: SIGKILL checkpoint saves at random moments and
check that nothing is lost (README "Guarantees").

    python tests/crash/crash_driver.py --kills 300 --seed 7    # every kind

Kinds: ``save`` (fastckpt.save), ``async_save`` (fastckpt.async_save; odd generations and the
``staging`` plan, which slows the staging thread's copy down, with background_staging=True; in the
write-through ones, one large tensor sent from its memory and the one before it copied by the
staging thread),
``manager`` (CheckpointManager, replicated single-file mode), ``dcp2``
(dcp.save with FastWriter, world size 2), ``sharded2`` (CheckpointManager in
sharded mode, world size 2: a DCP directory per step, written under a
temporary name and renamed, then `latest`; odd steps with async_save),
``dcp_async2`` (torch.distributed.checkpoint.async_save with FastWriter,
world size 2), ``collective3`` (fastckpt.save(obj, path, group=pg) of a
replicated state of several MB at world size 3: every rank writes its share of
one temporary file, rank 0 the rest and the commit), ``manager_async3``
(CheckpointManager.async_save in replicated collective mode at world size 3:
every rank snapshots the state of collective3, its writer thread writes its
share on the manager's group for background saves, rank 0 commits and moves
`latest`, every rank's future resolves after that), ``memory`` (CheckpointManager with a MemoryTier: a snapshot
into host memory, its background CRC and commit, then by turns a save of the
same step written from the snapshot, nothing more, or the persist that
``persist_on`` runs on a signal; a restarted manager must restore the
previous step or the new one, exactly, from memory or disk, never older than
the disk's `latest`), and the re-saves of a
directory over itself (one process; plans add ``fallback``: RENAME_EXCHANGE
refused, and ``old_copy``: slowed before the replaced copy is removed):
``resave_manager`` (a sharded CheckpointManager re-saving step 1),
``resave_convert`` (``fastckpt convert SRC DIR --to dcp --force``),
``resave_st`` (``fastckpt.safetensors.save_sharded`` over its directory) and
``resave_dcp`` (``dcp.save`` with FastWriter over its checkpoint): fastckpt's
reader of the kind must load the old checkpoint or the complete new one after
every kill, and after a manager start's cleanup the final name must still
hold that same one. Where a save is
asynchronous with several ranks, the source tensors are overwritten as soon as
the call returns: that must not reach the checkpoint.

Each round: a good previous checkpoint exists and its bytes are remembered; a
child process saves a fresh, different checkpoint over it (or, for DCP, into
the next step directory beside it) and is killed with SIGKILL at a random
moment. The child is slowed down by the engine's fault hook (a plan taken from
the environment variable FASTCKPT_CRASH_FAULTS, "op:nth:delay_ms[:path],...")
so that kills land during writes, in fdatasync (between the data and the
rename), just before the rename, in the directory fsync after it, during
the manager's `latest` update, and (sharded2) in its retention, between
renaming an old step directory aside and removing it. The kill moment is uniform over [0, 1.15 x]
the save's expected duration, per kind and plan (learnt from the saves that
finish first, and raised while kills keep landing near it, so that kills reach
the end of the save too). Then the parent checks:

* the previous checkpoint is bitwise what it was, or (the save completed) the
  final name holds the new checkpoint, which loads with verify=True and equals
  what was being saved; nothing else ever sits under a final name;
* manager: `latest` names a complete checkpoint that loads and is exact;
* DCP (world size 2, gloo on 127.0.0.1, each step in its own directory): the
  previous step's directory is untouched; the new one either has no
  `.metadata` (and dcp.load refuses it) or loads exactly with FastReader;
* world size 2 kinds: a round kills both ranks, or only rank 0, or only rank
  1; the survivor must then fail (or finish) on its own (gloo notices a dead
  peer at once; SURVIVOR_WAIT is the limit), and what it leaves is checked
  the same way;
* collective3: a round kills all three ranks, or one of them (0, 1 or 2);
  the final name holds the previous checkpoint bitwise or the complete new one
  (loads with verify=True, equals the new state), nothing else sits beside it
  but temporaries, and none when rank 0 survived (it removes its temporary
  file on any failure); every survivor ends on its own within SURVIVOR_WAIT, either
  done (then the new checkpoint is under the final name) or with an error that
  names the user's path and does not claim "nothing was committed" when the
  new checkpoint was committed; a round that leaves temporaries is followed by
  an uninterrupted collective save (3 fresh ranks) that must succeed and
  remove them (rank 0's temporary-file creation removes the leftovers of dead
  processes of the same target: no manager start needed);
* stalled peer (sharded2, once per run; --no-stall skips it): rank 1 is
  stopped with SIGSTOP right after an asynchronous save staged; rank 0 must
  fail within a few times the process group's timeout, not wait on;
* sharded2: `latest` names a complete step directory that loads exactly with
  FastReader; every `step_*` directory is complete and exact; the previous
  step is bitwise untouched; a manager start removes the leftovers
  (temporary step directories, `.del` directories of an interrupted
  retention, `latest`'s temporary) and its load_latest gives an exact step;
* stalled peer (collective3 and manager_async3, once per run each; --no-stall skips it): one rank
  (0, 1 or 2) is stopped with SIGSTOP at a random moment of a collective
  save with slow writes; the other two must fail within a few times the
  process group's timeout, with errors that name the path and match the file;
* manager_async3: a round kills all three ranks, or one of them; the previous
  step file is bitwise untouched; `latest` names the previous or the new step;
  whatever sits under a step name is complete and exact; no temporary is left
  when rank 0 survived; a survivor whose future resolved saw `latest` name the
  new step (it must, by then), one whose future failed got an error naming the
  new step's path, saying "nothing was committed" only if the new step file is
  not there; a manager start removes the leftovers and load_latest is exact;
* a manager start removes every `.fastckpt-tmp.` leftover, and the next save
  succeeds.

Children are forked from a multiprocessing forkserver that has torch and
fastckpt imported already (a kill round then costs milliseconds, not an
interpreter start). `--child KIND` runs one save in the foreground, for
reproducing a round by hand with FASTCKPT_CRASH_FAULTS set (world size 2
kinds: start it twice, with --rank 0 and --rank 1 and the same --port;
collective3: three times, --rank 0, 1 and 2).

Prints counts per kind, per fault plan and per outcome; exits 1 on any violation.
"""

import argparse
import collections
import hashlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Optional

sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from ports import free_port  # noqa: E402

TMP_MARK = ".fastckpt-tmp."
RESAVE = ("resave_manager", "resave_convert", "resave_st", "resave_dcp")  # re-saves of directories
KINDS = ("save", "async_save", "dcp2", "manager", "sharded2", "dcp_async2", "collective3", "manager_async3",
         "memory") + RESAVE
TWO_RANK = ("dcp2", "sharded2", "dcp_async2")
WORLD = {"dcp2": 2, "sharded2": 2, "dcp_async2": 2, "collective3": 3, "manager_async3": 3}  # several ranks
MANAGED = ("manager", "sharded2", "manager_async3", "memory")  # kinds whose saves end with the `latest` update
CHECKS = {"save": "file", "async_save": "file", "dcp_async2": "dcp2",  # kind -> its check_ method
          **{k: "resave" for k in RESAVE}}
PG_TIMEOUT = 10.0     # s: the children's process group timeout (the manager's own group takes it too)
# s: a rank whose peer was killed must exit on its own by then; gloo notices a dead peer at
# once, but should it not, a sharded async save can wait out two timeouts in a row
SURVIVOR_WAIT = 3 * PG_TIMEOUT + 5
STALL_TIMEOUT = 3.0   # s: the process group timeout of a stall check (see Driver.stall_check)
# name -> fault plan (FASTCKPT_CRASH_FAULTS syntax); {d} is a random delay in ms.
PLANS = {
    "none": "",
    "writes": "write:1:{d}",                       # kills land between/inside pwrites
    "fsync": "fsync:1:{D}",                        # in fdatasync, and in the directory fsync after the rename
    "rename": "rename:1:{D}",                      # data durable, not yet renamed
    "latest": "write:1:{D}:latest,fsync:1:{D}:latest,rename:1:{D}:latest",  # manager, sharded2: `latest`
    "retention": "retention:{D}",                  # sharded2: between renaming an old step aside and removing it
    "fallback": "noexchange,rename:1:{D}",         # re-saves: RENAME_EXCHANGE refused, the two renames slowed
    "old_copy": "retention:{D}",                   # re-saves: before the replaced copy is removed
    "staging": "staging:{D}",                      # async_save(background_staging=True): during its copy
}
ENV = "FASTCKPT_CRASH_FAULTS"
# Test-only, for the driver's own tests (test_crash_short.py): a deliberately broken collective
# save the checks must catch. "leave_temp": a failing rank 0 does not remove its temporary file.
# "latest_first" (manager_async3): rank 0 moves `latest` before the collective save writes the step.
BREAK_ENV = "FASTCKPT_CRASH_BREAK"


# ---------------------------------------------------------------- shared by parent and children

def make_state(gen: int, rank: int = 0):
    """The checkpoint content of generation ``gen``: deterministic, different per gen."""
    import torch
    from states import page_aligned
    g = torch.Generator().manual_seed(1000 * gen + rank)
    big = torch.randn(3 << 17, generator=g)
    w = torch.randn(256, 1024, generator=g)
    lag = torch.randn(5 << 16, generator=g)
    return {
        "gen": gen,
        "w": w,                                             # 1 MiB: 16 writes of 64 KiB
        # 1.25 MiB, over SMALL_SYNC but 64 bytes past a page boundary: background staging's thread
        # copies it, also where the writer sends "big" (after it in the file) from its memory
        "lag": page_aligned(lag, 64),
        # 1.5 MiB: over async_save's SMALL_SYNC, and on a page boundary (as torch allocates large tensors
        # under THP_MEM_ALLOC_ENABLE=1), so background staging writes it straight from its memory
        "big": page_aligned(big),
        "b": torch.randint(0, 1 << 30, (4099,), generator=g, dtype=torch.int64),
        "h": torch.randn(777, generator=g).to(torch.bfloat16),
        "meta": {"name": f"gen{gen}", "lr": 0.1 * gen},
    }


def collective_state(gen: int):
    """collective3's replicated state (every rank builds the same): about 5 MB in
    many dtypes, so that each of the 3 ranks writes a share of many 64 KiB
    writes; views and shared storages, odd lengths, empty tensors, non-tensors."""
    import torch
    g = torch.Generator().manual_seed(7000 + gen)
    big = torch.randn(600_000, generator=g)  # 2.4 MB: crosses share boundaries
    shared = torch.randn(50_000, generator=g, dtype=torch.float64)
    return {
        "gen": gen,
        "big": big, "big_view": big[1000:300_000],
        "f64": shared, "f64_2d": shared.view(500, 100),
        "bf16": torch.randn(300_001, generator=g).to(torch.bfloat16),
        "f16": torch.randn(123_457, generator=g).half(),
        "i8": torch.randint(-128, 127, (200_003,), generator=g, dtype=torch.int8),
        "i32": torch.randint(0, 1 << 30, (100_000,), generator=g, dtype=torch.int32),
        "i64": torch.randint(0, 1 << 62, (40_000,), generator=g, dtype=torch.int64),
        "bool": torch.rand(70_001, generator=g) > 0.5,
        "c64": torch.randn(20_000, generator=g, dtype=torch.complex64),
        "empty": torch.empty(0), "tiny": torch.tensor(float(gen)),
        "meta": {"name": f"gen{gen}", "lr": 0.1 * gen, "list": [1, "a", None]},
    }


def same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                                b.reshape(-1).view(torch.uint8) if b.numel() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def arm_faults(plan: str) -> None:
    """Arm the engine's fault hook from "op:nth:delay_ms[:path],..." (delays only);
    "retention:delay_ms" slows the manager's retention down instead (_slow_retention)."""
    from fastckpt import _C
    for rule in filter(None, plan.split(",")):
        if rule == "noexchange":  # as on a filesystem without renameat2(RENAME_EXCHANGE): the fallback
            os.environ["FASTCKPT_TEST_NO_EXCHANGE"] = "1"
            continue
        if rule.startswith("retention:"):
            _slow_retention(int(rule.split(":")[1]))
            continue
        if rule.startswith("staging:"):
            _slow_staging(int(rule.split(":")[1]))
            continue
        op, nth, delay, *rest = rule.split(":")
        _C.fault_inject(op, nth=int(nth), delay_ms=int(delay), times=0,
                        path_contains=rest[0] if rest else "")


def _slow_retention(delay_ms: int) -> None:
    """Test-only, in a child process: sharded CheckpointManager retention renames an
    old step directory to `.fastckpt-tmp.<key>.<pid>.<x>.del`, then removes it with
    shutil.rmtree (Python, out of the engine's fault hook's reach): sleep before that
    removal, so that kills land between the two."""
    import shutil
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        p = os.fspath(path)
        if p.endswith(".del") or (TMP_MARK in p and (p.endswith(".dcp") or p.endswith(".old"))):
            time.sleep(delay_ms / 1000)
        return real(path, *args, **kwargs)

    shutil.rmtree = rmtree


def _slow_staging(delay_ms: int) -> None:
    """Test-only, in a child process: async_save(background_staging=True)'s staging thread sleeps
    before its copies (Python and memcpy, out of the engine's fault hook's reach), so that kills
    land while the host tensors are still being copied and the save's writes wait for them."""
    from fastckpt.staging import snapshot
    real = snapshot.Snapshot.complete

    def complete(snap):
        time.sleep(delay_ms / 1000)
        return real(snap)

    snapshot.Snapshot.complete = complete


def _dcp_state(gen: int, rank: int) -> dict:
    """What rank ``rank`` saves in the world size 2 kinds: its own entries and a replicated one."""
    return {f"r{rank}": make_state(gen, rank), "shared": make_state(gen, 99)["w"]}


def _scribble(sd: dict) -> None:
    """Change a state dict in place (after an asynchronous save returned: must not reach the checkpoint)."""
    import torch
    for v in sd.values():
        if isinstance(v, dict):
            _scribble(v)
        elif isinstance(v, torch.Tensor) and v.numel():
            v.reshape(-1).view(torch.uint8).bitwise_not_()  # (a non-contiguous view: a copy, left alone)


def _child(kind: str, directory: str, gen: int, plan: str, conn, rank: int = 0, port: int = 0,
           memory_dir: Optional[str] = None) -> None:
    """One save (runs in a forked child, or in the foreground with --child). `memory_dir`: the
    memory kind's tier directory (None: the tier's default)."""
    try:
        _child_save(kind, directory, gen, plan, conn, rank, port, memory_dir)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        if isinstance(conn, _Stdout):
            raise
        try:
            conn.send(f"error {type(e).__name__}: {str(e)[:2000]}")
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(3)
    conn.send("done")


def _child_save(kind, directory, gen, plan, conn, rank, port, memory_dir) -> None:
    import faulthandler
    import fastckpt
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks a hung rank where it is
    stall = plan == "stall"  # Driver.stall_check: an asynchronous save, slow writes, a short timeout
    if stall:
        plan = "write:1:30"
    if plan:
        os.environ[ENV] = plan
    arm_faults(os.environ.get(ENV, ""))
    with fastckpt.knobs.override(buffer_size=64 << 10, buffer_count=4, queue_depth=4):
        if kind == "collective3":
            import datetime
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                                    timeout=datetime.timedelta(seconds=STALL_TIMEOUT if stall else PG_TIMEOUT))
            state = collective_state(gen)
            if os.environ.get(BREAK_ENV) == "leave_temp":
                fastckpt._C.RegionWriter.abort = lambda self: None  # the process leaves by os._exit
            conn.send("started")
            fastckpt.save(state, os.path.join(directory, "ckpt.pt"), group=dist.group.WORLD)
            conn.send("saved")
            dist.destroy_process_group()
            return
        if kind == "manager_async3":
            import datetime
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                                    timeout=datetime.timedelta(seconds=STALL_TIMEOUT if stall else PG_TIMEOUT))
            state = collective_state(gen)
            mgr = fastckpt.CheckpointManager(directory, keep_last=2)
            if os.environ.get(BREAK_ENV) == "latest_first":
                from fastckpt.manager import asyncsave as _manager_async
                real = _manager_async.write_snapshot

                def write_snapshot(path, snap, group):
                    if rank == 0:
                        mgr._commit(os.path.basename(path))
                    real(path, snap, group)
                _manager_async.write_snapshot = write_snapshot
            conn.send("started")
            fut = mgr.async_save(gen, state)
            conn.send("staged")
            _scribble(state)
            fut.result()
            conn.send("result")  # the future resolved: `latest` names the new step by now
            mgr.close()
            conn.send("saved")
            dist.destroy_process_group()
            return
        if kind in TWO_RANK:
            import datetime
            import gc
            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp
            from fastckpt.dcp import FastWriter
            # a short timeout (the manager's own group takes it too): a rank whose peer was killed or
            # stopped fails within it, not after 30 minutes
            timeout = STALL_TIMEOUT if stall else PG_TIMEOUT
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=timeout))
            sd = _dcp_state(gen, rank)
            if kind == "sharded2":
                mgr = fastckpt.CheckpointManager(directory, keep_last=2, sharded=True)
                conn.send("started")
                if gen % 2 or stall:
                    mgr.async_save(gen, sd)
                    conn.send("staged")
                    _scribble(sd)
                    mgr.wait()
                else:
                    mgr.save(gen, sd)
                mgr.close()
                del mgr
                conn.send("saved")
            else:
                writer = FastWriter(os.path.join(directory, f"step_{gen:04d}"))
                conn.send("started")
                if kind == "dcp2":
                    dcp.save(sd, storage_writer=writer)
                else:  # dcp_async2: staged into FastWriter's buffers on return, written by DCP's thread
                    fut = dcp.async_save(sd, storage_writer=writer)
                    conn.send("staged")
                    _scribble(sd)
                    getattr(fut, "upload_completion", fut).result()
                writer.close()
                conn.send("saved")
            dist.barrier()
            gc.collect()  # the manager's group goes while Python is alive
            dist.destroy_process_group()
            return
        if kind in RESAVE:
            conn.send("started")
            _resave(kind, directory, gen)
            conn.send("saved")
            return
        state = make_state(gen, rank)
        if kind == "memory":
            from fastckpt.manager.memory import persist_newest
            mgr = fastckpt.CheckpointManager(directory, keep_last=2,
                                             memory=fastckpt.MemoryTier(keep=2, directory=memory_dir))
            conn.send("started")
            mgr.snapshot(gen, state)
            if gen % 3 == 0:
                mgr.save(gen, state)  # written from the snapshot
            elif gen % 3 == 1:
                persist_newest(mgr, mgr._memory)  # what persist_on's handler runs
            mgr._memory.wait()  # no close(): it would free the snapshots
            conn.send("saved")
            return
        if kind == "manager":
            mgr = fastckpt.CheckpointManager(directory, keep_last=2)
            conn.send("started")
            if gen % 2:
                mgr.async_save(gen, state)
                mgr.wait()
            else:
                mgr.save(gen, state)
        else:
            path = os.path.join(directory, "ckpt.pt")
            conn.send("started")
            if kind == "async_save":  # background staging in odd generations and under the "staging" plan;
                background = gen % 2 == 1 or "staging:" in os.environ.get(ENV, "")  # written straight from
                with fastckpt.knobs.override(async_write_through=int(gen % 4 == 1),  # the tensors in 1 of 2,
                                             async_caller_copy=50 * (gen % 4 == 3)):  # half copied by the call in the other
                    res = fastckpt.async_save(state, path, background_staging=background).result()
                if background and gen % 4 == 1:  # the mix: "big" sent from its memory, "lag" copied (no fence here)
                    assert res.through_bytes == state["big"].nbytes, res
            else:
                fastckpt.save(state, path)
        conn.send("saved")


def _tensors(gen: int) -> dict:
    """The re-save kinds' state: make_state's tensors."""
    import torch
    return {k: v for k, v in make_state(gen).items() if isinstance(v, torch.Tensor)}


def _resave_target(kind: str, directory: str) -> str:
    return os.path.join(directory, "step_00000001" if kind == "resave_manager" else "ckpt")


def _resave(kind: str, directory: str, gen: int) -> None:
    """Save generation ``gen`` over the kind's existing checkpoint directory (the same name every round)."""
    import warnings
    import fastckpt
    target = _resave_target(kind, directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "resave_manager":  # a sharded manager re-saving an existing step
            mgr = fastckpt.CheckpointManager(directory, keep_last=None, sharded=True)
            mgr.save(1, _tensors(gen))
            mgr.close()
        elif kind == "resave_convert":  # fastckpt convert SRC DIR --to dcp --force
            from fastckpt.cli.command import main
            src = os.path.join(directory, "src.pt")
            fastckpt.save(_tensors(gen), src)
            force = ["--force"] if os.path.exists(target) else []
            if main(["convert", src, target, "--to", "dcp", "--quiet"] + force) != 0:
                raise RuntimeError("fastckpt convert failed")
        elif kind == "resave_st":  # fastckpt.safetensors.save_sharded over an existing directory
            import fastckpt.safetensors as fst
            fst.save_sharded(_tensors(gen), target, max_shard_size="300KB")
        else:  # dcp.save(..., storage_writer=FastWriter(dir)) over an existing checkpoint
            import torch.distributed.checkpoint as dcp
            from fastckpt.dcp import FastWriter
            dcp.save(_tensors(gen), storage_writer=FastWriter(target))


def _load_resave(kind: str, directory: str):
    """(generation, exact) of what fastckpt's reader of the kind loads from its target."""
    import warnings
    import torch
    target = _resave_target(kind, directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "resave_st":
            import fastckpt.safetensors as fst
            got = fst.load_sharded(target)
        else:
            import torch.distributed.checkpoint as dcp
            from fastckpt.dcp import FastReader
            got = {k: torch.zeros_like(v) for k, v in _tensors(0).items()}
            dcp.load(got, storage_reader=FastReader(target))
    return got


def _reap(procs, conns) -> None:
    """Every rank process of a stall check killed (a stopped one too) and joined, its pipes closed."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    for c in conns:
        c.close()


class _Stdout:
    def send(self, msg):
        print(msg, flush=True)


# ---------------------------------------------------------------- parent

def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tree_hash(directory) -> dict:
    return {n: _sha(os.path.join(directory, n)) for n in sorted(os.listdir(directory))}


def _load_dcp(directory):
    """Load a step directory of the world size 2 kinds with FastReader (CRCs checked) into
    a target whose every entry, non-tensors included, starts out different."""
    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastReader
    gen = int(os.path.basename(directory).split("_")[1])
    target = _blank_dcp()
    dcp.load(target, storage_reader=FastReader(directory, verify=True))
    return gen, target


def _blank_dcp() -> dict:
    """A load target shaped like _expected_dcp(gen): zero tensors, non-tensors of generation 0."""
    import torch
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor)
                else {kk: (torch.zeros_like(vv) if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()})
            for k, v in _expected_dcp(0).items()}


def _expected_dcp(gen):
    return {"r0": make_state(gen, 0), "r1": make_state(gen, 1), "shared": make_state(gen, 99)["w"]}


class Driver:
    def __init__(self, root: str, seed: int, verbose: bool = False):
        self.root = root
        self.rng = random.Random(seed)
        self.verbose = verbose
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "fastckpt", "torch.distributed.checkpoint", "fastckpt.dcp"])
        self.counts = collections.Counter()
        self.violations = []
        self.est = {}    # (kind, plan) -> seconds a save takes (see round())
        self.base = {}   # kind -> seconds its uninterrupted establishing save took
        self.last_timing = {}  # the last _run_children: seconds until every rank started, after the kill
        self.exact = set()   # (step directory, its file hashes) found to load exactly
        self.seconds = collections.Counter()  # kind -> wall time of its rounds (children and checks)
        self.gen = {}
        self.prev = {}   # kind -> what must still be there
        # the memory kind's snapshots: real shared memory, this run's own, named to every tier the
        # driver and its children make (not through the environment: a driver made inside a test
        # process would leave it set for the process's later tests)
        self.memory_dir = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else root, f"fastckpt-crash-{os.getpid()}")
        for k in KINDS:
            os.makedirs(os.path.join(root, k), exist_ok=True)

    def fail(self, kind, plan, msg):
        self.violations.append(f"[{kind}/{plan}] {msg}")
        print(f"VIOLATION [{kind}/{plan}]: {msg}", flush=True)

    @staticmethod
    def _step_dir(kind, d, g):
        return os.path.join(d, f"step_{g:08d}" if kind == "sharded2" else f"step_{g:04d}")

    # -- establishing a good previous checkpoint (in the parent, uninterrupted)
    def establish(self, kind):
        import fastckpt
        import torch.distributed.checkpoint as dcp  # noqa: F401
        d = os.path.join(self.root, kind)
        g = self.gen.get(kind, 0) + 1
        self.gen[kind] = g
        if kind in ("save", "async_save"):
            fastckpt.save(make_state(g), os.path.join(d, "ckpt.pt"))
            self.prev[kind] = (g, _sha(os.path.join(d, "ckpt.pt")))
        elif kind == "manager":
            fastckpt.CheckpointManager(d, keep_last=2).save(g, make_state(g))
            self.prev[kind] = (g, _sha(os.path.join(d, f"step_{g:08d}.pt")))
        elif kind == "memory":
            mgr = fastckpt.CheckpointManager(d, keep_last=2,
                                             memory=fastckpt.MemoryTier(keep=2, directory=self.memory_dir))
            mgr.snapshot(g, make_state(g))
            mgr.save(g, make_state(g))
            mgr._memory.wait()
            self.prev[kind] = (g, None)
        elif kind == "collective3":  # written here by a (non-killed) 3-rank run
            _, self.base[kind] = self._run_children(kind, g, "", kill_at=None)
            self.prev[kind] = (g, _sha(os.path.join(d, "ckpt.pt")))
        elif kind in RESAVE:
            _resave(kind, d, g)
            self.prev[kind] = (g, None)
        elif kind == "manager_async3":
            _, self.base[kind] = self._run_children(kind, g, "", kill_at=None)
            self.prev[kind] = (g, _sha(os.path.join(d, f"step_{g:08d}.pt")))
        else:  # a complete step directory, written here by a (non-killed) 2-rank run
            _, self.base[kind] = self._run_children(kind, g, "", kill_at=None)
            sd = self._step_dir(kind, d, g)
            self.prev[kind] = (g, _tree_hash(sd))
            if kind != "sharded2":
                for n in os.listdir(d):  # older steps are not needed any more
                    if n != os.path.basename(sd):
                        shutil.rmtree(os.path.join(d, n))

    def _run_children(self, kind, gen, plan, kill_at, victims=None):
        """Start the child(ren); SIGKILL the ranks in ``victims`` that have not
        finished saving ``kill_at`` seconds after they all started (None: let
        them finish). A round in which every rank reported its save done
        before ``kill_at`` kills nobody (what is left is tearing down the
        process group). A rank that was spared while its peer was killed must
        end by itself within SURVIVOR_WAIT seconds (how it ended is counted).
        Returns (killed, seconds the save took, or ran until the kill);
        self.last_survivors: {spared rank: (exit code, its messages)} of a
        round that killed someone."""
        d = os.path.join(self.root, kind)
        ranks = tuple(range(WORLD.get(kind, 1)))
        victims = ranks if victims is None else victims
        port = free_port() if kind in WORLD else 0
        self.last_survivors = {}
        procs, conns = [], []
        t_start = time.monotonic()
        for r in ranks:
            a, b = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=_child, args=(kind, d, gen, plan, b, r, port, self.memory_dir), daemon=True)
            p.start()
            b.close()
            procs.append(p)
            conns.append(a)
        msgs = {r: [] for r in ranks}     # messages of each rank
        saved_at = {}                     # rank -> when it reported its save done

        def drain():
            for r, c in zip(ranks, conns):
                try:
                    while c.poll(0):
                        m = c.recv()
                        msgs[r].append(m)
                        if m == "saved":
                            saved_at[r] = time.monotonic()
                except (EOFError, OSError):
                    pass

        try:
            for r, c in zip(ranks, conns):
                if not c.poll(120):
                    raise RuntimeError(f"{kind}: rank {r} never started")
                try:
                    m = c.recv()
                except EOFError:
                    m = "nothing (it died)"
                if m != "started":
                    raise RuntimeError(f"{kind}: rank {r} failed before saving: {m}")
            t0 = time.monotonic()
            self.last_timing = {"start": t0 - t_start}
            deadline = t0 + (kill_at if kill_at is not None else 120)
            while time.monotonic() < deadline and len(saved_at) < len(ranks) and any(p.is_alive() for p in procs):
                for p in procs:
                    p.join(timeout=0.001)
                drain()
            drain()
            took = (max(saved_at.values()) if len(saved_at) == len(ranks) else time.monotonic()) - t0
            doomed = []
            if len(saved_at) < len(ranks):
                if kill_at is None:
                    for p in procs:  # where it hangs: faulthandler's dump of every thread, on stderr
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    raise RuntimeError(f"{kind}: uninterrupted save did not finish: {msgs} (alive: "
                                       f"{[p.is_alive() for p in procs]}, exit codes {[p.exitcode for p in procs]})")
                doomed = [p for r, p in zip(ranks, procs) if p.is_alive() and r in victims]
            for p in doomed:
                os.kill(p.pid, signal.SIGKILL)
            spared = [(r, p) for r, p in zip(ranks, procs) if p not in doomed]
            # a spared rank ends by itself: it finishes, or fails because its peer died
            limit = time.monotonic() + (SURVIVOR_WAIT if doomed else 120)
            for _, p in spared:
                p.join(timeout=max(0.0, limit - time.monotonic()))
            for p in doomed:
                p.join()
            drain()
            self.last_timing["end"] = time.monotonic() - t0 - took
            if not doomed:
                for r, p in spared:
                    if p.exitcode != 0 or msgs[r][-1:] != ["done"]:
                        raise RuntimeError(f"{kind}: rank {r} exited {p.exitcode} without finishing: {msgs[r]}")
                return False, took
            for r, p in spared:
                if p.is_alive():
                    print(f"rank {r} (pid {p.pid}) hangs; its threads:", file=sys.stderr, flush=True)
                    os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    os.kill(p.pid, signal.SIGKILL)
                    p.join()
                    self.fail(kind, plan or "none", f"rank {r} hung for {SURVIVOR_WAIT:.0f} s after its peer was killed")
                    self.counts[(kind, "survivor_hung")] += 1
                else:
                    fine = msgs[r][-1:] == ["done"]
                    self.counts[(kind, "survivor_finished" if fine else "survivor_failed")] += 1
                    self.last_survivors[r] = (p.exitcode, list(msgs[r]))
                    if self.verbose:
                        print(f"    rank {r} survived the kill of its peer: exit {p.exitcode}, {msgs[r][-1:]}", flush=True)
            return True, took
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                    p.join()
            for c in conns:
                c.close()

    def round(self, kind):
        t0 = time.monotonic()
        try:
            return self._round(kind)
        finally:
            self.seconds[kind] += time.monotonic() - t0

    def _round(self, kind):
        plans = (["none", "writes", "fsync", "rename"] + (["latest"] if kind in MANAGED else [])
                 + (["retention"] if kind == "sharded2" else []) + (["staging"] if kind == "async_save" else []) + (["fallback", "old_copy"] if kind in RESAVE else []))
        plan_name = self.rng.choice(plans)
        plan = PLANS[plan_name].format(d=self.rng.randint(5, 40), D=self.rng.randint(100, 400))
        # world size 2: kill both ranks (half the rounds), or only one of them;
        # world size 3: all three (a quarter of the rounds), or one of them
        victims = tuple(range(WORLD.get(kind, 1)))
        if kind in TWO_RANK:
            victims = self.rng.choice([(0, 1), (0, 1), (0,), (1,)])
        elif kind in WORLD:
            victims = self.rng.choice([victims] + [(r,) for r in victims])
        if kind not in self.prev:
            self.establish(kind)
        old_gen = self.prev[kind][0]
        new_gen = old_gen + 1
        est = self.est.get((kind, plan_name), max(0.4, self.base.get(kind, 0.0)))
        kill_at = self.rng.uniform(0, est * 1.15)
        try:
            killed, took = self._run_children(kind, new_gen, plan, kill_at, victims)
        except Exception as e:  # noqa: BLE001
            self.fail(kind, plan_name, f"child failed: {e}")
            return False
        # The estimate follows the saves that finished; a kill close to the estimate says the
        # save takes longer than that (else kills would never reach its end: the rename, `latest`).
        if not killed:
            self.est[(kind, plan_name)] = 0.6 * est + 0.4 * took
        elif kill_at > 0.9 * est:
            self.est[(kind, plan_name)] = 1.5 * est
        self.counts[(kind, "killed" if killed else "finished")] += 1
        if killed and kind in WORLD:
            self.counts[(kind, "killed_" + (("both" if len(victims) == 2 else "all") if len(victims) > 1
                                            else f"rank{victims[0]}"))] += 1
        try:
            outcome = getattr(self, "check_" + CHECKS.get(kind, kind))(kind, old_gen, new_gen, killed)
        except Exception as e:  # noqa: BLE001
            self.fail(kind, plan_name, f"check raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
            outcome = "error"
        self.counts[(kind, plan_name, outcome)] += 1
        self.counts[(kind, outcome)] += 1
        if killed and outcome == "new_complete":
            self.counts[(kind, "killed_after_rename")] += 1
        if self.verbose:
            tm = " ".join(f"{k}={v:.2f}s" for k, v in self.last_timing.items())
            print(f"{kind:10s} {plan_name:7s} {tm} est={est:.3f}s took={took:.3f}s kill_at={kill_at:.3f}s victims={victims} killed={killed} -> {outcome}",
                  flush=True)
        return killed

    # -- checks
    def _exact_dcp(self, directory) -> bool:
        """Whether the step directory loads (FastReader, CRCs checked) to exactly what
        generation <its name> saved. Bytes found exact before are not loaded again."""
        key = (directory, tuple(_tree_hash(directory).items()))
        if key in self.exact:
            return True
        gen, got = _load_dcp(directory)
        if not same(got, _expected_dcp(gen)):
            return False
        self.exact.add(key)
        return True

    def _cleanup_with_manager(self, d):
        import fastckpt
        import warnings
        # Its start removes leftovers of dead processes, but only once their
        # lock is free: a process SIGKILLed with io_uring writes in flight is
        # reaped before the kernel's asynchronous ring teardown drops the last
        # reference to its temporary file (and with it the flock), so the
        # file can look live for a moment after join(). Up to ~3 s of starts.
        for _ in range(30):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fastckpt.CheckpointManager(d, keep_last=None)
            left = [n for n in os.listdir(d) if TMP_MARK in n]
            if not left:
                return
            time.sleep(0.1)
        raise AssertionError(f"manager start left temporaries: {left}")

    def _single_file_names(self, kind, killed):
        """The kind's directory, its final path and its temporary files; nothing
        else may be there, and a save that was not killed leaves no temporary."""
        d = os.path.join(self.root, kind)
        names = os.listdir(d)
        tmps = [n for n in names if TMP_MARK in n]
        others = [n for n in names if TMP_MARK not in n and n != "ckpt.pt"]
        if others:
            raise AssertionError(f"unexpected names {others}")
        if not killed and tmps:
            raise AssertionError(f"a completed save left {tmps}")
        return d, os.path.join(d, "ckpt.pt"), tmps

    def check_file(self, kind, old_gen, new_gen, killed):
        d, path, tmps = self._single_file_names(kind, killed)
        outcome = self._old_or_new(kind, path, old_gen, new_gen, make_state)
        if tmps:
            self.counts[(kind, "leftover_tmp")] += 1
            self._cleanup_with_manager(d)
        return outcome

    def check_collective3(self, kind, old_gen, new_gen, killed):
        """The final name holds the old checkpoint bitwise or the new one complete (check_file);
        each survivor of the round ended as the final name says; leftovers go with the next
        collective save."""
        _, path, tmps = self._single_file_names(kind, killed)
        outcome = self._old_or_new(kind, path, old_gen, new_gen, collective_state)
        for r, (code, msgs) in sorted(self.last_survivors.items()):
            last = msgs[-1] if msgs else f"nothing (exit code {code})"
            if last == "done":
                if outcome != "new_complete":
                    raise AssertionError(f"survivor rank {r} returned from the save, but {path} holds the "
                                         "previous checkpoint")
            elif not last.startswith("error "):
                raise AssertionError(f"survivor rank {r} ended without raising: {last}")
            elif path not in last:
                raise AssertionError(f"survivor rank {r}'s error does not name {path}: {last}")
            elif (outcome == "new_complete" and "nothing was committed" in last
                  and "nothing was committed unless" not in last):
                raise AssertionError(f"survivor rank {r}'s error says nothing was committed, but {path} holds "
                                     f"the new checkpoint: {last}")
            elif outcome == "old_intact" and "was committed (complete" in last:
                raise AssertionError(f"survivor rank {r}'s error says the new checkpoint was committed, but "
                                     f"{path} holds the previous one: {last}")
        if tmps and 0 in self.last_survivors:
            raise AssertionError(f"rank 0 survived the round (it created the temporary file and removes it on "
                                 f"any failure) but {tmps} remain")
        if tmps:
            self.counts[(kind, "leftover_tmp")] += 1
            self._collective_cleanup_save(kind, path, tmps)
        return outcome

    def _collective_cleanup_save(self, kind, path, tmps):
        """After a round that left temporaries: an uninterrupted collective save by 3 fresh
        ranks succeeds and removes them (no manager start)."""
        g = self.prev[kind][0] + 1
        self._run_children(kind, g, "", kill_at=None)
        left = [n for n in os.listdir(os.path.dirname(path)) if TMP_MARK in n]
        if left:
            raise AssertionError(f"the next collective save left temporaries {left} (before it: {tmps})")
        self._old_or_new(kind, path, g, g, collective_state, must_be_new=True)
        self.counts[(kind, "cleanup_save_ok")] += 1

    def _old_or_new(self, kind, path, old_gen, new_gen, state_of, must_be_new=False):
        """Whether ``path`` holds the previous checkpoint bitwise ("old_intact") or the
        new one complete and exact ("new_complete"); anything else raises."""
        import fastckpt
        if not must_be_new and _sha(path) == self.prev[kind][1]:
            if not same(fastckpt.load(path, verify=True), state_of(old_gen)):
                raise AssertionError("old checkpoint loads but differs from what was saved")
            return "old_intact"
        try:
            got = fastckpt.load(path, verify=True)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"{path} is neither the previous checkpoint nor a complete one: "
                                 f"{type(e).__name__}: {e}") from e
        if not same(got, state_of(new_gen)):
            raise AssertionError("final name holds neither the old nor the new checkpoint")
        self.prev[kind] = (new_gen, _sha(path))
        self.gen[kind] = new_gen
        return "new_complete"

    def check_manager(self, kind, old_gen, new_gen, killed):
        import fastckpt
        d = os.path.join(self.root, kind)
        old_name, new_name = f"step_{old_gen:08d}.pt", f"step_{new_gen:08d}.pt"
        names = os.listdir(d)
        tmps = [n for n in names if TMP_MARK in n]
        if not killed and tmps:
            raise AssertionError(f"a completed save left {tmps}")
        if _sha(os.path.join(d, old_name)) != self.prev[kind][1]:
            raise AssertionError(f"{old_name} changed")
        latest = open(os.path.join(d, "latest")).read().strip()
        if latest not in (old_name, new_name):
            raise AssertionError(f"latest names {latest!r}")
        for n in names:  # whatever sits under a step name is complete
            if TMP_MARK not in n and n.startswith("step_"):
                g = int(n[5:13])
                if not same(fastckpt.load(os.path.join(d, n), verify=True), make_state(g)):
                    raise AssertionError(f"{n} is not what was saved")
        if tmps:
            self.counts[(kind, "leftover_tmp")] += 1
        if os.path.exists(os.path.join(d, new_name)) and latest == old_name:
            self.counts[(kind, "new_file_latest_old")] += 1
        mgr = fastckpt.CheckpointManager(d, keep_last=2)  # cleans leftovers
        left = [n for n in os.listdir(d) if TMP_MARK in n]
        if left:
            raise AssertionError(f"manager start left temporaries: {left}")
        r = mgr.load_latest()
        if r is None or not same(r.state, make_state(r.step)) or r.step not in (old_gen, new_gen):
            raise AssertionError(f"load_latest gave {r and r.step}")
        if latest == new_name:
            if r.step != new_gen:
                raise AssertionError("load_latest skipped the checkpoint latest names")
            self.prev[kind] = (new_gen, _sha(os.path.join(d, new_name)))
            self.gen[kind] = new_gen
            return "new_complete"
        if os.path.exists(os.path.join(d, new_name)):
            # complete but `latest` not moved yet: drop it, so the next round starts from a known state
            os.unlink(os.path.join(d, new_name))
        return "old_intact"

    def check_memory(self, kind, old_gen, new_gen, killed):
        """The memory tier: every step file on disk is complete and exact, `latest` names one;
        a restarted manager (after its cleanup) restores the previous or the new step exactly,
        the new one if the round finished, never one older than the disk's `latest`."""
        import fastckpt
        import warnings
        d = os.path.join(self.root, kind)
        names = os.listdir(d)
        latest = open(os.path.join(d, "latest")).read().strip()
        if not latest.startswith("step_") or latest not in names:
            raise AssertionError(f"latest names {latest!r}, which is not a checkpoint there")
        disk = int(latest[5:13])
        for n in names:
            if TMP_MARK not in n and n.startswith("step_"):
                if not same(fastckpt.load(os.path.join(d, n), verify=True), make_state(int(n[5:13]))):
                    raise AssertionError(f"{n} is not what was saved")
        if any(TMP_MARK in n for n in names):
            self.counts[(kind, "leftover_tmp")] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr = fastckpt.CheckpointManager(d, keep_last=2,
                                             memory=fastckpt.MemoryTier(keep=2, directory=self.memory_dir))
            r = mgr.load_latest()
        if any(TMP_MARK in n for n in os.listdir(d)):
            raise AssertionError("manager start left temporaries")
        if r is None or r.step not in (old_gen, new_gen) or r.step < disk:
            raise AssertionError(f"load_latest gave step {r and r.step} (previous {old_gen}, new {new_gen}, "
                                 f"disk {disk})")
        if not same(r.state, make_state(r.step)):
            raise AssertionError(f"step {r.step} restored from {r.path} is not what was saved")
        if not killed and r.step != new_gen:
            raise AssertionError(f"a finished round restored step {r.step}, not {new_gen}")
        self.counts[(kind, "from_memory" if r.path.startswith(self.memory_dir) else "from_disk")] += 1
        self.prev[kind] = (r.step, None)
        self.gen[kind] = r.step
        return "new_complete" if r.step == new_gen else "old_intact"

    def check_manager_async3(self, kind, old_gen, new_gen, killed):
        """The manager's collective async save: the previous step intact, `latest` names a
        complete step, every step file exact; each survivor ended as the directory says; a
        manager start cleans up and load_latest is exact."""
        import fastckpt
        d = os.path.join(self.root, kind)
        old_name, new_name = f"step_{old_gen:08d}.pt", f"step_{new_gen:08d}.pt"
        new_path = os.path.join(d, new_name)
        names = os.listdir(d)
        tmps = [n for n in names if TMP_MARK in n]
        others = [n for n in names if TMP_MARK not in n and n != "latest" and not n.startswith("step_")]
        if others:
            raise AssertionError(f"unexpected names {others}")
        if not killed and tmps:
            raise AssertionError(f"a completed save left {tmps}")
        if tmps and 0 in self.last_survivors:
            raise AssertionError(f"rank 0 survived the round but {tmps} remain")
        if _sha(os.path.join(d, old_name)) != self.prev[kind][1]:
            raise AssertionError(f"{old_name} changed")
        latest = open(os.path.join(d, "latest")).read().strip()
        if latest not in (old_name, new_name):
            raise AssertionError(f"latest names {latest!r}")
        for n in names:  # whatever sits under a step name is complete and exact
            if TMP_MARK not in n and n.startswith("step_"):
                if not same(fastckpt.load(os.path.join(d, n), verify=True), collective_state(int(n[5:13]))):
                    raise AssertionError(f"{n} is not what was saved")
        new_there = os.path.exists(new_path)
        for r, (code, msgs) in sorted(self.last_survivors.items()):
            last = msgs[-1] if msgs else f"nothing (exit code {code})"
            if "result" in msgs and latest != new_name:
                raise AssertionError(f"survivor rank {r}'s future resolved, but latest names {latest!r}")
            if last == "done":
                continue
            if not last.startswith("error "):
                raise AssertionError(f"survivor rank {r} ended without raising: {last}")
            if "staged" in msgs and "result" not in msgs and new_path not in last:
                raise AssertionError(f"survivor rank {r}'s failed future does not name {new_path}: {last}")
            if new_there and "nothing was committed" in last and "nothing was committed unless" not in last:
                raise AssertionError(f"survivor rank {r}'s error says nothing was committed, but {new_name} is "
                                     f"there: {last}")
            if not new_there and "was committed (complete" in last:
                raise AssertionError(f"survivor rank {r}'s error says {new_name} was committed, but it is not "
                                     f"there: {last}")
        if tmps:
            self.counts[(kind, "leftover_tmp")] += 1
        if new_there and latest == old_name:
            self.counts[(kind, "new_file_latest_old")] += 1
        self._cleanup_with_manager(d)  # a manager start removes the leftovers
        r = fastckpt.CheckpointManager(d, keep_last=2).load_latest()
        if r is None or r.step not in (old_gen, new_gen) or not same(r.state, collective_state(r.step)):
            raise AssertionError(f"load_latest gave {r and r.step}")
        if latest == new_name:
            if r.step != new_gen:
                raise AssertionError("load_latest skipped the checkpoint latest names")
            self.prev[kind] = (new_gen, _sha(new_path))
            self.gen[kind] = new_gen
            return "new_complete"
        if new_there:
            # complete but `latest` not moved yet: drop it, so the next round starts from a known state
            os.unlink(new_path)
        return "old_intact"

    def check_dcp2(self, kind, old_gen, new_gen, killed):
        from fastckpt.dcp import FastReader
        d = os.path.join(self.root, kind)
        old_dir, new_dir = os.path.join(d, f"step_{old_gen:04d}"), os.path.join(d, f"step_{new_gen:04d}")
        if _tree_hash(old_dir) != self.prev[kind][1]:
            raise AssertionError("the previous step directory changed")
        if not self._exact_dcp(old_dir):
            raise AssertionError("previous step loads but differs")
        if os.path.exists(os.path.join(new_dir, ".metadata")):
            if not self._exact_dcp(new_dir):
                raise AssertionError("new step has .metadata but differs from what was saved")
            if [n for n in os.listdir(new_dir) if TMP_MARK in n]:
                raise AssertionError("complete DCP checkpoint with temporaries in it")
            shutil.rmtree(old_dir)
            self.prev[kind] = (new_gen, _tree_hash(new_dir))
            self.gen[kind] = new_gen
            return "new_complete"
        if not killed:
            raise AssertionError("finished save without .metadata")
        if os.path.isdir(new_dir):
            try:
                FastReader(new_dir).read_metadata()
            except FileNotFoundError as e:  # must be refused, clearly
                if "not a complete DCP checkpoint" not in str(e):
                    raise AssertionError(f"incomplete DCP dir refused with an unclear error: {e}")
            else:
                raise AssertionError("an incomplete DCP directory has readable metadata")
            if [n for n in os.listdir(new_dir) if TMP_MARK in n]:
                self.counts[(kind, "leftover_tmp")] += 1
            shutil.rmtree(new_dir)  # FORMAT.md 2.4: MAY be deleted
        return "old_intact"

    def check_resave(self, kind, old_gen, new_gen, killed):
        """A re-save of the same directory: fastckpt's reader of the kind loads the old checkpoint
        or the complete new one (exactly), also where an interrupted fallback left the old copy
        aside; a manager start (the cleanup of temporaries) leaves the final name holding the same
        generation, and nothing else beside it."""
        d = os.path.join(self.root, kind)
        target = _resave_target(kind, d)
        got = _load_resave(kind, d)
        gen = next((g for g in (old_gen, new_gen) if same(got, _tensors(g))), None)
        if gen is None:
            raise AssertionError(f"{target} loads as neither generation {old_gen} nor {new_gen} (torn or mixed)")
        if not killed and gen != new_gen:
            raise AssertionError("a finished re-save left the old checkpoint")
        if not os.path.isdir(target):
            self.counts[(kind, "final_name_missing")] += 1  # the fallback's window: the copy aside was read
        left = [n for n in os.listdir(d) if TMP_MARK in n]
        if left:
            self.counts[(kind, "leftover_tmp")] += 1
            self._cleanup_with_manager(d)
        if not os.path.isdir(target):
            raise AssertionError(f"after the cleanup {target} is missing")
        after = _load_resave(kind, d)
        if not same(after, _tensors(gen)):
            raise AssertionError(f"after the cleanup {target} no longer loads as generation {gen}")
        others = [n for n in os.listdir(d) if n not in (os.path.basename(target), "latest", "src.pt")]
        if others:
            raise AssertionError(f"unexpected names beside {target}: {others}")
        self.prev[kind] = (gen, None)
        self.gen[kind] = max(self.gen.get(kind, 0), new_gen)
        return "new_complete" if gen == new_gen else "old_intact"

    def check_sharded2(self, kind, old_gen, new_gen, killed):
        import warnings
        import fastckpt
        d = os.path.join(self.root, kind)
        old_name, new_name = f"step_{old_gen:08d}", f"step_{new_gen:08d}"
        names = os.listdir(d)
        tmps = [n for n in names if TMP_MARK in n]
        if not killed and tmps:
            raise AssertionError(f"a completed save left {tmps}")
        if _tree_hash(os.path.join(d, old_name)) != self.prev[kind][1]:
            raise AssertionError(f"{old_name} changed")
        latest = open(os.path.join(d, "latest")).read().strip()
        if latest not in (old_name, new_name):
            raise AssertionError(f"latest names {latest!r}")
        others = [n for n in names if TMP_MARK not in n and n != "latest" and not n.startswith("step_")]
        if others:
            raise AssertionError(f"unexpected names {others}")
        for n in names:  # whatever sits under a step name is a complete checkpoint, and exact
            if TMP_MARK in n or not n.startswith("step_"):
                continue
            if not os.path.isfile(os.path.join(d, n, ".metadata")):
                raise AssertionError(f"{n} sits under its final name without .metadata")
            if [m for m in os.listdir(os.path.join(d, n)) if TMP_MARK in m]:
                raise AssertionError(f"{n} holds temporaries")
            if not self._exact_dcp(os.path.join(d, n)):
                raise AssertionError(f"{n} loads but is not what was saved")
        if tmps:
            self.counts[(kind, "leftover_tmp")] += 1
            if any(n.endswith(".del") for n in tmps):
                self.counts[(kind, "leftover_retention")] += 1
        new_dir = os.path.join(d, new_name)
        if os.path.exists(new_dir) and latest == old_name:
            self.counts[(kind, "new_file_latest_old")] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr = fastckpt.CheckpointManager(d, keep_last=2, sharded=True)  # cleans leftovers
            left = [n for n in os.listdir(d) if TMP_MARK in n]
            if left:
                raise AssertionError(f"manager start left temporaries: {left}")
            r = mgr.load_latest(state=_blank_dcp())
        if r is None or r.step not in (old_gen, new_gen) or not same(r.state, _expected_dcp(r.step)):
            raise AssertionError(f"load_latest gave {r and r.step}")
        if latest == new_name:
            if r.step != new_gen:
                raise AssertionError("load_latest skipped the checkpoint latest names")
            self.prev[kind] = (new_gen, _tree_hash(new_dir))
            self.gen[kind] = new_gen
            return "new_complete"
        if os.path.exists(new_dir):
            # complete but `latest` not moved yet: drop it, so the next round starts from a known state
            shutil.rmtree(new_dir)
        return "old_intact"

    def stall_check(self):
        """sharded2, once: rank 1 stops responding (SIGSTOP) right after an asynchronous
        save staged, while rank 0 writes in the background. Rank 0 must fail by itself
        within a few times its process group's timeout (STALL_TIMEOUT), not wait on; then
        rank 1 is killed and what is left is checked like a kill's."""
        kind = "sharded2"
        if kind not in self.prev:
            self.establish(kind)
        old_gen = self.prev[kind][0]
        d = os.path.join(self.root, kind)
        port = free_port()
        procs, conns = [], []
        for r in (0, 1):
            a, b = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=_child, args=(kind, d, old_gen + 1, "stall", b, r, port), daemon=True)
            p.start()
            b.close()
            procs.append(p)
            conns.append(a)
        limit = 4 * STALL_TIMEOUT + 5
        try:
            msgs = [[], []]
            deadline = time.monotonic() + 120
            while "staged" not in msgs[1]:
                if time.monotonic() > deadline or not procs[1].is_alive():
                    raise RuntimeError(f"rank 1 did not stage a save: {msgs}")
                if conns[1].poll(0.01):
                    msgs[1].append(conns[1].recv())
            os.kill(procs[1].pid, signal.SIGSTOP)
            t0 = time.monotonic()
            procs[0].join(timeout=limit)
            took = time.monotonic() - t0
            if procs[0].is_alive():
                print("rank 0 hangs beside a stopped rank 1; its threads:", file=sys.stderr, flush=True)
                os.kill(procs[0].pid, signal.SIGUSR1)
                time.sleep(1.0)
                self.fail(kind, "stall", f"rank 0 still waits {limit:.0f} s after rank 1 stopped responding "
                          f"(process group timeout {STALL_TIMEOUT:.0f} s)")
                self.counts[(kind, "stall_hung")] += 1
            else:
                try:
                    while conns[0].poll(0):
                        msgs[0].append(conns[0].recv())
                except EOFError:
                    pass
                if not (msgs[0] and msgs[0][-1].startswith("error")):
                    self.fail(kind, "stall", f"rank 0 ended without an error beside a stopped rank 1: {msgs[0]}")
                self.counts[(kind, "stall_failed_in")] = max(self.counts[(kind, "stall_failed_in")], took)
                if self.verbose:
                    print(f"    stall: rank 0 ended {took:.1f} s after rank 1 stopped: {msgs[0][-1:]}", flush=True)
        except (RuntimeError, EOFError, OSError) as e:
            self.fail(kind, "stall", f"stall check could not run: {e!r}\n{traceback.format_exc()}")
            return
        finally:
            _reap(procs, conns)
        self.stall_verdict(kind, self.check_sharded2, old_gen)

    def collective_stall_check(self, kind="collective3"):
        """collective3 (and manager_async3), once: one rank (0, 1 or 2) stops responding
        (SIGSTOP) at a random moment of a collective save (slow writes, process group timeout
        STALL_TIMEOUT; manager_async3: the manager's group of background saves takes it too). The
        other two must end by themselves within a few times that timeout (a stopped peer keeps
        its connections open: only the timeout tells), with errors that name the path and
        match the file; then the stopped rank is killed and the round checked like a kill's."""
        if kind not in self.prev:
            self.establish(kind)
        old_gen = self.prev[kind][0]
        d = os.path.join(self.root, kind)
        victim = self.rng.randrange(3)
        port = free_port()
        procs, conns = [], []
        for r in range(3):
            a, b = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=_child, args=(kind, d, old_gen + 1, "stall", b, r, port), daemon=True)
            p.start()
            b.close()
            procs.append(p)
            conns.append(a)
        limit = 4 * STALL_TIMEOUT + 5
        msgs = [[], [], []]

        def drain(r):
            try:
                while conns[r].poll(0):
                    msgs[r].append(conns[r].recv())
            except (EOFError, OSError):
                pass

        try:
            for r in range(3):
                if not conns[r].poll(120):
                    raise RuntimeError(f"rank {r} never started")
                msgs[r].append(conns[r].recv())
            time.sleep(self.rng.uniform(0, 0.8 * max(0.4, self.base.get(kind, 0.4))))
            os.kill(procs[victim].pid, signal.SIGSTOP)
            t0 = time.monotonic()
            took = 0.0
            self.last_survivors = {}
            for r in range(3):
                if r == victim:
                    continue
                procs[r].join(timeout=max(0.0, t0 + limit - time.monotonic()))
                drain(r)
                if procs[r].is_alive():
                    print(f"rank {r} hangs beside a stopped rank {victim}; its threads:", file=sys.stderr, flush=True)
                    os.kill(procs[r].pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    self.fail(kind, "stall", f"rank {r} still waits {limit:.0f} s after rank {victim} stopped "
                              f"responding (process group timeout {STALL_TIMEOUT:.0f} s)")
                    self.counts[(kind, "stall_hung")] += 1
                else:
                    took = max(took, time.monotonic() - t0)
                    self.last_survivors[r] = (procs[r].exitcode, list(msgs[r]))
            self.counts[(kind, "stall_failed_in")] = max(self.counts[(kind, "stall_failed_in")], took)
            if self.verbose:
                print(f"    stall: rank {victim} stopped; the others ended within {took:.1f} s: "
                      f"{[m[-1:] for m in msgs]}", flush=True)
        except (RuntimeError, EOFError, OSError) as e:
            self.fail(kind, "stall", f"stall check could not run: {e!r}\n{traceback.format_exc()}")
            return
        finally:
            _reap(procs, conns)
        self.stall_verdict(kind, getattr(self, "check_" + kind), old_gen)

    def stall_verdict(self, kind, check, old_gen):
        """After a stall check: the checkpoint is the previous generation or the new one (`check`)."""
        try:
            outcome = check(kind, old_gen, old_gen + 1, killed=True)
            self.counts[(kind, "stall_checks")] += 1
            self.counts[(kind, "stall", outcome)] += 1
        except Exception as e:  # noqa: BLE001
            self.fail(kind, "stall", f"check raised {type(e).__name__}: {e}\n{traceback.format_exc()}")

    def final_saves(self, kinds):
        """After all the kills: one uninterrupted save per kind succeeds."""
        for kind in kinds:
            try:
                old_gen = self.prev[kind][0] if kind in self.prev else None
                if old_gen is None:
                    continue
                t0 = time.monotonic()
                self._run_children(kind, old_gen + 1, "", kill_at=None)
                fn = getattr(self, "check_" + CHECKS.get(kind, kind))
                if fn(kind, old_gen, old_gen + 1, False) != "new_complete":
                    raise AssertionError("final uninterrupted save did not complete")
                self.counts[(kind, "final_save_ok")] += 1
                self.seconds[kind] += time.monotonic() - t0
            except Exception as e:  # noqa: BLE001
                self.fail(kind, "final", f"{type(e).__name__}: {e}")

    def report(self, kinds, elapsed):
        print(f"crash driver: {elapsed:.1f} s, root {self.root}")
        total = 0
        for kind in kinds:
            k, f = self.counts[(kind, "killed")], self.counts[(kind, "finished")]
            total += k
            plans = sorted({key[1] for key in self.counts if len(key) == 3 and key[0] == kind})
            per_plan = ", ".join(
                f"{p}: " + "/".join(str(self.counts[(kind, p, o)]) for o in ("old_intact", "new_complete"))
                for p in plans)
            extra = ""
            if kind in MANAGED:
                extra += f" new_file_latest_old={self.counts[(kind, 'new_file_latest_old')]}"
            if kind == "collective3":
                extra += f" cleanup_saves={self.counts[(kind, 'cleanup_save_ok')]}"
            if kind in ("collective3", "manager_async3"):
                if self.counts[(kind, "stall_checks")] or self.counts[(kind, "stall_hung")]:
                    extra += (f" stalled_peer: survivors failed within {self.counts[(kind, 'stall_failed_in')]:.1f} s"
                              if not self.counts[(kind, "stall_hung")] else " stalled_peer: a survivor HUNG")
            if kind == "sharded2":
                extra += f" leftover_retention={self.counts[(kind, 'leftover_retention')]}"
                if self.counts[(kind, "stall_checks")] or self.counts[(kind, "stall_hung")]:
                    extra += (f" stalled_peer: rank 0 failed after {self.counts[(kind, 'stall_failed_in')]:.1f} s"
                              if not self.counts[(kind, "stall_hung")] else " stalled_peer: rank 0 HUNG")
            if kind in WORLD:
                who = ("both" if WORLD[kind] == 2 else "all",) + tuple(f"rank{r}" for r in range(WORLD[kind]))
                extra += (f"  [killed {'/'.join(who)}: " + "/".join(
                    str(self.counts[(kind, "killed_" + v)]) for v in who)
                    + f"; survivor finished/failed/hung: {self.counts[(kind, 'survivor_finished')]}/"
                    f"{self.counts[(kind, 'survivor_failed')]}/{self.counts[(kind, 'survivor_hung')]}]")
            print(f"  {kind:10s} {self.seconds[kind]:6.1f} s kills={k:4d} finished={f:3d}  old_intact={self.counts[(kind, 'old_intact')]:4d} "
                  f"new_complete={self.counts[(kind, 'new_complete')]:4d} leftover_tmp={self.counts[(kind, 'leftover_tmp')]:3d}"
                  + f" killed_after_rename={self.counts[(kind, 'killed_after_rename')]:3d}"
                  + extra + f"  [plan: old/new {per_plan}]")
        print(f"  total kills={total} violations={len(self.violations)}")
        return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=200, help="kills in all, spread evenly over the kinds (saves that finish before their kill come on top)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="work directory (default: a fresh temporary one, removed on success)")
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("--child", choices=KINDS, help="run one save in the foreground (fault plan from $" + ENV + ")")
    ap.add_argument("--no-stall", action="store_true", help="skip the stalled-peer checks of sharded2, collective3 and manager_async3 (Driver.stall_check, "
                    "Driver.collective_stall_check)")
    ap.add_argument("--gen", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0, help="with --child, world size 2 and 3 kinds: this process's "
                    "rank (start every rank with the same --port)")
    ap.add_argument("--port", type=int, default=29531, help="with --child: rank 0's TCP port on 127.0.0.1")
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.dir or ".", args.gen, "", _Stdout(), args.rank, args.port)
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown kinds {bad}")
    import logging
    import warnings
    logging.getLogger("fastckpt").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = args.dir or tempfile.mkdtemp(prefix="fastckpt-crash-")
    drv = Driver(root, args.seed, args.verbose)
    from multiprocessing import forkserver
    forkserver.ensure_running()  # it imports torch while this process imports it too (in parallel)
    t0 = time.monotonic()
    kills, i = collections.Counter(), 0
    per_kind = {k: args.kills // len(kinds) + (1 if j < args.kills % len(kinds) else 0) for j, k in enumerate(kinds)}
    while any(kills[k] < per_kind[k] for k in kinds) and i < 4 * args.kills + 8:
        kind = kinds[i % len(kinds)]
        i += 1
        if kills[kind] < per_kind[kind] and drv.round(kind):
            kills[kind] += 1
    if "sharded2" in kinds and not args.no_stall:
        t = time.monotonic()
        drv.stall_check()
        drv.seconds["sharded2"] += time.monotonic() - t
    for kind in ("collective3", "manager_async3"):
        if kind in kinds and not args.no_stall:
            t = time.monotonic()
            drv.collective_stall_check(kind)
            drv.seconds[kind] += time.monotonic() - t
    drv.final_saves(kinds)
    drv.report(kinds, time.monotonic() - t0)
    shutil.rmtree(drv.memory_dir, ignore_errors=True)
    if drv.violations:
        print("VIOLATIONS:\n" + "\n".join(drv.violations))
        return 1
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
