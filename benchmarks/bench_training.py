#!/usr/bin/env python3
"""The stall a training loop feels: what a checkpoint every K steps takes from the loop, per checkpointing method.

What is measured
----------------
An MLP of ``--width`` x ``--width`` Linear layers, as many as make the state
(fp32 parameters + AdamW's two moments, 12 bytes per parameter) about
``--size`` bytes, trained with AdamW (foreach) on one fixed random batch on
the CPU. The state saved is ``{"model": model.state_dict(), "optim":
opt.state_dict(), "step": i}``, every ``--every`` steps, in these modes (one
process, no peers):

* ``none``: no checkpoint (the reference step time);
* ``torch.save``: ``torch.save`` then ``fsync`` of the file and of its directory;
* ``fastckpt.save``: synchronous (temporary name, O_DIRECT, fdatasync, rename, directory fsync);
* ``fastckpt.async_save``: returns after the host snapshot; the write runs in the background;
* ``fastckpt.async_save(background)``: ``background_staging=True``: returns after pickling; the
  large tensors are copied by a staging thread, or written straight from their memory, until the
  fence (the next ``optimizer.step()``), as the knob ``async_write_through`` chooses: by default
  per save, from whether the last one was written before its fence; ``(background-copy)`` and
  ``(background-through)`` pin the knob to 0 (always copy) and 1 (always write through);
  ``(background-split)`` copies, the call itself ``--caller-copy`` percent of the bytes (the knob
  ``async_caller_copy``), the staging thread the rest;
* ``memory.snapshot``: ``CheckpointManager(memory=MemoryTier(keep=2, replicas=0)).snapshot(step)``:
  the state copied into host memory (a tmpfs), its CRC-32 and commit record in the background
  ("durable" here: committed in host memory, which survives the process but not the node; a
  ``save`` of the snapshot's step then writes it to disk from memory, timed once per run);
* ``dcp.async_save``: ``torch.distributed.checkpoint.async_save``, stock ``FileSystemWriter``
  (``sync_files=True``), thread executor, a directory per checkpoint;
* ``torch_checkpointing``: Meta's ``torch_checkpointing`` ``CheckpointManager`` with async save
  (staging in a thread, the write in its subprocess), ``optimizer.step()`` guarded by
  ``mgr.lock()`` as its docs require, a directory per checkpoint.

Per checkpoint, on the training thread's clock:

* blocked: the call's duration, plus every wait the loop does later because of it (the
  ``mgr.lock()`` wait before ``optimizer.step()``, the wait for it to be done before the next
  checkpoint, or at the end of the run);
* staged: from the call until the state may be mutated again (the call's return, or
  torch_checkpointing's staging future);
* durable: from the call until its write is done (the write future; the memory tier's commit);
* the interference window: the median step time (forward, backward, optimizer step; lock waits
  not included) of the steps that start while a background write runs, over the median of the
  mode's other steps (in the same run: other load on the machine moves both alike).

Every mode starts fresh (its saver, manager or executor made for it, closed after it), with two
untimed checkpoints (the first one's blocked time, allocations included, is reported apart: "first
save"; the second lets a two-slot tier reuse its slots), then ``--steps`` timed steps with a
checkpoint every ``--every`` steps (not at the last step: the run ends with a wait for the last
checkpoint). Goodput: the useful step time (the sum of the steps' forward, backward and optimizer
step) over the wall time of the timed loop (end wait included): what blocking takes; a step slowed by
a background write still counts as useful (that is the interference window's part). CPU-s of the
background writer: the process's CPU time (all threads, and child processes) over the timed loop,
less the training threads' (the main thread and torch's intra-op pool), per checkpoint. Modes run
in the order given, reversed on odd repetitions; after its timed loop each mode takes one more checkpoint
(untimed, the next optimizer step right after the call, as in the loop), reads it back with its own
loader and compares it with a copy of the state at the call ("read back": bitwise, or the differences
in the errors); figures are medians over checkpoints and
repetitions. Reference, measured before each mode: a plain copy of every tensor of the state into
preallocated, already-touched memory (``copy_``).

Output: Markdown on stdout, and with ``--json`` report.py's standalone JSON (benchmarks/report.py,
``STANDALONE``) plus a chart beside it (``<json name>.png``).

Examples::

    .venv/bin/python benchmarks/bench_training.py --quick
    .venv/bin/python benchmarks/bench_training.py --size 1.5G --reps 2 --json /tmp/stall.json
"""

