#!/usr/bin/env python3
"""The memory tier: what a snapshot costs the loop, and how fast a job comes back from memory.

One process first (a state of ``--size`` bytes: benchmarks/workload.py's model + AdamW):

* the memory-copy limit: copying the state into warm, preallocated host memory (torch ``copy_``
  per tensor), the floor of any snapshot;
* ``CheckpointManager.snapshot``: the time the caller is blocked, the first snapshot (which
  allocates its slot's memory) apart from the steady ones (slots reused), and the background
  CRC-32 and commit after it;
* against ``fastckpt.async_save`` (blocked / until durable), ``fastckpt.save`` and
  ``dcp.async_save`` (blocked / until durable, FileSystemWriter) of the same state, and a save
  written from the snapshot (``save`` of the snapshot's step);
* recovery in a fresh process: ``load_latest`` from memory against ``fastckpt.load`` of the same
  step from disk (page cache dropped first where this process may: root), each with and without a
  copy of the restored state into the model's tensors (what ``load_state_dict`` does).

Then two emulated nodes (two torchrun agents on this machine, a static rendezvous on 127.0.0.1,
each with its own memory directory), one rank each, the same state per rank:

* replication: the background replication time of a steady snapshot and its GB/s;
* the step slowdown while replication runs: a CPU-bound step (matrix products) timed alone and
  while the background CRC and replication run;
* recovery after a node loss: the replaced node's rank restores through the peer's replica
  (``load_latest``), timed on both ranks.

Writes ``--json`` (the report's standalone format: columns, rows, targets, notes) and prints Markdown.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from benchmarks.harness import (emit_standalone, drop_caches, fmt_size, free_port, median, parse_size,  # noqa: E402
                                warm_copy_seconds)
from benchmarks.workload import build_state_dict, iter_tensors, payload_bytes  # noqa: E402

GB = 1e9


def _fresh(code: str, env) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


_RESTORE = """
import json, sys, time, torch
sys.path[:0] = [{root!r}]
import fastckpt
from benchmarks.workload import iter_tensors
t0 = time.perf_counter()
if {memory!r}:
    st = fastckpt.CheckpointManager({ckpt!r}, memory=fastckpt.MemoryTier(keep=2, replicas=0)).load_latest()
    state, where = st.state, st.path
else:
    st = fastckpt.CheckpointManager({ckpt!r}).load_latest()
    state, where = st.state, st.path
t1 = time.perf_counter()
dst = [torch.empty_like(t) for t in iter_tensors(state)]
t2 = time.perf_counter()
for d, s in zip(dst, iter_tensors(state)):
    d.copy_(s)
