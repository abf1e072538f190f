#!/usr/bin/env python3
"""Fixed costs: the first save and load of a state in a fresh process, every path, against torch and safetensors.

What is measured
----------------
A state dict of ``--sizes`` bytes (default 400 KiB, 1 MiB and 64 MiB: five float32 tensors of mixed
sizes and four scalars), saved once as a torch.save-format file and as a safetensors file. Then,
each in its own fresh Python process (``subprocess``, never a fork of a warm one), alternating
between the operations so that a change in the machine's load falls on all of them alike, the
first call of the process (after its imports, which are timed on rows of their own) and a second:

* loads: fastckpt.load, torch.load, torch.load(mmap=True) (a byte per page touched),
  fastckpt.load_into (a state of zeros already in memory), fastckpt.safetensors.load_file,
  safetensors.load_file (a byte per page touched);
* saves, durable: fastckpt.save, fastckpt.async_save (until its future is done, and until the call returned), torch.save then
  fsync of the file and its directory, fastckpt.safetensors.save_file, safetensors.save_file then
  the same fsyncs.

Each fastckpt row is compared with its peer (torch's, or safetensors' own). The checkpoint is in
the page cache (it was just written): this measures fixed costs (engine, ring, buffer pool,
imports, parsing, first-touch of memory), not the disk. Medians of --reps processes.

Usage::

    python benchmarks/bench_first_load.py [--dir DIR] [--reps 8] [--sizes 400K,1M,64M] [--json OUT]
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
def fsynced(p):
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)
    fd = os.open(os.path.dirname(p), os.O_RDONLY); os.fsync(fd); os.close(fd)
def touched(sd):  # a mapped load's pages read, as every other load's are
    for v in sd.values():
        if v.numel():
            v.view(-1)[:: max(1, 4096 // v.element_size())].sum()
    return sd
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
r = {"import_torch": t1 - t0}
if mode.startswith("fastckpt") or mode == "import":
    import fastckpt
    import fastckpt.safetensors as fst
    r["import_fastckpt"] = time.perf_counter() - t1
if mode.startswith("safetensors"):
    import safetensors.torch as st
st_path = path[:-3] + ".safetensors"
if mode == "import":
    fn = None
elif mode == "fastckpt.load":
    fn = lambda: fastckpt.load(path)
elif mode == "torch.load":
    fn = lambda: torch.load(path)
elif mode == "torch.load(mmap)":
    fn = lambda: touched(torch.load(path, mmap=True))
elif mode == "fastckpt.load_into":
    target = {k: torch.zeros_like(v) for k, v in torch.load(path).items()}
    fn = lambda: fastckpt.load_into(target, path)
elif mode == "fastckpt.safetensors.load_file":
    fn = lambda: fst.load_file(st_path)
elif mode == "safetensors.load_file":
    fn = lambda: touched(st.load_file(st_path))
else:
    sd = torch.load(path)
    if mode == "fastckpt.save":
        fn = lambda: fastckpt.save(sd, out)
    elif mode == "fastckpt.async_save":
        fn = None  # timed below: the call and the wait for its future apart
    elif mode == "torch.save":
        fn = lambda: (torch.save(sd, out), fsynced(out))
    elif mode == "fastckpt.safetensors.save_file":
        fn = lambda: fst.save_file(sd, out)
    elif mode == "safetensors.save_file":
        fn = lambda: (st.save_file(sd, out), fsynced(out))
if mode == "fastckpt.async_save":  # until durable, and until the call returned (what the caller is blocked for)
    for k in ("first", "second"):
        timed(k + "_wait", timed(k + "_returned", lambda: fastckpt.async_save(sd, out)).result)
        r[k] = r[k + "_returned"] + r[k + "_wait"]
        r[k + "_cpu"] = r[k + "_returned_cpu"] + r[k + "_wait_cpu"]
if fn is not None:
    timed("first", fn)
    timed("second", fn)
if mode == "fastckpt.load":
    eng = fastckpt.get_engine()
    r["touched"] = getattr(eng, "buffers_touched", None)
    r["registered"] = getattr(eng, "buffers_registered", None)
if os.path.exists(out):
    os.unlink(out)
print("RESULT " + json.dumps(r))
"""