import argparse
import contextlib
import copy
import gc
import os
import shutil
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional

# The job's tensors of 2 MiB and more on page boundaries, as torch allocates them under
# THP_MEM_ALLOC_ENABLE=1 (read once, at torch's first allocation: so set before torch is imported):
# what lets background staging write them straight from their memory. Every mode runs in this
# process, the reference steps included. --default-alloc keeps torch's default 64-byte alignment.
if __name__ == "__main__" and os.environ.get("THP_MEM_ALLOC_ENABLE") is None and "--default-alloc" not in sys.argv:
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch
from torch import nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
import fastckpt  # noqa: E402
from benchmarks.harness import emit_standalone, fmt_opt, median, parse_size, warm_copy_seconds  # noqa: E402
from benchmarks.stall_modes import MODE_CLASSES, CpuMeter, FastAsync, MemorySnapshot, Mode, perf  # noqa: E402
from benchmarks.workload import compare, iter_tensors  # noqa: E402
from fastckpt._core.units import human  # noqa: E402  (the package's one size formatter)

MiB, GiB = 1 << 20, 1 << 30
BACKGROUND = ("fastckpt.async_save(background)", "fastckpt.async_save(background-copy)",
              "fastckpt.async_save(background-through)", "fastckpt.async_save(background-split)")
MODES = ("none", "torch.save", "fastckpt.save", "fastckpt.async_save") + BACKGROUND + \
    ("memory.snapshot", "dcp.async_save", "torch_checkpointing")
WARMUPS = 2


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

    def step(self, guard: Optional[Callable[[], Any]] = None):
        """One step; returns (seconds computing, seconds waiting for `guard` before optimizer.step())."""
        t0 = perf()
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        t1 = perf()
        with guard() if guard is not None else contextlib.nullcontext():
            t2 = perf()
            self.opt.step()
        t3 = perf()
        return t3 - t0 - (t2 - t1), t2 - t1

    def state(self, i: int) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": i}


