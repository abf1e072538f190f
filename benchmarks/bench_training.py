#!/usr/bin/env python3
"""Training-loop checkpointing: what a checkpoint every K steps costs the loop.

What is measured
----------------
An MLP of ``--width`` x ``--width`` Linear layers, as many as make the state
(fp32 parameters + AdamW's two moments, 12 bytes per parameter) about
``--size`` bytes, trained with AdamW (foreach) on one fixed random batch on
the CPU. The state saved is ``{"model": model.state_dict(), "optim":
opt.state_dict(), "step": i}``, every ``--every`` steps, to one path (each
save replaces the previous file), in four modes:

* ``none``: no checkpoint;
* ``torch.save``: ``torch.save`` then ``fsync`` of the file and of its
  directory (durable, as fastckpt's saves are);
* ``fastckpt.save``: synchronous (temporary name, O_DIRECT, fdatasync, rename,
  directory fsync);
* ``fastckpt.async_save``: the call returns after the host snapshot; the write
  runs in the background while training continues; the next checkpoint (or
  the end of the run) waits for it if it is not done.

Per mode: the median time of a training step without a checkpoint (with
async_save it includes any slow-down from the background write sharing the
CPUs and memory bandwidth), the median time the checkpoint call blocks the
loop, what checkpointing took from the loop per step (blocked time plus the
final wait for the last async save, over the steps: robust to noisy step
times), the wall time per step over the whole run and its overhead over
``none`` (which moves with the machine's other load). Headline: async_save's
blocking time as a fraction of fastckpt.save's (the target: below 10%
on a 1-2 GiB state; on a CPU-only machine the snapshot is a memcpy of the
whole state, so the fraction is about disk bandwidth / memory bandwidth).

Every mode starts with one untimed save (engine buffers, staging arena, page
cache of the code), as a long-lived trainer would have done; the first
async_save's blocking time (it allocates the arena) is reported apart. Modes
run in the order none, torch, fastckpt, async, and in reverse on odd
repetitions; figures are medians over repetitions.

Examples::

    .venv/bin/python benchmarks/bench_training.py --quick
    .venv/bin/python benchmarks/bench_training.py --size 1.5G --steps 20 --every 5 --reps 2 --json /tmp/train.json
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch
from torch import nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
import fastckpt  # noqa: E402
from benchmarks.harness import parse_size  # noqa: E402  (one copy, shared with `fastckpt bench`)

MiB, GiB = 1 << 20, 1 << 30
MODES = ("none", "torch.save", "fastckpt.save", "fastckpt.async_save")


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Trainer:
    def __init__(self, size: int, width: int, batch: int, seed: int = 0):
        torch.manual_seed(seed)
        layers = max(1, round(size / 12 / (width * width + width)))
        mods: List[nn.Module] = []
        for i in range(layers):
            mods.append(nn.Linear(width, width))
            if i + 1 < layers:
                mods.append(nn.ReLU())
        self.model = nn.Sequential(*mods)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, foreach=True)
        self.x = torch.randn(batch, width)
        self.y = torch.randn(batch, width)
        self.layers = layers
        self.step()  # AdamW's moments exist from here on

    def step(self) -> None:
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def state(self, i: int) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": i}

    def state_bytes(self) -> int:
        sd = self.state(0)
        n = sum(t.nbytes for t in sd["model"].values())
        n += sum(t.nbytes for st in sd["optim"]["state"].values() for t in st.values() if torch.is_tensor(t))
        return n


def make_saver(mode: str, path: str):
    d = os.path.dirname(path)
    if mode == "torch.save":
        def save(sd):
            torch.save(sd, path)
            fsync_path(path)
            fsync_path(d, directory=True)
        return save
    if mode == "fastckpt.save":
        return lambda sd: fastckpt.save(sd, path)
    if mode == "fastckpt.async_save":
        return lambda sd: fastckpt.async_save(sd, path)
    return None


def run_mode(tr: Trainer, mode: str, steps: int, every: int, workdir: str) -> Dict[str, Any]:
    path = os.path.join(workdir, "ckpt.pt")
    save = make_saver(mode, path)
    out: Dict[str, Any] = {"mode": mode}
    if save is not None:  # warm-up save, untimed
        t0 = time.perf_counter()
        r = save(tr.state(0))
        out["first_block_s"] = time.perf_counter() - t0
        if mode == "fastckpt.async_save":
            r.result()
    for _ in range(2):  # untimed: the allocator and caches settle after the save
        tr.step()
    gc.collect()
    step_s: List[float] = []
    block_s: List[float] = []
    writes: List[Any] = []
    t_start = time.perf_counter()
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        tr.step()
        t1 = time.perf_counter()
        if save is not None and i % every == 0:
            r = save(tr.state(i))
            block_s.append(time.perf_counter() - t1)
            if r is not None:
                writes.append(r)
        else:
            step_s.append(t1 - t0)
    t_wait = time.perf_counter()
    if mode == "fastckpt.async_save":
        fastckpt.wait_for_saves()
        out["write_s"] = statistics.median(f.result().write_seconds for f in writes)
        out["snapshot_s"] = statistics.median(f.result().snapshot_seconds for f in writes)
    out["final_wait_s"] = time.perf_counter() - t_wait
    # what the loop lost to checkpointing, per step, not counting any slow-down of the steps themselves
    out["ckpt_per_step_s"] = (sum(block_s) + out["final_wait_s"]) / steps
    out["wall_s"] = time.perf_counter() - t_start
    out["per_step_s"] = out["wall_s"] / steps
    out["step_s"] = statistics.median(step_s)
    out["block_s"] = statistics.median(block_s) if block_s else 0.0
    out["checkpoints"] = len(block_s)
    if os.path.exists(path):
        os.unlink(path)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to test; files go to a temporary .bench-tmp-* "
                                  "directory inside it, removed at the end (default: the repository root)")
    ap.add_argument("--size", type=parse_size, default=None, help="state bytes (default 1.5G; --quick: 64M)")
    ap.add_argument("--width", type=int, default=None, help="layer width (default 4096; --quick: 1024)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 20; --quick: 12)")
    ap.add_argument("--every", type=int, default=None, help="checkpoint every K steps (default 5; --quick: 4)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--only", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--quick", action="store_true", help="a small state, a few seconds")
    ap.add_argument("--json", help="write the raw figures here")
    args = ap.parse_args(argv)
    q = args.quick
    size = args.size or (64 * MiB if q else 3 * GiB // 2)
    width = args.width or (1024 if q else 4096)
    steps = args.steps or (12 if q else 20)
    every = args.every or (4 if q else 5)
    modes = [m for m in MODES if m in args.only.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    parent = os.path.abspath(args.dir) if args.dir else REPO_ROOT
    workdir = tempfile.mkdtemp(prefix=".bench-tmp-training-", dir=parent)
    try:
        tr = Trainer(size, width, args.batch)
        nbytes = tr.state_bytes()
        eng = fastckpt.get_engine()
        print(f"state: {nbytes / GiB:.2f} GiB ({tr.layers} x Linear({width}, {width}) + AdamW), batch {args.batch}, "
              f"{steps} steps, checkpoint every {every}, {args.reps} rep(s); torch threads {torch.get_num_threads()}, "
              f"{os.cpu_count()} CPUs; engine backend {eng.backend}; dir {workdir}", flush=True)
        results: Dict[str, List[Dict[str, Any]]] = {m: [] for m in modes}
        for rep in range(args.reps):
            order = modes if rep % 2 == 0 else modes[::-1]
            for m in order:
                r = run_mode(tr, m, steps, every, workdir)
                results[m].append(r)
                print(f"  rep {rep} {m:20s} step {r['step_s'] * 1e3:8.1f} ms  block {r['block_s'] * 1e3:8.1f} ms  "
                      f"per step {r['per_step_s'] * 1e3:8.1f} ms", flush=True)

        def med(m, k):
            vals = [r[k] for r in results[m] if k in r]
            return statistics.median(vals) if vals else float("nan")

        base = med("none", "per_step_s") if "none" in results else float("nan")
        print()
        print(f"{'mode':22s} {'step ms':>9s} {'ckpt blocks ms':>15s} {'ckpt ms/step':>13s} {'per step ms':>12s} "
              f"{'overhead':>9s}  notes")
        for m in modes:
            notes = ""
            if m == "fastckpt.async_save":
                notes = (f"first call {med(m, 'first_block_s') * 1e3:.0f} ms (allocates the arena); background write "
                         f"{med(m, 'write_s') * 1e3:.0f} ms; final wait {med(m, 'final_wait_s') * 1e3:.0f} ms")
            elif m != "none":
                notes = f"{nbytes / med(m, 'block_s') / 1e9:.2f} GB/s"
            over = f"{(med(m, 'per_step_s') / base - 1) * 100:8.1f}%" if base == base else "        -"
            print(f"{m:22s} {med(m, 'step_s') * 1e3:9.1f} {med(m, 'block_s') * 1e3:15.1f} "
                  f"{med(m, 'ckpt_per_step_s') * 1e3:13.1f} {med(m, 'per_step_s') * 1e3:12.1f} {over}  {notes}")
        if "fastckpt.save" in results and "fastckpt.async_save" in results:
            frac = med("fastckpt.async_save", "block_s") / med("fastckpt.save", "block_s")
            print(f"\nasync_save blocks the loop for {frac * 100:.1f}% of fastckpt.save's time "
                  f"({med('fastckpt.async_save', 'block_s') * 1e3:.0f} ms vs {med('fastckpt.save', 'block_s') * 1e3:.0f} ms"
                  f"; snapshot {nbytes / med('fastckpt.async_save', 'snapshot_s') / 1e9:.1f} GB/s)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"state_bytes": nbytes, "layers": tr.layers, "width": width, "batch": args.batch,
                           "steps": steps, "every": every, "threads": torch.get_num_threads(),
                           "backend": eng.backend, "results": results}, f, indent=1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
