#!/usr/bin/env python3
"""safetensors files: fastckpt.safetensors.save_file / load_file against the safetensors package's
own save_file (+ fsync of the file and its directory, so that both saves are durable) and
load_file with every page touched (its default backend maps the file lazily: a byte per 4 KiB
page is read, so that both loads end with the data in memory).

Both loads are bound by the machine on one like the development VM, so the same rounds also
measure what it allows. The disk: fio (O_DIRECT, io_uring, at harness.FIO_POINTS, where fio is
installed) and the engine's own parallel read of the file fastckpt loads into memory already
faulted in (the load's I/O alone: same requests, no fault of fresh memory, no tensors); the
faster median of these is "the disk limit". The memory: the load's allocations in a fresh
process with every page faulted in on every CPU and no I/O (a loader that returns memory of its
own, as fastckpt's does, must fault all of it in; on a VM that is slow, 3-9 GB/s here; an mmap
of the page cache, as safetensors', skips the zeroing and is not bound by it). The larger of the
two is the limit, and safetensors' load median over it is the most a loader of this file that
returns memory of its own could gain over safetensors in this run (with the disk row alone: any
loader): when that bound is under 1.3, the load target cannot be met on this machine.

The state: the model part of benchmarks/workload.py's synthetic state dict (transformer-like
layers, float32 and bfloat16, three large matrices), about --size bytes. Every operation runs in a
fresh Python process (the state dict is built before the clock starts; imports are not timed),
the operations interleaved round by round (--rounds), the page cache dropped before each load
when this process may (root; else the table says "warm"). Seconds are medians over the rounds;
the result of every load is compared with the saved state once, outside the timing.

The targets: fastckpt.safetensors save >= 2x safetensors' save_file+fsync, load >= 1.3x
load_file with every page touched.

Run alone: ``python benchmarks/bench_safetensors.py [--size 1G] [--rounds 3] [--dir DIR]
[--json OUT] [--quick]``. Timing figures depend on the machine and on what else runs on it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks.harness import (FIO_MISSING, FIO_POINTS, drop_caches, emit_standalone, find_fio,  # noqa: E402
                                pair_targets, parse_size, run_fio)
from fastckpt._core.units import human  # noqa: E402

OPS = ["safetensors.save_file+fsync", "fastckpt.safetensors.save_file",
       "safetensors.load_file, pages touched", "fastckpt.safetensors.load_file"]
DISK_ENGINE = "disk: engine read into resident memory"
MEMORY = "memory: fresh pages of the load's size faulted in"
PAIRS = {"fastckpt.safetensors.save_file": ("safetensors.save_file+fsync", 2.0),
         "fastckpt.safetensors.load_file": ("safetensors.load_file, pages touched", 1.3)}

_CHILD = r'''
import json, os, sys, time, resource
sys.path.insert(0, sys.argv[4])
import torch
import safetensors.torch as st
import fastckpt.safetensors as fst
from benchmarks.workload import build_state_dict, touch_pages
size, op, path, check = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[5] == "1"

def state():
    # the model part is about a third of build_state_dict's bytes (AdamW keeps two more copies)
    return {k: v.contiguous() for k, v in build_state_dict(3 * size)["model"].items()}

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

sd = state() if ".save" in op or check else None
if op == "memory":
    # what a load that ends with the data in memory of its own pays at least: the same allocations as
    # load_file's, every page faulted in, no I/O
    from fastckpt.torchsave.reader import host_storage
    src = fst._open(path)
    sizes = [e.end - e.begin for e in src.entries if e.end > e.begin]
    src.close()
    import ctypes
    from concurrent.futures import ThreadPoolExecutor
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    MADV_POPULATE_WRITE, PIECE = 23, 64 << 20

    def populate(piece):
        # the fastest way to fault memory in: MADV_POPULATE_WRITE (Linux 5.14), else a write per page
        b, off, n = piece
        if libc.madvise(b.data_ptr() + off, n, MADV_POPULATE_WRITE) != 0:
            b[off:off + n:4096].fill_(1)

    t0, c0 = time.perf_counter(), cpu()
    bufs = [host_storage(n) for n in sizes]
    pieces = []
    for b in bufs:
        whole = b.numel() // 4096 * 4096  # (host_storage's memory starts on a page)
        pieces += [(b, o, min(PIECE, whole - o)) for o in range(0, whole, PIECE)]
        if whole < b.numel():
            b[whole:].fill_(1)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # on every CPU: the least time any loader needs
        list(pool.map(populate, pieces))
    seconds, cpus = time.perf_counter() - t0, cpu() - c0
    print(json.dumps({"seconds": seconds, "cpu": cpus, "bytes": sum(sizes), "ok": None}))
    sys.exit(0)
if op.startswith("disk: engine"):
    # the load's reads alone: the same destinations as load_file's (host_storage), faulted in first
    from fastckpt import _C
    from fastckpt._core.engine import get_engine
    from fastckpt.torchsave.reader import host_storage
    src = fst._open(path)
    ranges = [(host_storage(e.end - e.begin).fill_(1), src.data_start + e.begin)
              for e in src.entries if e.end > e.begin]
    t0, c0 = time.perf_counter(), cpu()
    _C.read_ranges(get_engine(), path, ranges, src.f.fileno())
    seconds, cpus = time.perf_counter() - t0, cpu() - c0
    src.close()
    print(json.dumps({"seconds": seconds, "cpu": cpus, "bytes": sum(r[0].numel() for r in ranges), "ok": None}))
    sys.exit(0)
t0, c0 = time.perf_counter(), cpu()
if op == "safetensors.save_file+fsync":
    st.save_file(sd, path)
    for p, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)):
        fd = os.open(p, flags)
        os.fsync(fd)
        os.close(fd)
elif op == "fastckpt.safetensors.save_file":
    fst.save_file(sd, path)
elif op == "safetensors.load_file, pages touched":
    out = st.load_file(path)
    touch_pages(out)
elif op == "fastckpt.safetensors.load_file":
    out = fst.load_file(path)
    touch_pages(out)
else:
    raise SystemExit(f"unknown op {op}")
seconds, cpus = time.perf_counter() - t0, cpu() - c0
ok = None
if check and "load" in op:
    ok = sorted(out) == sorted(sd) and all(torch.equal(out[k], sd[k]) for k in sd)
print(json.dumps({"seconds": seconds, "cpu": cpus, "bytes": sum(t.numel() * t.element_size() for t in
                  (sd or out).values()), "ok": ok}))
'''


def run_op(size: int, op: str, path: str, check: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(size), op, path, REPO, "1" if check else "0"],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fio_op(bs: int, qd: int) -> str:
    return f"disk: fio O_DIRECT read, {bs >> 20} MiB x {qd}"


def run_disk_fio(fio: str, path: str, bs: int, qd: int) -> dict:
    """fio reading the whole blocks of `path` (O_DIRECT), its time scaled to the file's size."""
    size = os.path.getsize(path)
    r = run_fio(fio, path, size // bs * bs, "read", bs, qd)
    return {"seconds": r["seconds"] * size / r["bytes"], "cpu": r["cpu_s"], "ok": None}


def bench(size: int, rounds: int, directory: str) -> dict:
    files = {"theirs": os.path.join(directory, "theirs.safetensors"),
             "ours": os.path.join(directory, "ours.safetensors")}
    fio = find_fio()
    fio_points: dict = {}  # op -> (block, depth): the points of whole blocks of the file (known once it is saved)
    times: dict = {op: [] for op in OPS}
    cpus: dict = {op: [] for op in OPS}
    cold, checked, nbytes = True, [], 0
    disk_ops: list = []
    for r in range(rounds):
        # the disk's measurements after the loads, their order rotated round by round (no slot of its own)
        k = r % len(disk_ops) if disk_ops else 0
        ops = list(OPS) + disk_ops[k:] + disk_ops[:k]
        for op in ops:
            # each loader reads the file its own library wrote (both are standard safetensors files);
            # the disk's measurements read the file fastckpt loads
            path = files["theirs" if op.startswith("safetensors") else "ours"]
            if op not in OPS or "load" in op:
                cold = (drop_caches() is None) and cold
            if op in fio_points:
                res = run_disk_fio(fio, path, *fio_points[op])
            elif op == MEMORY:
                res = run_op(size, "memory", path, check=False)
            else:
                res = run_op(size, op, path, check=(r == 0 and "load" in op))
            times[op].append(res["seconds"])
            cpus[op].append(res["cpu"])
            if op in OPS:
                nbytes = res["bytes"]
            if res["ok"] is not None:
                checked.append((op, res["ok"]))
            print(f"  round {r + 1}: {op}: {res['seconds']:.3f} s", file=sys.stderr, flush=True)
            if r == 0 and op == OPS[-1]:  # the files exist now: the disk's measurements follow in every round
                if fio:
                    fio_points.update((fio_op(bs, qd), (bs, qd)) for bs, qd in FIO_POINTS
                                      if os.path.getsize(files["ours"]) >= bs)
                disk_ops = [DISK_ENGINE] + list(fio_points) + [MEMORY]
                ops += disk_ops
                for d in disk_ops:
                    times[d], cpus[d] = [], []
    return {"size": size, "bytes": nbytes, "rounds": rounds, "cold_cache": cold, "checked": checked,
            "ops": list(OPS) + disk_ops, "fio": fio is not None,
            "per_round": times,
            "seconds": {op: statistics.median(v) for op, v in times.items()},
            "cpu_seconds": {op: statistics.median(v) for op, v in cpus.items()},
            "file_bytes": {k: os.path.getsize(p) for k, p in files.items()}}


def disk_bound(res: dict) -> tuple:
    """(the limit's op, its median seconds, safetensors' load median over it): the most a loader of the
    file could gain over safetensors' load in this run. Every load needs the disk's time (the faster of the
    disk rows); one that returns memory of its own, as fastckpt's, also the time to fault that memory in (the
    memory row): at least the larger of the two."""
    s = res["seconds"]
    disk = min((op for op in res["ops"] if op.startswith("disk:")), key=lambda op: s[op])
    if MEMORY in s and s[MEMORY] > s[disk]:
        disk = MEMORY
    ref = s["safetensors.load_file, pages touched"]
    return disk, s[disk], round(ref / s[disk], 2) if s[disk] > 0 else None


def report(res: dict) -> dict:
    s, c = res["seconds"], res["cpu_seconds"]
    rows = []
    for op in res["ops"]:
        gbps = res["bytes"] / s[op] / 1e9 if s[op] > 0 else None
        ref = PAIRS.get(op)
        speed = round(s[ref[0]] / s[op], 2) if ref and s[op] > 0 else ""
        rows.append([op, round(s[op], 3), None if gbps is None else round(gbps, 2), round(c[op], 3), speed])
    targets = pair_targets(s, PAIRS)
    errors = [f"{op}: the loaded tensors differ from the saved ones" for op, ok in res["checked"] if not ok]
    disk, disk_s, bound = disk_bound(res)
    load_x = s["safetensors.load_file, pages touched"] / s["fastckpt.safetensors.load_file"]
    what = ("the memory: a bound for loaders that return memory of their own, as fastckpt's does"
            if disk == MEMORY else "the disk")
    disk_note = (f"the limit in this run: {disk} {disk_s:.3f} s (the larger of the fastest disk row and the "
                 f"memory row; here {what}); safetensors' load takes {bound}x that, "
                 f"so no loader of this file could be more than {bound}x faster than it here (fastckpt: "
                 f"{load_x:.2f}x, {s['fastckpt.safetensors.load_file'] / disk_s:.2f}x the limit's time)"
                 + ("" if bound is None or bound >= PAIRS["fastckpt.safetensors.load_file"][1] else
                    f"; the {PAIRS['fastckpt.safetensors.load_file'][1]}x load target is beyond what this "
                    "machine allows in this run"))
    return {"title": f"safetensors files, {human(res['bytes'])} of model weights: fastckpt.safetensors "
                     "against the safetensors package",
            "columns": ["operation", "seconds", "GB/s", "CPU s", "speed vs safetensors"],
            "rows": rows, "targets": targets,
            "notes": [f"medians of {res['rounds']} interleaved round(s), a fresh process per operation; "
                      f"{'cold' if res['cold_cache'] else 'warm (drop_caches not permitted)'} page cache before "
                      "each load; saves durable (safetensors: fsync of the file and its directory after "
                      "save_file); loads end with every page of every tensor read",
                      f"files: safetensors {res['file_bytes']['theirs']} bytes, fastckpt.safetensors "
                      f"{res['file_bytes']['ours']} bytes (its header is padded to 4 KiB); each load was "
                      "compared with the saved state in the first round",
                      "disk rows: the file fastckpt loads read with the page cache dropped first; the engine's read "
                      "goes into memory faulted in before the clock (the load's I/O alone), fio's time is scaled to "
                      "the whole file" + ("" if res["fio"] else f" ({FIO_MISSING})") + "; the memory row: the "
                      "load's allocations in a fresh process, every page faulted in, no I/O",
                      disk_note,
                      "per round, safetensors' load time over fastckpt's: " + ", ".join(
                          f"{a / b:.2f}" for a, b in zip(res["per_round"]["safetensors.load_file, pages touched"],
                                                          res["per_round"]["fastckpt.safetensors.load_file"]))],
            "errors": errors, "raw": res}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="bytes of model weights (default 1G)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the results here (benchmarks/report.py's format)")
    ap.add_argument("--quick", action="store_true", help="128M, one round")
    a = ap.parse_args(argv)
    size = parse_size("128M" if a.quick else a.size)
    rounds = 1 if a.quick else a.rounds
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="bench_safetensors.") as d:
        res = bench(size, rounds, d)
    return emit_standalone(report(res), a.json)

if __name__ == "__main__":
    sys.exit(main())