def run_mode(tr: Trainer, name: str, steps: int, every: int, parent: str, training: set) -> Dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f".bench-tmp-stall-{name.replace('.', '_')}-", dir=parent)
    out: Dict[str, Any] = {"mode": name}
    mode: Optional[Mode] = None
    try:
        # the reference, measured next to each mode (other load on the machine moves both alike)
        out["copy_s"] = warm_copy_seconds(list(iter_tensors(tr.state(0))))
        gc.collect()
        mode = MODE_CLASSES[name](work) if name != "none" else None
        guard = mode.guard if mode is not None else None
        if mode is not None:  # untimed checkpoints: allocations, the writer's process or threads
            for w in range(WARMUPS):
                c = mode.checkpoint(w, tr.state(w))
                mode.wait(c)
                if w == 0:
                    out["first_blocked_s"] = max(c.call_end, c.staged or c.call_end) - c.t0
                    out["first_durable_s"] = c.durable - c.t0
        for _ in range(2):  # the allocator and caches settle after the saves
            tr.step(guard)
        gc.collect()
        meter = CpuMeter(training) if name != "none" else None
        cpu0 = meter.read() if meter else 0.0
        steps_t: List[List[float]] = []  # [start, compute seconds]
        ckpts: List[Ckpt] = []
        pending: Optional[Ckpt] = None
        t_start = perf()
        for i in range(1, steps + 1):
            t0 = perf()
            comp, lock_wait = tr.step(guard)
            steps_t.append([t0, comp])
            if pending is not None:
                pending.waited += lock_wait
            if mode is not None and i % every == 0 and i < steps:
                if pending is not None and not pending.done.is_set():  # one checkpoint in flight
                    t1 = perf()
                    mode.wait(pending)
                    pending.waited += perf() - t1
                pending = mode.checkpoint(i + WARMUPS, tr.state(i))
                ckpts.append(pending)
        if pending is not None:
            t1 = perf()
            mode.wait(pending)
            pending.waited += perf() - t1
        wall = perf() - t_start
        cpu1 = meter.read() if meter else 0.0
        out["load_avg"] = os.getloadavg()[0]  # other processes on the machine take CPUs from the loop too
        if isinstance(mode, MemorySnapshot):
            mode.persist(tr.state(steps))
            out["persist_s"] = mode.persist_s
        out.update(wall_s=wall, steps=steps, step_s=median([s for _, s in steps_t]),
                   useful_s=sum(s for _, s in steps_t),
                   step_times=[round(s, 5) for _, s in steps_t],
                   step_starts=[round(t - t_start, 5) for t, _ in steps_t],
                   ckpt_starts=[round(c.t0 - t_start, 5) for c in ckpts],
                   ckpt_durable=[round(c.durable - t_start, 5) for c in ckpts],
                   blocked_s=[c.call_end - c.t0 + c.waited for c in ckpts],
                   call_s=[c.call_end - c.t0 for c in ckpts],
                   staged_s=[(c.staged or c.call_end) - c.t0 for c in ckpts],
                   durable_s=[c.durable - c.t0 for c in ckpts],
                   bg_cpu_s=max(0.0, cpu1 - cpu0) / len(ckpts) if meter and ckpts else None)  # ticks: >= 0
        # the steps that started while a background write ran, and the others
        busy = [any(c.call_end < t0 < c.durable for c in ckpts) for t0, _ in steps_t]
        out["busy_steps"] = [s for (_, s), b in zip(steps_t, busy) if b]
        out["step_busy"] = busy
        out["quiet_step_s"] = median([s for (_, s), b in zip(steps_t, busy) if not b])
        if mode is not None:
            out["check"] = check_one(tr, mode, steps)
        if isinstance(mode, FastAsync):
            res = [c.future.result() for c in ckpts]
            out["snapshot_seconds"] = [r.snapshot_seconds for r in res]
            out["write_seconds"] = [r.write_seconds for r in res]
            out["through_bytes"] = [r.through_bytes for r in res]
            out["fence_copied_bytes"] = [r.fence_copied_bytes for r in res]
            out["nbytes"] = [r.nbytes for r in res]
        return out
    finally:
        t0 = perf()
        if mode is not None:
            mode.close()
        del mode
        gc.collect()
        shutil.rmtree(work, ignore_errors=True)  # dirty pages of deleted files are dropped, not written back
        out["cleanup_s"] = perf() - t0


def check_one(tr: Trainer, mode: Mode, steps: int) -> List[str]:
    """Untimed, after the loop: one more checkpoint as the loop takes them (the next step, whose optimizer
    step changes the state in place, right after the call), read back with the method's own loader and
    compared with a copy of the state taken at the call. Returns the differences (at most 5)."""
    i = steps + WARMUPS + 1
    state = tr.state(i)
    want = copy.deepcopy(state)
    c = mode.checkpoint(i, state)
    tr.step(mode.guard)
    mode.wait(c)
    got = mode.read(i, want)
    return compare(want, got)


# ------------------------------------------------------------------------------------------ the report

