#!/usr/bin/env python3
"""Fixed costs: the first save and load of a small checkpoint in a fresh process.

What is measured
----------------
A ~400 KB state dict (a few float32 tensors of mixed sizes and some scalars), saved once. Then,
each in its own fresh Python process (``subprocess``, never a fork of a warm one), alternating
between the methods so that a change in the machine's load falls on all of them alike:

* ``import``: ``import torch``, then ``import fastckpt`` (timed separately).
* ``fastckpt.load``: the first ``fastckpt.load(path)`` of the process (torch and fastckpt
  already imported, untimed); then a second load of the same file (warm).
* ``torch.load``: the first ``torch.load(path)`` of a process that imported only torch.
* ``fastckpt.save`` / ``torch.save``: the first save of the same state dict to a new name in
  the same directory (torch.save then fsyncs the file and the directory, as fastckpt.save does).

The file is in the page cache (it was just written): this measures fixed costs (engine, ring,
buffer pool, imports, parsing), not the disk. Medians of --reps runs per method.

Usage::

    python benchmarks/bench_first_load.py [--dir DIR] [--reps 12] [--size-kb 400] [--json OUT]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
mode, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
def timed(key, fn, *args):
    c, t = time.process_time(), time.perf_counter()
    v = fn(*args)
    r[key] = time.perf_counter() - t
    r[key + "_cpu"] = time.process_time() - c
    return v
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
r = {"import_torch": t1 - t0}
if mode.startswith("fastckpt") or mode == "import":
    import fastckpt
    r["import_fastckpt"] = time.perf_counter() - t1
if mode == "import":
    pass
elif mode == "fastckpt.load":
    timed("first", fastckpt.load, path)
    timed("second", fastckpt.load, path)
    eng = fastckpt.get_engine()
    r["touched"] = getattr(eng, "buffers_touched", None)
    r["registered"] = getattr(eng, "buffers_registered", None)
elif mode == "torch.load":
    timed("first", torch.load, path)
    timed("second", torch.load, path)
elif mode in ("fastckpt.save", "torch.save"):
    sd = torch.load(path)
    def fsave(sd, p):
        torch.save(sd, p)
        fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)
        fd = os.open(os.path.dirname(p), os.O_RDONLY); os.fsync(fd); os.close(fd)
    save = fastckpt.save if mode == "fastckpt.save" else fsave
    timed("first", save, sd, out)
    timed("second", save, sd, out)
    os.unlink(out)
print("RESULT " + json.dumps(r))
"""

MODES = ("import", "fastckpt.load", "torch.load", "fastckpt.save", "torch.save")


def make_state(size_kb: int):
    import torch
    g = torch.Generator().manual_seed(0)
    n = size_kb * 1024 // 4
    sizes = [n // 2, n // 4, n // 8, n // 16]
    sizes.append(n - sum(sizes) - 64)
    sd = {f"layer{i}.weight": torch.randn(k, generator=g) for i, k in enumerate(sizes)}
    sd.update({f"layer{i}.step": torch.tensor(float(i)) for i in range(4)})
    sd["epoch"] = 3
    return sd


def run_child(mode: str, path: str, out: str, env) -> dict:
    # cwd: the checkpoint's directory, so that the child imports the fastckpt
    # of PYTHONPATH (set below to the parent's), not one in the caller's cwd.
    p = subprocess.run([sys.executable, "-c", CHILD, mode, path, out], env=env, capture_output=True, text=True,
                       check=False, cwd=os.path.dirname(path))
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{mode} child failed (rc {p.returncode}):\n{p.stderr[-2000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory for the checkpoint (default: a temporary one)")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--size-kb", type=int, default=400)
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--quick", action="store_true", help="4 repetitions")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = min(args.reps, 4)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; known: {', '.join(MODES)}")

    import torch
    import fastckpt  # the one under test (PYTHONPATH decides which)
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_first_load.") as d:
        path = os.path.join(d, "small.pt")
        fastckpt.save(make_state(args.size_kb), path)
        size = os.path.getsize(path)
        runs = {m: [] for m in modes}
        for rep in range(args.reps):
            order = modes if rep % 2 == 0 else modes[::-1]
            for m in order:
                runs[m].append(run_child(m, path, os.path.join(d, f"out.{m}.pt"), env))

    def med(m, k):
        vals = [r[k] for r in runs.get(m, ()) if k in r]
        return statistics.median(vals) * 1e3 if vals else None

    def fmt(v):
        return "-" if v is None else f"{v:8.2f}"

    print(f"fresh-process fixed costs: {size / 1e3:.0f} KB checkpoint, medians of {args.reps} runs (ms); "
          f"fastckpt from {pkg_root}")
    print(f"{'operation':<22}{'first':>10}{'second':>10}{'first CPU':>11}{'second CPU':>11}")
    if "import" in runs:
        print(f"{'import torch':<22}{fmt(med('import', 'import_torch')):>10}{'':>10}")
        print(f"{'import fastckpt':<22}{fmt(med('import', 'import_fastckpt')):>10}{'':>10}")
    for m in modes:
        if m != "import":
            print(f"{m:<22}{fmt(med(m, 'first')):>10}{fmt(med(m, 'second')):>10}"
                  f"{fmt(med(m, 'first_cpu')):>11}{fmt(med(m, 'second_cpu')):>11}")
    if "fastckpt.load" in runs and "torch.load" in runs:
        d = med("fastckpt.load", "first") - med("torch.load", "first")
        print(f"first fastckpt.load - first torch.load: {d:+.2f} ms wall (target: <= +5 ms), "
              f"{med('fastckpt.load', 'first_cpu') - med('torch.load', 'first_cpu'):+.2f} ms CPU")
    if runs.get("fastckpt.load"):
        r = runs["fastckpt.load"][-1]
        print(f"engine after two loads: {r.get('touched')} buffer(s) touched, {r.get('registered')} registered")
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("note: PYTHONDONTWRITEBYTECODE is set: imports compile fastckpt's sources in every process")
    if args.json:
        rows = []
        if "import" in runs:
            rows += [["import torch", fmt(med("import", "import_torch")).strip(), "", "", ""],
                     ["import fastckpt", fmt(med("import", "import_fastckpt")).strip(), "", "", ""]]
        rows += [[m, fmt(med(m, "first")).strip(), fmt(med(m, "second")).strip(),
                  fmt(med(m, "first_cpu")).strip(), fmt(med(m, "second_cpu")).strip()] for m in modes if m != "import"]
        targets = []
        if "fastckpt.load" in runs and "torch.load" in runs:
            gap = med("fastckpt.load", "first") - med("torch.load", "first")
            targets.append({"target": "first small fastckpt.load in a fresh process <= first torch.load + 5 ms",
                            "measured": round(gap, 2), "unit": "ms", "met": gap <= 5.0})
        notes = [f"{size / 1e3:.0f} KB checkpoint, medians of {args.reps} fresh processes (ms)"]
        if os.environ.get("PYTHONDONTWRITEBYTECODE"):
            notes.append("PYTHONDONTWRITEBYTECODE is set: imports compile fastckpt's sources in every process")
        with open(args.json, "w") as f:
            json.dump({"title": "The first small load in a fresh process, against torch.load",
                       "columns": ["operation", "first (ms)", "second (ms)", "first CPU (ms)", "second CPU (ms)"],
                       "rows": rows, "targets": targets, "notes": notes, "errors": [],
                       "raw": {"size": size, "reps": args.reps, "runs": runs}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