# (mode, the peer its time is compared with)
MODES = (("import", None), ("fastckpt.load", "torch.load"), ("torch.load", None), ("torch.load(mmap)", None),
         ("fastckpt.load_into", "torch.load"), ("fastckpt.safetensors.load_file", "safetensors.load_file"),
         ("safetensors.load_file", None), ("fastckpt.save", "torch.save"), ("fastckpt.async_save", "torch.save"),
         ("torch.save", None), ("fastckpt.safetensors.save_file", "safetensors.save_file"),
         ("safetensors.save_file", None))
PEER = dict(MODES)
DEFAULT_SIZES = "400K,1M,64M"


def make_state(nbytes: int):
    import torch
    g = torch.Generator().manual_seed(0)
    n = nbytes // 4
    sizes = [n // 2, n // 4, n // 8, n // 16]
    sizes.append(n - sum(sizes) - 64)
    sd = {f"layer{i}.weight": torch.randn(k, generator=g) for i, k in enumerate(sizes)}
    sd.update({f"layer{i}.step": torch.tensor(float(i)) for i in range(4)})
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


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory for the checkpoint (default: a temporary one)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"state sizes (default {DEFAULT_SIZES})")
    ap.add_argument("--json", default=None, help="also write the results here (report.py's STANDALONE format)")
    ap.add_argument("--modes", default=",".join(m for m, _ in MODES))
    ap.add_argument("--quick", action="store_true", help="3 repetitions, 400K and 1M")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = min(args.reps, 3)
        args.sizes = "400K,1M"
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in PEER:
            ap.error(f"unknown mode {m!r}; known: {', '.join(PEER)}")
    sizes = [_size(x) for x in args.sizes.split(",") if x]

    import torch  # noqa: F401
    import fastckpt  # the one under test (PYTHONPATH decides which)
    import fastckpt.safetensors as fst
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    runs = {}  # (size, mode) -> [result, ...]
    errors = []
    with tempfile.TemporaryDirectory(dir=args.dir and os.path.abspath(args.dir), prefix="bench_first_load.") as d:
        if os.environ.get("PYTHONDONTWRITEBYTECODE"):
            # An installed package has its bytecode (pip compiles it at install, as it did torch's and
            # safetensors'); a checkout under PYTHONDONTWRITEBYTECODE compiles every imported source in
            # every process. fastckpt's bytecode, compiled once beside its sources (__pycache__, as any
            # import without the variable leaves it), which the children read and still write nothing.
            # (Not PYTHONPYCACHEPREFIX: under it torch's own bytecode in site-packages is not read.)
            subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(pkg_root, "fastckpt")],
                           env=dict(env, PYTHONDONTWRITEBYTECODE=""), check=True, capture_output=True)
        for nbytes in sizes:
            path = os.path.join(d, f"state{nbytes}.pt")
            sd = make_state(nbytes)
            fastckpt.save(sd, path)
            fst.save_file(sd, path[:-3] + ".safetensors")
            for rep in range(args.reps):
                order = modes if rep % 2 == 0 else modes[::-1]
                for m in order:
                    try:
                        runs.setdefault((nbytes, m), []).append(
                            run_child(m, path, os.path.join(d, f"out.{m}.pt"), env))
                    except RuntimeError as e:
                        if rep == 0:
                            errors.append(f"{m} at {nbytes} bytes: {str(e)[:400]}")

    def med(n, m, k):
        vals = [r[k] for r in runs.get((n, m), ()) if k in r]
        return statistics.median(vals) * 1e3 if vals else None

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    def label(n):
        return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"

    rows = []
    n0 = sizes[0]
    if "import" in modes:
        rows += [["import torch", "", fmt(med(n0, "import", "import_torch")), "", "", "", ""],
                 ["import fastckpt", "", fmt(med(n0, "import", "import_fastckpt")), "", "", "", ""]]
    for n in sizes:
        for m in modes:
            if m == "import":
                continue
            peer = PEER[m]
            ratio = ""
            if peer in modes and med(n, m, "first") and med(n, peer, "first"):
                ratio = f"{med(n, peer, 'first') / med(n, m, 'first'):.2f}x"
            rows.append([m, label(n), fmt(med(n, m, "first")), fmt(med(n, m, "second")), fmt(med(n, m, "first_cpu")),
                         ratio, peer or ""])
            if m == "fastckpt.async_save":  # the call alone: its caller's wait (the write goes on behind it)
                ratio = ""
                if peer in modes and med(n, m, "first_returned") and med(n, peer, "first"):
                    ratio = f"{med(n, peer, 'first') / med(n, m, 'first_returned'):.2f}x"
                rows.append([m + ", returned", label(n), fmt(med(n, m, "first_returned")),
                             fmt(med(n, m, "second_returned")), fmt(med(n, m, "first_returned_cpu")), ratio,
                             peer or ""])
    cols = ["operation", "state", "first (ms)", "second (ms)", "first CPU (ms)", "speed vs peer (first)", "peer"]
    print(f"fresh-process fixed costs, medians of {args.reps} processes per operation (ms); the file in the page "
          f"cache; fastckpt from {pkg_root}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    targets = []
    if "fastckpt.load" in modes and "torch.load" in modes and med(n0, "fastckpt.load", "first") is not None \
            and med(n0, "torch.load", "first") is not None:
        gap = med(n0, "fastckpt.load", "first") - med(n0, "torch.load", "first")
        targets.append({"target": f"first {label(n0)} fastckpt.load in a fresh process <= first torch.load + 5 ms",
                        "measured": round(gap, 2), "unit": "ms", "met": gap <= 5.0})
    for n in sizes[1:]:
        for m in ("fastckpt.load", "fastckpt.save", "fastckpt.safetensors.load_file", "fastckpt.safetensors.save_file"):
            peer = PEER[m]
            if m in modes and peer in modes and med(n, m, "first") and med(n, peer, "first"):
                x = med(n, peer, "first") / med(n, m, "first")
                targets.append({"target": f"first {m} of {label(n)} in a fresh process at least as fast as {peer}",
                                "measured": round(x, 2), "unit": "x", "met": x >= 1.0})
    if runs.get((n0, "fastckpt.load")):
        r = runs[(n0, "fastckpt.load")][-1]
        print(f"engine after two loads: {r.get('touched')} buffer(s) touched, {r.get('registered')} registered")
    notes = [f"medians of {args.reps} fresh processes per operation and size, alternating; after import (its "
             "own rows); the checkpoint was just written (in the page cache): the fixed costs, not the disk",
             "saves are durable: torch.save and safetensors.save_file are followed by fsync of the file and its "
             "directory; fastckpt.async_save is timed until its future is done, and on its 'returned' row until the "
             "call returned (the caller's wait; the write goes on behind it); torch.load(mmap) and "
             "safetensors.load_file touch a byte per page (their data is mapped, not read)"]
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        notes.append("PYTHONDONTWRITEBYTECODE is set here: fastckpt's bytecode was compiled once before the runs "
                     "(compileall, into its __pycache__), as pip compiles an installed package's, torch's and "
                     "safetensors' among them")
    for e in errors:
        print("ERROR: " + e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": "Fixed costs: the first save and load in a fresh process, against torch and "
                                "safetensors", "columns": cols, "rows": rows, "targets": targets, "notes": notes,
                       "errors": errors, "raw": {"sizes": sizes, "reps": args.reps,
                                                 "runs": {f"{n}:{m}": v for (n, m), v in runs.items()}}}, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