t3 = time.perf_counter()
print(json.dumps({{"load_s": t1 - t0, "copy_s": t3 - t2, "alloc_s": t2 - t1, "path": where}}))
"""


def single(args, size, work, rows, notes, targets):
    import fastckpt
    sd, nbytes = build_state_dict(size), None
    nbytes = payload_bytes(sd)
    copy_s = warm_copy_seconds(list(iter_tensors(sd)))
    rows.append(["memory copy into warm memory (the limit)", f"{copy_s:.3f}", "", f"{nbytes / copy_s / GB:.2f}"])
    mem = tempfile.mkdtemp(prefix="fastckpt-bench-mem-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.environ["FASTCKPT_MEMORY_DIR"] = mem
    ckpt = os.path.join(work, "mgr")
    try:
        mgr = fastckpt.CheckpointManager(ckpt, keep_last=2, memory=fastckpt.MemoryTier(keep=2, replicas=0))
        blocked, commits = [], []
        for step in range(args.snapshots):
            t0 = time.perf_counter()
            mgr.snapshot(step, sd)
            blocked.append(time.perf_counter() - t0)
            mgr._memory.wait()
            commits.append(mgr._memory.stats.get("commit_s", 0.0))
        first, steady = blocked[0], median(blocked[2:]) if len(blocked) > 2 else blocked[-1]
        rows.append(["snapshot: first (allocates its slot)", f"{first:.3f}", "", f"{nbytes / first / GB:.2f}"])
        rows.append(["snapshot: steady (slot reused), blocked", f"{steady:.3f}", f"{steady / copy_s:.2f}x copy",
                     f"{nbytes / steady / GB:.2f}"])
        rows.append(["snapshot: background CRC-32 + commit", f"{median(commits[2:] or commits):.3f}", "", ""])
        targets.append({"target": "snapshot blocking <= 1.5x a copy into warm memory", "measured": steady / copy_s,
                        "unit": "x", "met": steady / copy_s <= 1.5})
        last = args.snapshots - 1
        t0 = time.perf_counter()
        mgr.save(last, sd)  # from the snapshot of the same step
        rows.append(["save of the snapshot's step (written from host memory)", f"{time.perf_counter() - t0:.3f}",
                     "durable", f"{nbytes / (time.perf_counter() - t0) / GB:.2f}"])
        mgr.snapshot(last + 1, sd)  # newer than the disk: what a restart restores from memory
        mgr._memory.wait()
        p = os.path.join(work, "plain.pt")
        t0 = time.perf_counter()
        fastckpt.save(sd, p)
        save_s = time.perf_counter() - t0
        rows.append(["fastckpt.save", f"{save_s:.3f}", "durable", f"{nbytes / save_s / GB:.2f}"])
        fastckpt.async_save(sd, p).result()  # its staging arena allocated, as a long-lived trainer has it
        t0 = time.perf_counter()
        fut = fastckpt.async_save(sd, p)
        b = time.perf_counter() - t0
        fut.result()
        d = time.perf_counter() - t0
        rows.append(["fastckpt.async_save: blocked / until durable", f"{b:.3f}", f"{d:.3f} s durable",
                     f"{nbytes / b / GB:.2f}"])
        try:
            import torch.distributed.checkpoint as dcp
            dd = os.path.join(work, "dcp")
            dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(dd)).result()  # warm
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(work, "dcp2")))
            b = time.perf_counter() - t0
            fut.result()
            d = time.perf_counter() - t0
            rows.append(["dcp.async_save (FileSystemWriter): blocked / until durable", f"{b:.3f}",
                         f"{d:.3f} s durable", f"{nbytes / b / GB:.2f}"])
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            notes.append(f"dcp.async_save not measured: {type(e).__name__}: {e}")
        del mgr
        env = dict(os.environ, OMP_NUM_THREADS="1")
        disk_path = os.path.join(ckpt, f"step_{last:08d}.pt")
        why = drop_caches()
        r_mem = _fresh(_RESTORE.format(root=os.path.dirname(HERE), memory=True, ckpt=ckpt, path=""), env)
        if why is None:
            drop_caches()
        r_disk = _fresh(_RESTORE.format(root=os.path.dirname(HERE), memory=False, ckpt=ckpt,
                                        path=disk_path), env)
        notes.append("disk restore: page cache dropped first" if why is None
                     else f"disk restore: page cache NOT dropped ({why}): a warm read")
        for name, r in (("memory (load_latest after a restart)", r_mem), ("disk (load_latest, no memory tier)", r_disk)):
            rows.append([f"restore from {name}", f"{r['load_s']:.3f}",
                         f"+ {r['alloc_s'] + r['copy_s']:.3f} s into the model's tensors",
                         f"{nbytes / r['load_s'] / GB:.2f}"])
        whole_mem = r_mem["load_s"] + r_mem["alloc_s"] + r_mem["copy_s"]
        whole_disk = r_disk["load_s"] + r_disk["alloc_s"] + r_disk["copy_s"]
        targets.append({"target": "restore from memory >= 3x faster than from disk", "unit": "x",
                        "measured": r_disk["load_s"] / r_mem["load_s"], "met": r_disk["load_s"] >= 3 * r_mem["load_s"]})
        notes.append(f"restore including the copy into the model's tensors: memory {whole_mem:.3f} s, disk "
                     f"{whole_disk:.3f} s ({whole_disk / whole_mem:.1f}x)")
        if not r_mem["path"].startswith(mem):
            notes.append(f"the memory restore came from {r_mem['path']}, not the memory tier")
    finally:
        shutil.rmtree(mem, ignore_errors=True)
    return nbytes


# ------------------------------------------------------------------ two emulated nodes

def worker(args):
    """One rank of the two-node run (under torchrun)."""
    import torch.distributed as dist
    import fastckpt
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {"rank": rank}
    mgr = fastckpt.CheckpointManager(args.dir, keep_last=2, memory=fastckpt.MemoryTier(keep=2, replicas=1))
    if args.phase == "restore":
        dist.barrier()
        t0 = time.perf_counter()
        r = mgr.load_latest()
        out.update(restore_s=time.perf_counter() - t0, step=r.step if r else None, path=r.path if r else None)
    else:
        sd = build_state_dict(args.size_bytes)
        a = torch.randn(256, 256)

        def step():
            t0 = time.perf_counter()
            for _ in range(20):
                a.mul_(0.5).add_(a @ a * 1e-3)
            return time.perf_counter() - t0
        quiet = [step() for _ in range(15)]
        rep, busy = [], []
        for s in range(3):
            mgr.snapshot(s, sd)
            if s == 2:  # steps while the background CRC and replication run
                while mgr._memory._jobs:
                    busy.append(step())
            mgr._memory.wait()
            rep.append(mgr._memory.stats.get("replicate_s", 0.0))
            dist.barrier()
        out.update(nbytes=payload_bytes(sd), replicate_s=rep[-1], quiet_step=median(quiet),
                   busy_step=median(busy) if busy else None, busy_steps=len(busy))
    with open(os.path.join(args.out_dir, f"{args.phase}-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def nodes(args, size, work, rows, notes):
    mem = [tempfile.mkdtemp(prefix=f"fastckpt-bench-node{i}-", dir="/dev/shm") for i in range(2)]
    outd = tempfile.mkdtemp(prefix="fastckpt-bench-nodes-")
    ckpt = os.path.join(work, "nodes")
    try:
        for phase in ("snapshot", "restore"):
            if phase == "restore":
                shutil.rmtree(mem[1])  # node 1 replaced: its memory is empty
                os.makedirs(mem[1])
            port = str(free_port())
            procs = [subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                 "--node_rank", str(i), "--master_addr", "127.0.0.1", "--master_port", port, __file__, "--worker",
                 "--phase", phase, "--dir", ckpt, "--size", str(size), "--out-dir", outd],
                env=dict(os.environ, FASTCKPT_MEMORY_DIR=mem[i], OMP_NUM_THREADS="1",
                         PYTHONPATH=os.path.dirname(HERE)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True) for i in range(2)]
            for p in procs:
                out, _ = p.communicate(timeout=900)
                if p.returncode != 0:
                    raise RuntimeError(f"{phase} agent failed: {out[-3000:]}")
        snap = [json.load(open(os.path.join(outd, f"snapshot-{r}.json"))) for r in range(2)]
        rest = [json.load(open(os.path.join(outd, f"restore-{r}.json"))) for r in range(2)]
        n = snap[0]["nbytes"]
        rs = max(s["replicate_s"] for s in snap)
        rows.append(["2 nodes: replication of a steady snapshot (both ways at once)", f"{rs:.3f}", "background",
                     f"{n / rs / GB:.2f}"])
        busy = [s["busy_step"] for s in snap if s.get("busy_step")]
        if busy:
            ratio = max(b / s["quiet_step"] for b, s in zip(busy, snap))
            rows.append(["2 nodes: compute step while CRC + replication run (vs alone)", f"{max(busy):.4f}",
                         f"{ratio:.2f}x", ""])
        for r in rest:
            rows.append([f"2 nodes: restore after node 1 was lost, rank {r['rank']} "
                         f"({'peer replica' if r['rank'] == 1 else 'own memory'})", f"{r['restore_s']:.3f}",
                         f"step {r['step']}", f"{n / r['restore_s'] / GB:.2f}"])
        notes.append("both emulated nodes share this machine's 2 CPUs and memory bus: the replication and the "
                     "step slowdown are what one machine does for both ends at once")
    finally:
        for d in mem + [outd]:
            shutil.rmtree(d, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=".", help="a directory on the disk to measure (checkpoints go there)")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--snapshots", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="64 MiB, a check that it runs, not figures to quote")
    ap.add_argument("--no-nodes", action="store_true", help="skip the two-node part")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="snapshot", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.size = "64M"
    size = parse_size(args.size)
    if args.worker:
        args.size_bytes = size
        worker(args)
        return 0
    rows, notes, targets, errors = [], [], [], []
    work = tempfile.mkdtemp(prefix="fastckpt-bench-memory-", dir=os.path.abspath(args.dir))
    try:
        nbytes = single(args, size, work, rows, notes, targets)
        if not args.no_nodes:
            try:
                nodes(args, size, work, rows, notes)
            except Exception as e:  # noqa: BLE001 - reported in the table's errors
                errors.append(f"two-node part: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"title": f"The memory tier: snapshots, replicas and restores ({fmt_size(nbytes)} state)",
           "columns": ["operation", "seconds", "", "GB/s"], "rows": rows, "targets": targets, "notes": notes,
           "errors": errors}
    return emit_standalone(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