def summarize(results: Dict[str, List[Dict[str, Any]]], modes: List[str], errors: List[str]) -> Dict[str, Any]:
    ok = {m: [r for r in results[m] if "error" not in r] for m in modes}
    for m in modes:
        errors += [f"{m}: {r['error']}" for r in results[m] if "error" in r]
        errors += [f"{m}: the checkpoint read back differs from the state at its call: {'; '.join(r['check'])}"
                   for r in ok[m] if r.get("check")]

    def all_of(m, k):
        return [x for r in ok[m] for x in (r.get(k) or [])]

    def med(m, k):
        vals = [r[k] for r in ok[m] if r.get(k) is not None]
        return median(vals) if vals else None

    per: Dict[str, Dict[str, Any]] = {}
    for m in modes:
        if not ok[m]:
            continue
        blocked, durable = all_of(m, "blocked_s"), all_of(m, "durable_s")
        ratios = [b / d for b, d in zip(blocked, durable) if d > 0]
        busy = all_of(m, "busy_steps")
        per[m] = {
            "step_ms": (med(m, "step_s") or 0) * 1e3,
            "blocked_ms": median(blocked) * 1e3 if blocked else None,
            "blocked_pct": median(ratios) * 100 if ratios and m != "none" else None,
            "staged_ms": median(all_of(m, "staged_s")) * 1e3 if blocked else None,
            "durable_ms": median(durable) * 1e3 if durable else None,
            "interference": median(busy) / med(m, "quiet_step_s") if busy and med(m, "quiet_step_s") else None,
            "busy_n": len(busy),
            "first_ms": (med(m, "first_blocked_s") or 0) * 1e3 if m != "none" else None,
            "goodput": median([r["useful_s"] / r["wall_s"] for r in ok[m]]),
            "bg_cpu_s": med(m, "bg_cpu_s"),
            "persist_s": med(m, "persist_s"),
            "copy_ms": (med(m, "copy_s") or 0) * 1e3,
            "snapshot_ms": median(all_of(m, "snapshot_seconds")) * 1e3 if all_of(m, "snapshot_seconds") else None,
            "write_ms": median(all_of(m, "write_seconds")) * 1e3 if all_of(m, "write_seconds") else None,
            "check": None if m == "none" else "DIFFERS" if any(r.get("check") for r in ok[m]) else "bitwise",
        }
    return per


LABEL = {"memory.snapshot": "memory tier snapshot", "torch.save": "torch.save + fsync",
         "fastckpt.async_save(background)": "fastckpt.async_save, background staging (the default: written from "
                                            "the tensors when the last save was written before its fence, else "
                                            "copied)",
         "fastckpt.async_save(background-copy)": "fastckpt.async_save, background staging, every tensor copied "
                                                 "(knob async_write_through=0)",
         "fastckpt.async_save(background-through)": "fastckpt.async_save, background staging, written from the "
                                                    "tensors until the fence (knob async_write_through=1)",
         "dcp.async_save": "dcp.async_save (FileSystemWriter)", "torch_checkpointing": "torch_checkpointing async"}


