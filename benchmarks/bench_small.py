#!/usr/bin/env python3
"""Many small tensors: fastckpt.save / fastckpt.load (verify off and on) against
torch.save / torch.load (and torch.load(mmap=True)), and the file sizes.

Cases (--case):

* ``scalars``: a dict of N 0-d float32 tensors (N = --n, 100,000 by default): the
  worst case for per-record overheads (424 MB and slower than
  torch.save when every record was 4 KiB-aligned).
* ``model``: a model-like state dict of about N/10 small parameters (LayerNorm
  weights and biases, 256 floats each, 1 KiB) and 4 large ones (2048 x 2048
  float32, 16 MiB each).

Every operation runs in a fresh Python process (imports not timed; the state
dict is built before the clock starts), the operations interleaved round by
round (--rounds), the page cache dropped before each load when this process
may (root; else the table says "warm"). A save's time includes making the file
durable for both (fastckpt.save commits with fdatasync; torch.save's file is
fsync'd after it). Loads are timed to the loaded object; torch.load(mmap=True)
maps without touching the pages. Seconds are medians over the rounds.

Run alone: ``python benchmarks/bench_small.py [--case scalars|model|all] [--n N]
[--rounds R] [--dir DIR] [--json OUT]``. Timing figures depend on the machine
and on what else runs on it; nothing here is asserted.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# "fastckpt.load" is verify=False, "fastckpt.load(verify)" the default (verify on)
OPS = ["fastckpt.save", "torch.save", "fastckpt.load", "fastckpt.load(verify)", "torch.load", "torch.load(mmap)"]

_CHILD = r'''
import json, os, sys, time, resource
import torch, fastckpt
case, n, op, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

def build():
    g = torch.Generator().manual_seed(0)
    if case == "scalars":
        return {f"t{i}": torch.tensor(float(i)) for i in range(n)}
    sd = {}
    for i in range(max(1, n // 20)):
        sd[f"layers.{i}.norm.weight"] = torch.randn(256, generator=g)
        sd[f"layers.{i}.norm.bias"] = torch.randn(256, generator=g)
    for i in range(4):
        sd[f"big.{i}.weight"] = torch.randn(2048, 2048, generator=g)
    return sd

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

sd = build() if op.endswith(".save") else None
t0, c0 = time.perf_counter(), cpu()
if op == "fastckpt.save":
    fastckpt.save(sd, path)
elif op == "torch.save":
    torch.save(sd, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
elif op == "fastckpt.load":  # verify off (the default verifies)
    out = fastckpt.load(path, verify=False)
elif op == "fastckpt.load(verify)":
    out = fastckpt.load(path, verify=True)
elif op == "torch.load":
    out = torch.load(path)
elif op == "torch.load(mmap)":
    out = torch.load(path, mmap=True)
else:
    raise SystemExit(f"unknown op {op}")
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": cpu() - c0}))
'''


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_op(case: str, n: int, op: str, path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _CHILD, case, str(n), op, path], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{op} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(case: str, n: int, rounds: int, directory: str) -> dict:
    files = {"fastckpt": os.path.join(directory, f"small_{case}_fastckpt.pt"),
             "torch": os.path.join(directory, f"small_{case}_torch.pt")}
    times = {op: [] for op in OPS}
    cpus = {op: [] for op in OPS}
    cold = True
    for _ in range(rounds):
        for op in OPS:
            path = files["torch" if op.startswith("torch") else "fastckpt"]
            if op.endswith("load") or "load(" in op:
                cold = drop_caches() and cold
            r = run_op(case, n, op, path)
            times[op].append(r["seconds"])
            cpus[op].append(r["cpu"])
    return {"case": case, "n": n, "rounds": rounds, "cold_cache": cold,
            "seconds": {op: statistics.median(v) for op, v in times.items()},
            "cpu_seconds": {op: statistics.median(v) for op, v in cpus.items()},
            "bytes": {k: os.path.getsize(p) for k, p in files.items()}}


def table(res: dict) -> str:
    s, c, b = res["seconds"], res["cpu_seconds"], res["bytes"]
    lines = [f"case {res['case']} (n={res['n']}, {res['rounds']} round(s), "
             f"{'cold' if res['cold_cache'] else 'warm'} page cache; fresh process per operation)",
             f"{'operation':24} {'seconds':>9} {'CPU s':>9} {'vs torch':>9}"]
    ref = {"fastckpt.save": "torch.save", "fastckpt.load": "torch.load", "fastckpt.load(verify)": "torch.load"}
    for op in OPS:
        vs = f"{s[ref[op]] / s[op]:8.2f}x" if op in ref and s[op] > 0 else ""
        lines.append(f"{op:24} {s[op]:9.3f} {c[op]:9.3f} {vs:>9}")
    lines.append(f"{'file size':24} fastckpt {b['fastckpt'] / 1e6:.1f} MB, torch.save {b['torch'] / 1e6:.1f} MB "
                 f"({b['fastckpt'] / b['torch']:.2f}x)")
    return "\n".join(lines)


def report(results: list) -> dict:
    """benchmarks/report.py's STANDALONE contract: one table and its targets
    (save, load and verify at least as fast as torch.save / torch.load; file <= 1.3x)."""
    rows, targets = [], []
    ref = {"fastckpt.save": "torch.save", "fastckpt.load": "torch.load", "fastckpt.load(verify)": "torch.load"}
    for res in results:
        s, c, b = res["seconds"], res["cpu_seconds"], res["bytes"]
        for op in OPS:
            speed = round(s[ref[op]] / s[op], 2) if op in ref and s[op] > 0 else ""
            rows.append([res["case"], op, round(s[op], 3), round(c[op], 3), speed])
        rows.append([res["case"], "file size (MB): fastckpt / torch.save",
                     round(b["fastckpt"] / 1e6, 1), round(b["torch"] / 1e6, 1), round(b["fastckpt"] / b["torch"], 2)])
        if res["case"] == "scalars":
            for op in ref:
                x = s[ref[op]] / s[op] if s[op] > 0 else None
                targets.append({"target": f"{res['n']} scalars: {op} at least as fast as {ref[op]}",
                                "measured": None if x is None else round(x, 2), "unit": "x",
                                "met": None if x is None else x >= 1.0})
            ratio = b["fastckpt"] / b["torch"]
            targets.append({"target": f"{res['n']} scalars: file within 1.3x of torch.save's",
                            "measured": round(ratio, 2), "unit": "x", "met": ratio <= 1.3})
    cold = all(r["cold_cache"] for r in results)
    return {"title": "Many small tensors: save, load and verify against torch (fresh process per operation)",
            "columns": ["case", "operation", "seconds", "CPU s", "speed vs torch"],
            "rows": rows, "targets": targets,
            "notes": [f"medians of {results[0]['rounds'] if results else 0} round(s); "
                      f"{'cold' if cold else 'warm (drop_caches not permitted)'} page cache before each load"],
            "errors": [], "raw": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=["scalars", "model", "all"], default="all")
    ap.add_argument("--n", type=int, default=100_000, help="scalar tensors (model: about n/10 small params)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the results here (benchmarks/report.py's format)")
    ap.add_argument("--quick", action="store_true", help="10,000 scalars and the model case, one round")
    a = ap.parse_args(argv)
    if a.quick:
        a.n, a.rounds = min(a.n, 10_000), 1
    cases = ["scalars", "model"] if a.case == "all" else [a.case]
    results = []
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="bench_small.") as d:
        for case in cases:
            res = bench(case, a.n, a.rounds, d)
            results.append(res)
            print(table(res), flush=True)
            print()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report(results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
