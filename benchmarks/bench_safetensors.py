#!/usr/bin/env python3
"""safetensors files: fastckpt.safetensors.save_file / load_file against the safetensors package's
own save_file (+ fsync of the file and its directory, so that both saves are durable) and
load_file with every page touched (its default backend maps the file lazily: a byte per 4 KiB
page is read, so that both loads end with the data in memory).

The state: the model part of benchmarks/workload.py's synthetic state dict (transformer-like
layers, float32 and bfloat16, three large matrices), about --size bytes. Every operation runs in a
fresh Python process (the state dict is built before the clock starts; imports are not timed),
the operations interleaved round by round (--rounds), the page cache dropped before each load
when this process may (root; else the table says "warm"). Seconds are medians over the rounds;
the result of every load is compared with the saved state once, outside the timing.

Issue 15's targets: fastckpt.safetensors save >= 2x safetensors' save_file+fsync, load >= 1.3x
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
from benchmarks.harness import drop_caches, parse_size, emit_standalone, pair_targets  # noqa: E402
from fastckpt._units import human  # noqa: E402

OPS = ["safetensors.save_file+fsync", "fastckpt.safetensors.save_file",
       "safetensors.load_file, pages touched", "fastckpt.safetensors.load_file"]
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


def bench(size: int, rounds: int, directory: str) -> dict:
    files = {"theirs": os.path.join(directory, "theirs.safetensors"),
             "ours": os.path.join(directory, "ours.safetensors")}
    times = {op: [] for op in OPS}
    cpus = {op: [] for op in OPS}
    cold, checked, nbytes = True, [], 0
    for r in range(rounds):
        for op in OPS:
            # each loader reads the file its own library wrote (both are standard safetensors files)
            path = files["ours" if op.startswith("fastckpt") else "theirs"]
            if "load" in op:
                cold = (drop_caches() is None) and cold
            res = run_op(size, op, path, check=(r == 0 and "load" in op))
            times[op].append(res["seconds"])
            cpus[op].append(res["cpu"])
            nbytes = res["bytes"]
            if res["ok"] is not None:
                checked.append((op, res["ok"]))
            print(f"  round {r + 1}: {op}: {res['seconds']:.3f} s", file=sys.stderr, flush=True)
    return {"size": size, "bytes": nbytes, "rounds": rounds, "cold_cache": cold, "checked": checked,
            "seconds": {op: statistics.median(v) for op, v in times.items()},
            "cpu_seconds": {op: statistics.median(v) for op, v in cpus.items()},
            "file_bytes": {k: os.path.getsize(p) for k, p in files.items()}}


def report(res: dict) -> dict:
    s, c = res["seconds"], res["cpu_seconds"]
    rows = []
    for op in OPS:
        gbps = res["bytes"] / s[op] / 1e9 if s[op] > 0 else None
        ref = PAIRS.get(op)
        speed = round(s[ref[0]] / s[op], 2) if ref and s[op] > 0 else ""
        rows.append([op, round(s[op], 3), None if gbps is None else round(gbps, 2), round(c[op], 3), speed])
    targets = pair_targets(s, PAIRS)
    errors = [f"{op}: the loaded tensors differ from the saved ones" for op, ok in res["checked"] if not ok]
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
                      "compared with the saved state in the first round"],
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