def chart(per: Dict[str, Dict[str, Any]], results: Dict[str, List[Dict[str, Any]]], every: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = [m for m in per if m != "none"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 9), gridspec_kw={"height_ratios": [1, 1.2]})
    y = list(range(len(modes)))[::-1]
    for yy, m in zip(y, modes):
        p = per[m]
        ax.barh(yy, p["durable_ms"] or 0, color="#cfe3f3", edgecolor="#7aa9cf", label="until durable" if yy == y[0]
                else None)
        ax.barh(yy, p["staged_ms"] or 0, height=0.55, color="#7aa9cf", label="until staged" if yy == y[0] else None)
        ax.barh(yy, p["blocked_ms"] or 0, height=0.3, color="#c0392b",
                label="training loop blocked" if yy == y[0] else None)
        ax.text((p["durable_ms"] or 0) * 1.01, yy, f" {fmt_opt(p['blocked_ms'], '.0f')} ms blocked", va="center",
                fontsize=8)
    ax.set_yticks(y)
    ax.set_yticklabels([LABEL.get(m, m) for m in modes], fontsize=8)
    ax.set_xlabel("ms from the checkpoint call (steady checkpoints, medians)")
    ax.set_xlim(0, max((per[m]["durable_ms"] or 0) for m in modes) * 1.25 if modes else 1)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    ax.set_title("What one checkpoint costs the loop")
    for m in per:
        r = next((r for r in results[m] if "error" not in r), None)
        if r is None or not r.get("quiet_step_s"):
            continue
        rel = [s / r["quiet_step_s"] for s in r["step_times"]]
        line, = ax2.plot(range(1, len(rel) + 1), rel, lw=1, label=LABEL.get(m, m))
        busy = [(i + 1, x) for i, (x, b) in enumerate(zip(rel, r["step_busy"])) if b]
        ax2.plot([i for i, _ in busy], [x for _, x in busy], "o", color=line.get_color(), ms=5)
    ax2.axhline(1.0, color="k", lw=0.6)
    ax2.axhline(1.1, color="k", ls="--", lw=0.8)
    ax2.set_xlabel(f"step of the timed loop (first repetition; a checkpoint every {every} steps)")
    ax2.set_ylabel("step time / the mode's median step without a write")
    ax2.set_title("The interference: steps that start while a background write runs (dots); dashed: 1.1")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to test; files go to temporary .bench-tmp-stall-* "
                                  "directories inside it, removed after each mode (default: the repository root)")
    ap.add_argument("--size", type=parse_size, default=None, help="state bytes (default 1.5G; --quick: 64M)")
    ap.add_argument("--width", type=int, default=None, help="layer width (default 4096; --quick: 1024)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 16; --quick: 9)")
    ap.add_argument("--every", type=int, default=None, help="checkpoint every K steps (default 5; --quick: 4)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--only", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--quick", action="store_true", help="a small state, a check that it runs (under a minute)")
    ap.add_argument("--json", help="report.py's standalone JSON; the chart goes beside it (<name>.png)")
    split = MODE_CLASSES["fastckpt.async_save(background-split)"]
    ap.add_argument("--caller-copy", type=int, default=split.caller_copy,
                    help="(background-split): the knob async_caller_copy, the percent of the large tensors' bytes "
                         f"the call copies before it returns (default {split.caller_copy})")
    ap.add_argument("--default-alloc", action="store_true",
                    help="torch's default allocation (64-byte aligned) instead of THP_MEM_ALLOC_ENABLE=1 (page-aligned "
                         "tensors of 2 MiB and more, the default here): background staging then copies every tensor")
    args = ap.parse_args(argv)
    q = args.quick
    size = args.size or (64 * MiB if q else 3 * GiB // 2)
    width = args.width or (1024 if q else 4096)
    steps = args.steps or (9 if q else 16)
    every = args.every or (4 if q else 5)
    reps = args.reps or 1
    modes = [m for m in MODES if m in args.only.split(",")]
    if not 0 <= args.caller_copy <= 100:
        ap.error("--caller-copy is a percent, 0 to 100")
    split.caller_copy = args.caller_copy
    LABEL["fastckpt.async_save(background-split)"] = (  # the share in the label: set here, with the option
        f"fastckpt.async_save, background staging, {args.caller_copy}% of the bytes copied by the call, the rest by "
        "the staging thread (knob async_caller_copy)")
    if "none" not in modes:
        modes.insert(0, "none")  # the reference step
    if args.threads:
        torch.set_num_threads(args.threads)
    parent = os.path.abspath(args.dir) if args.dir else REPO_ROOT
    errors: List[str] = []
    notes: List[str] = []

    tr = Trainer(size, width, args.batch)
    training = CpuMeter.threads_now()
    nbytes = sum(t.nbytes for t in iter_tensors(tr.state(0)))
    print(f"state {human(nbytes)} ({tr.layers} x Linear({width}, {width}) + AdamW), batch {args.batch}, "
          f"{steps} steps, a checkpoint every {every}, {reps} repetition(s); torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs; engine backend {fastckpt.get_engine().backend}; dir {parent}", file=sys.stderr,
          flush=True)
    results: Dict[str, List[Dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(reps):
        for m in (modes if rep % 2 == 0 else modes[::-1]):
            try:
                r = run_mode(tr, m, steps, every, parent, training)
            except Exception as e:  # noqa: BLE001 - reported in the errors, the other modes still run
                r = {"mode": m, "error": f"{type(e).__name__}: {e}"}
            results[m].append(r)
            if "error" in r:
                print(f"  rep {rep} {m:20s} FAILED: {r['error']}", file=sys.stderr, flush=True)
            else:
                b = median(r["blocked_s"]) * 1e3 if r["blocked_s"] else 0.0
                print(f"  rep {rep} {m:20s} step {r['step_s'] * 1e3:7.1f} ms  blocked {b:7.1f} ms  "
                      f"wall {r['wall_s']:6.2f} s  (plain copy {r['copy_s'] * 1e3:.0f} ms)", file=sys.stderr,
                      flush=True)

    per = summarize(results, modes, errors)
    copies = [r["copy_s"] for rs in results.values() for r in rs if "copy_s" in r]
    copy_s = median(copies) if copies else float("nan")
    cols = ["mode", "step ms", "blocked ms (steady)", "blocked % of durable", "staged ms", "durable ms",
            "interference window", "first-save blocked ms", "goodput", "background CPU-s per checkpoint",
            "read back"]
    rows = []
    for m in modes:
        if m not in per:
            continue
        p = per[m]
        label = LABEL.get(m, m) + (f" ({MODE_CLASSES[m].durable_note})" if m in MODE_CLASSES and
                                   MODE_CLASSES[m].durable_note else "")
        inter = fmt_opt(p["interference"], ".2f") + (f" ({p['busy_n']} steps)" if p["interference"] else "")
        rows.append([label, f"{p['step_ms']:.1f}", fmt_opt(p["blocked_ms"], ".1f"), fmt_opt(p["blocked_pct"], ".1f"),
                     fmt_opt(p["staged_ms"], ".1f"), fmt_opt(p["durable_ms"], ".1f"), inter,
                     fmt_opt(p["first_ms"], ".1f"), fmt_opt(p["goodput"], ".3f"), fmt_opt(p["bg_cpu_s"], ".2f"),
                     p["check"] or "-"])
    targets = []
    a = per.get("fastckpt.async_save")
    for m in ("fastckpt.async_save",) + BACKGROUND:
        if m not in modes:
            continue
        p = per.get(m)
        pct = p["blocked_pct"] if p else None
        x = p["blocked_ms"] / p["copy_ms"] if p and p["blocked_ms"] is not None and p["copy_ms"] else None
        targets += [
            {"target": f"{m} blocked <= 5% of time-to-durable", "unit": "%",
             "measured": None if pct is None else round(pct, 2), "met": None if pct is None else pct <= 5},
            {"target": f"{m} blocked <= 1.2x a plain copy of the state into warm memory", "unit": "x",
             "measured": None if x is None else round(x, 3), "met": None if x is None else x <= 1.2}]
    for m in ("fastckpt.async_save",) + BACKGROUND + ("memory.snapshot",):
        if m in modes:
            w = per.get(m, {}).get("interference")
            targets.append({"target": f"{m} interference window <= 1.1", "unit": "x",
                            "measured": None if w is None else round(w, 3), "met": None if w is None else w <= 1.1})
    for m in BACKGROUND:
        rs = [r for r in results.get(m, []) if "through_bytes" in r]
        total = sum(sum(r["nbytes"]) for r in rs)
        if total:
            sent = sum(sum(r["through_bytes"]) for r in rs)
            fenced = sum(sum(r["fence_copied_bytes"]) for r in rs)
            notes.append(f"{m}: {100 * sent / total:.0f}% of the bytes written straight from the tensors (sent before "
                         f"the fence), {100 * fenced / total:.0f}% copied by the fence (at an optimizer step: what the "
                         f"writer had not yet handed to a write)")
    notes.append("torch's CPU allocator: " + ("page-aligned tensors of 2 MiB and more (THP_MEM_ALLOC_ENABLE=1, set by "
                 "the benchmark; --default-alloc: torch's default)" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
                 else f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '(unset)')}"))
    if copies:
        notes.append(f"plain copy of the state into warm memory (copy_ of every tensor into preallocated, touched "
                     f"buffers), measured before each mode: median {copy_s * 1e3:.1f} ms ({nbytes / copy_s / 1e9:.1f} "
                     f"GB/s), {min(copies) * 1e3:.0f}-{max(copies) * 1e3:.0f} ms; before fastckpt.async_save "
                     f"{fmt_opt(a['copy_ms'] if a else None, '.1f')} ms (its target's reference)")
    loads = {m: [r["load_avg"] for r in rs if "load_avg" in r] for m, rs in results.items()}
    if any(loads.values()):
        notes.append(f"{os.cpu_count()} CPUs; load average (1 min) at the end of each mode's loop: " + ", ".join(
            f"{m} {'/'.join(f'{x:.1f}' for x in v)}" for m, v in loads.items() if v) +
            " (above the loop's own threads: other processes shared the CPUs; compare rows of one run only)")
    if a and a.get("snapshot_ms") is not None:
        notes.append(f"fastckpt.async_save's own figures (SaveResult, medians): snapshot_seconds "
                     f"{a['snapshot_ms']:.1f} ms, write_seconds {a['write_ms']:.1f} ms")
    if per.get("memory.snapshot", {}).get("persist_s") is not None:
        notes.append(f"memory tier: durable = committed in host memory (CRC-32 + record; survives the process, "
                     f"not the node); writing the newest snapshot to disk from memory (mgr.save of its step, "
                     f"synchronous) took {per['memory.snapshot']['persist_s'] * 1e3:.0f} ms")
    if "torch_checkpointing" in modes:
        notes.append("torch_checkpointing: LocalFileSystemStorageConfig(use_direct_io=False) (its default O_DIRECT "
                     "write fails with EINVAL on ext4: unaligned tails); its write does no fsync, so its 'durable' "
                     "is written to the page cache, not on disk; blocked includes the mgr.lock() wait before "
                     "optimizer.step() while its staging thread copies the state; first save includes starting "
                     "its writer subprocess")
    if "dcp.async_save" in modes:
        notes.append("dcp.async_save: FileSystemWriter stages (copies the state into new CPU memory) inside the "
                     "call, so staged = the call's return; sync_files=True fsyncs each file")
    notes.append("read back: after each mode's timed loop, one more checkpoint taken as the loop takes them (the "
                 "next optimizer step right after the call), read with the method's own loader and compared with "
                 "a copy of the state at the call ('bitwise': every tensor torch.equal, dtype and shape, every other "
                 "value equal; a difference is listed in the errors)")
    notes.append(f"blocked: the call + later waits because of it (lock waits, the wait before the next checkpoint "
                 f"or at the end); interference window: median step starting during a background write / median "
                 f"of the mode's other steps ('-': no step overlapped a write); goodput: the steps' time (waits "
                 f"excluded) / the loop's wall time; background CPU-s: CPU of the process's non-training threads "
                 f"and children over the timed loop, per checkpoint; {steps} steps, a checkpoint every {every}, "
                 f"{reps} repetition(s), first save = the first call of a fresh saver/manager (allocations)")
    res = {"title": f"The stall a training loop feels: a checkpoint every {every} steps of a {human(nbytes)} "
                    f"state (model + AdamW)",
           "columns": cols, "rows": rows, "targets": targets, "notes": notes, "errors": errors,
           "state_bytes": nbytes, "copy_s": copy_s, "raw": results}
    if args.json:
        png = os.path.splitext(args.json)[0] + ".png"
        try:
            chart(per, results, every, png)
            res["images"] = [os.path.basename(png)]
        except Exception as e:  # noqa: BLE001 - the figures stand without the chart
            errors.append(f"chart not written: {type(e).__name__}: {e}")
    return emit_standalone(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
