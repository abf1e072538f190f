#!/usr/bin/env python3
"""Benchmark fastckpt's C++ engine against the disk's own limit, measured by fio in the same run.

What is measured
----------------
* Durable write of ``--size`` bytes from memory: ``Writer(engine, path, size)``, the data in
  256 MiB ``write()`` calls, then ``commit()`` (fdatasync + rename + directory fsync). The time
  runs from the Writer's construction to the end of ``commit()``.
* O_DIRECT read of that file back into one reused, page-aligned destination with
  ``read_ranges`` (one range per 256 MiB chunk), after dropping the page cache.
* fio on the same directory, interleaved with the engine runs: ``--rw=write --direct=1
  --ioengine=io_uring --end_fsync=1`` (fio's runtime includes the final fsync) and
  ``--rw=read --direct=1 --ioengine=io_uring``, over a few block sizes and depths, with
  ``--fixedbufs=1`` (registered buffers, as the engine's staging pool; plus one point without).
  The best fio point (highest median) is "the disk's limit" that the engine is compared with.

The disk is noisy (+-30% run to run), so every repetition runs fio and the engine
configurations interleaved (fio, engine..., fio, engine..., reversed on odd repetitions), and
medians are reported. The ``paired`` column divides each engine figure by the best fio figure
of the same repetition before taking the median, which cancels slow drifts of the disk.

CPU: ``getrusage(RUSAGE_SELF)`` user+sys around each engine operation. It includes every thread
of this process (the thread backend's workers and io_uring's io-wq workers, which are threads
of the process on Linux >= 5.12), but not work done in interrupt context or by kernel threads
(block-layer completions, the ext4 journal thread). The ``machine`` column is the whole
machine's busy time (/proc/stat user+nice+system+irq+softirq) over the same window, which
includes those too (and anything else running). fio's figure is its own usr+sys from its JSON
report (``jobs[0].usr_cpu/sys_cpu`` percent x ``job_runtime``).

``req KiB`` is the mean size of the requests the device completed during an operation
(/sys/class/block/DEV/stat). On a virtio disk (max_segments 254) an O_DIRECT request is cut at
254 memory segments, so it grows with the physical contiguity of the user buffer: a large
freshly-touched tensor gives larger requests than fio's small, reused buffers, which can let
the engine's reads beat fio's on the same file.

Examples::

    .venv/bin/python benchmarks/bench_engine.py --quick                 # make bench
    .venv/bin/python benchmarks/bench_engine.py --size 1G --reps 2 --full --json /tmp/full.json
"""

import argparse
import gc
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

try:
    from fastckpt import _C  # noqa: E402
except ImportError:  # a checkout whose extension was built in place but not installed
    sys.path.insert(0, REPO_ROOT)
    from fastckpt import _C  # noqa: E402
if REPO_ROOT not in sys.path:  # the checkout's `benchmarks` package (harness.py, workload.py)
    sys.path.insert(1, REPO_ROOT)

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 256 * MiB  # source data is written in chunks of this size, one write() each
TARGET_RATIO = 0.95
TARGET_CPU = 0.2  # CPU-seconds (user+sys) per GB (1e9 bytes)


# ----------------------------------------------------------------------------- helpers
# One copy of the measuring pieces (benchmarks/harness.py), shared with bench_save_load.py, bench_dcp.py and
# `fastckpt bench` (they are re-exported here: the other scripts use them as bench_engine.X).
from benchmarks.harness import (  # noqa: E402,F401
    block_queue_info, cpu_children, cpu_machine, cpu_self, dev_delta, dev_stat, drop_caches, fmt_size,
    free_port, machine_info, median, mount_of, parse_size, run_fio)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- configurations

@dataclass(frozen=True)
class Item:
    """One thing measured per repetition: a write (and optionally a read back) by fio or the engine."""

    tool: str            # "fio" or "engine"
    backend: str         # engine: uring | threads; fio: io_uring
    bs: int              # engine buffer_size / fio --bs
    qd: int              # engine queue_depth / fio --iodepth
    flush: int = 0       # engine flush_interval (bytes)
    read: bool = True    # also measure the read back (flush_interval only affects writes)
    fixedbufs: bool = True  # fio: --fixedbufs=1 (registered buffers, as the engine's staging pool)

    @property
    def label(self) -> str:
        if self.tool == "fio":
            return f"fio bs={fmt_size(self.bs)} qd={self.qd}" + ("" if self.fixedbufs else " no-fixedbufs")
        fl = f" flush={fmt_size(self.flush)}" if self.flush else ""
        return f"engine {self.backend} bs={fmt_size(self.bs)} qd={self.qd}{fl}"


def sweep(mode: str, have_fio: bool) -> Tuple[List[Item], List[Item]]:
    if mode == "full":
        engine = [Item("engine", be, bs * MiB, qd, fl, read=(fl == 0))
                  for be in ("uring", "threads") for qd in (2, 4, 8, 16) for bs in (1, 4, 8, 16)
                  for fl in (0, 256 * MiB)]
        fio = [Item("fio", "io_uring", bs * MiB, qd) for bs in (1, 4, 8, 16) for qd in (4, 16, 32)]
        fio.append(Item("fio", "io_uring", 8 * MiB, 8, fixedbufs=False))
    elif mode == "quick":
        engine = [
            Item("engine", "uring", 8 * MiB, 8),
            Item("engine", "threads", 8 * MiB, 8),
            Item("engine", "uring", 16 * MiB, 8),
            Item("engine", "uring", 8 * MiB, 8, 256 * MiB, read=False),
        ]
        fio = [Item("fio", "io_uring", bs * MiB, qd) for bs, qd in ((1, 16), (8, 8), (16, 8))]
        fio.append(Item("fio", "io_uring", 8 * MiB, 8, fixedbufs=False))
    else:  # default
        engine = [Item("engine", be, bs * MiB, qd) for be in ("uring", "threads")
                  for bs, qd in ((8, 8), (4, 16), (16, 4))]
        engine.append(Item("engine", "uring", 8 * MiB, 8, 256 * MiB, read=False))
        fio = [Item("fio", "io_uring", bs * MiB, qd) for bs, qd in ((1, 16), (4, 8), (8, 8), (16, 8), (16, 32))]
        fio.append(Item("fio", "io_uring", 8 * MiB, 8, fixedbufs=False))
    return engine, (fio if have_fio else [])


def interleave(engine: List[Item], fio: List[Item]) -> List[Item]:
    """fio points spread evenly among the engine configurations: F E E F E E ..."""
    if not fio:
        return list(engine)
    out: List[Item] = []
    k = 0
    for i, f in enumerate(fio):
        cut = round(i * len(engine) / len(fio))
        out.extend(engine[k:cut])
        k = cut
        out.append(f)
    out.extend(engine[k:])
    return out


# ----------------------------------------------------------------------------- the benchmark

@dataclass
class Record:
    tool: str
    label: str
    op: str              # write | read
    rep: int
    backend: str
    bs: int
    qd: int
    flush: int
    bytes: int
    seconds: float
    gbps: float
    cpu_s: float          # process CPU (engine: RUSAGE_SELF delta; fio: its usr+sys)
    machine_cpu_s: float  # whole machine busy CPU over the window
    extra: Dict[str, object] = field(default_factory=dict)


class Bench:
    def __init__(self, args, workdir: str):
        self.args = args
        self.dir = workdir
        self.size = args.size
        self.records: List[Record] = []
        self.engines: Dict[Item, "_C.Engine"] = {}
        self.verified: Dict[Item, bool] = {}
        self.drop_error: Optional[str] = None
        self.drop_ok = 0
        self.fio = None if args.no_fio else shutil.which("fio")
        self.fixedbufs_ok = True
        self.dev: Optional[str] = None  # block device of --dir, for request-size counters
        self.notes: List[str] = []

    # -- data

    def prepare_data(self) -> None:
        n = self.size
        log(f"generating {n / 1e9:.2f} GB of random source data and a {n / 1e9:.2f} GB read buffer (untimed) ...")
        t = time.perf_counter()
        g = torch.Generator().manual_seed(20240611)
        words = (n + 7) // 8
        # Random 64-bit words (not zeros: no compression or dedup can help), viewed as bytes.
        self.src = torch.empty(words, dtype=torch.int64).random_(-2**63, None, generator=g).view(torch.uint8)[:n]
        # The read destination: allocated and touched once, reused by every read, page-aligned so
        # that O_DIRECT can read straight into it.
        raw = torch.empty(n + 4096, dtype=torch.uint8)
        pad = (-raw.data_ptr()) % 4096
        self.dst = raw[pad:pad + n]
        self.dst.fill_(0)
        self.src_chunks = [self.src[o:o + CHUNK] for o in range(0, n, CHUNK)]
        self.dst_ranges = [(self.dst[o:o + CHUNK], o) for o in range(0, n, CHUNK)]
        log(f"  done in {time.perf_counter() - t:.1f} s")

    # -- engine

    def engine_for(self, item: Item) -> "_C.Engine":
        eng = self.engines.get(item)
        if eng is None:
            cfg = _C.EngineConfig.from_env()
            cfg.buffer_size = item.bs
            cfg.queue_depth = item.qd
            cfg.buffer_count = max(8, item.qd)  # a writer holds up to queue_depth buffers
            cfg.io_threads = item.qd             # the thread backend's concurrency is its thread count
            cfg.backend = item.backend
            cfg.direct = True
            cfg.flush_interval = item.flush
            cfg.preallocate = True
            eng = _C.Engine(cfg)
            # Warm-up outside timing: lease the backend (io_uring ring setup, buffer registration,
            # thread start) as a long-lived engine would have done long before a checkpoint.
            p = os.path.join(self.dir, "warmup.bin")
            w = _C.Writer(eng, p, 2 * item.bs)
            w.write(self.src[: 2 * item.bs])
            w.commit()
            _C.read_ranges(eng, p, [(self.dst[: 2 * item.bs], 0)])
            os.unlink(p)
            self.engines[item] = eng
        return eng

    def engine_write(self, item: Item, path: str, rep: int) -> Record:
        eng = self.engine_for(item)
        gc.collect()
        gc.disable()
        try:
            d0, m0, c0, t0 = dev_stat(self.dev), cpu_machine(), cpu_self(), time.perf_counter()
            w = _C.Writer(eng, path, self.size)
            try:
                for chunk in self.src_chunks:
                    w.write(chunk)
                st = w.commit()
            except BaseException:
                w.abort()
                raise
            t1, c1, m1, d1 = time.perf_counter(), cpu_self(), cpu_machine(), dev_stat(self.dev)
        finally:
            gc.enable()
        sec = t1 - t0
        if not st["direct"]:
            self.notes.append(f"{item.label}: write was NOT O_DIRECT ({st['fallback']})")
        want = "io_uring" if item.backend == "uring" else item.backend
        if st["backend"] != want:
            self.notes.append(f"{item.label}: write used backend {st['backend']}, not {want}")
        return Record("engine", item.label, "write", rep, item.backend, item.bs, item.qd, item.flush, self.size,
                      sec, self.size / sec / 1e9, c1 - c0, m1 - m0,
                      extra=dict(stats=dict(st), dev=dev_delta(d0, d1, "write")))

    def engine_read(self, item: Item, path: str, rep: int, poison: bool) -> Record:
        eng = self.engine_for(item)
        if poison:
            self.dst.fill_(0xA5)  # so that a read that does nothing cannot pass verification
        self.drop()
        gc.collect()
        gc.disable()
        try:
            d0, m0, c0, t0 = dev_stat(self.dev), cpu_machine(), cpu_self(), time.perf_counter()
            st = _C.read_ranges(eng, path, self.dst_ranges)
            t1, c1, m1, d1 = time.perf_counter(), cpu_self(), cpu_machine(), dev_stat(self.dev)
        finally:
            gc.enable()
        sec = t1 - t0
        if not st["direct"]:
            self.notes.append(f"{item.label}: read was NOT O_DIRECT")
        elif st["staged_bytes"]:
            self.notes.append(f"{item.label}: read {st['staged_bytes']} of {st['bytes_read']} bytes through "
                              "staging buffers")
        return Record("engine", item.label, "read", rep, item.backend, item.bs, item.qd, item.flush, self.size,
                      sec, self.size / sec / 1e9, c1 - c0, m1 - m0,
                      extra=dict(stats=dict(st), dev=dev_delta(d0, d1, "read")))

    def verify(self, item: Item, path: str) -> bool:
        """Compare the data read back (already in dst) with the source; untimed."""
        ok = bool(torch.equal(self.dst, self.src))
        if not ok:
            diff = (self.dst != self.src).nonzero()
            first = int(diff[0]) if len(diff) else -1
            self.notes.append(f"{item.label}: DATA MISMATCH after read back: {len(diff)} bytes differ, first at "
                              f"offset {first}")
        if ok and os.path.getsize(path) != self.size:
            self.notes.append(f"{item.label}: file size {os.path.getsize(path)} != {self.size}")
            ok = False
        self.verified[item] = self.verified.get(item, True) and ok
        return ok

    # -- fio

    def fio_run(self, item: Item, path: str, op: str, rep: int) -> Record:
        if op == "read":
            self.drop()
        r = run_fio(self.fio, path, self.size, op, item.bs, item.qd, fixedbufs=item.fixedbufs and self.fixedbufs_ok,
                    dev=self.dev)
        if r["extra"].get("fixedbufs_error"):
            # Registering buffers needs RLIMIT_MEMLOCK (or CAP_IPC_LOCK): go on without.
            self.fixedbufs_ok = False
            self.notes.append(f"fio --fixedbufs=1 failed, fio runs without it: {r['extra']['fixedbufs_error']}")
        if r["bytes"] != self.size:
            self.notes.append(f"{item.label} {op}: fio moved {r['bytes']} bytes, not {self.size}")
        return Record("fio", item.label, op, rep, item.backend, item.bs, item.qd, 0, r["bytes"], r["seconds"],
                      r["gbps"], r["cpu_s"], r["machine_cpu_s"], extra=r["extra"])

    # -- driver

    def drop(self) -> None:
        err = drop_caches()
        if err is None:
            self.drop_ok += 1
        elif self.drop_error is None:
            self.drop_error = err
            log(f"NOTE: {err}; reads are O_DIRECT (engine and fio) so the data bypasses the page cache anyway")

    def cleanup_files(self) -> None:
        for p in glob.glob(os.path.join(self.dir, "*.bin")) + glob.glob(os.path.join(self.dir, ".*.fastckpt-tmp.*")):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def run_item(self, item: Item, rep: int) -> None:
        path = os.path.join(self.dir, f"{item.tool}.bin")
        self.cleanup_files()  # at most one data file (plus nothing) on disk at any time
        try:
            if item.tool == "fio":
                recs = [self.fio_run(item, path, "write", rep)]
                if item.read:
                    recs.append(self.fio_run(item, path, "read", rep))
            else:
                recs = [self.engine_write(item, path, rep)]
                if item.read:
                    recs.append(self.engine_read(item, path, rep, poison=True))
                    recs[-1].extra["verified"] = self.verify(item, path)
                elif item not in self.verified:  # write-only configuration: verify once, untimed
                    self.dst.fill_(0xA5)
                    _C.read_ranges(self.engine_for(item), path, self.dst_ranges)
                    recs[-1].extra["verified"] = self.verify(item, path)
        finally:
            self.cleanup_files()
        for r in recs:
            self.records.append(r)
            log(f"  rep {rep + 1}  {r.label:<40} {r.op:<5} {r.gbps:6.2f} GB/s  {r.seconds:6.2f} s  "
                f"cpu {r.cpu_s / (r.bytes / 1e9):.3f} s/GB")

    def run(self, order: List[Item]) -> None:
        for rep in range(self.args.reps):
            seq = order if rep % 2 == 0 else list(reversed(order))
            log(f"repetition {rep + 1}/{self.args.reps} ({len(seq)} items)")
            for item in seq:
                self.run_item(item, rep)


# ----------------------------------------------------------------------------- context and report

def context(bench: Bench, workdir: str) -> Dict[str, object]:
    ctx: Dict[str, object] = machine_info(workdir)  # CPUs, memory, kernel, filesystem, device, versions
    ctx["dir"] = workdir
    ctx["git"] = ctx["fastckpt"]
    m = ctx["mount"]
    if m["source"].startswith("/dev/"):
        bench.dev = os.path.basename(os.path.realpath(m["source"]))
        if dev_stat(bench.dev) is None:
            bench.dev = None
    ctx["uring_compiled"] = _C.uring_compiled()
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            ctx["io_uring_disabled_sysctl"] = f.read().strip()
    except OSError:
        ctx["io_uring_disabled_sysctl"] = "n/a"
    cfg = _C.EngineConfig.from_env()
    cfg.buffer_size, cfg.buffer_count, cfg.backend = 4096, 1, "auto"
    probe = _C.Engine(cfg)
    ctx["auto_backend"] = probe.backend
    ctx["uring_refusal"] = probe.uring_refusal
    p = os.path.join(workdir, "probe.bin")
    with open(p, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        ctx["dio_alignment"] = dict(_C.dio_alignment(p))
    except OSError as e:
        ctx["dio_alignment"] = str(e)
    os.unlink(p)
    if bench.fio:
        ctx["fio"] = subprocess.run([bench.fio, "--version"], capture_output=True, text=True).stdout.strip()
    elif bench.args.no_fio:
        ctx["fio"] = "not run (--no-fio)"
    else:
        ctx["fio"] = "NOT INSTALLED (Debian package 'fio'): fio rows skipped, no engine/fio ratio"
    return ctx


@dataclass
class Row:
    item_label: str
    tool: str
    op: str
    backend: str
    bs: int
    qd: int
    flush: int
    n: int
    gbps: float
    lo: float
    hi: float
    ratio: float
    paired: float
    cpu_per_gb: float
    machine_per_gb: float
    req_kib: float
    flushes: float   # device cache flushes in the window (writes)
    commit_ms: float  # engine: commit()'s fdatasync + rename + directory fsync
    note: str


def summarize(bench: Bench) -> Tuple[Dict[str, List[Row]], Dict[str, object]]:
    rows: Dict[str, List[Row]] = {"write": [], "read": []}
    summary: Dict[str, object] = {}
    for op in ("write", "read"):
        recs = [r for r in bench.records if r.op == op]
        # fio reference of each repetition (best point) and of the run (best median).
        fio_by_rep: Dict[int, float] = {}
        for r in recs:
            if r.tool == "fio":
                fio_by_rep[r.rep] = max(fio_by_rep.get(r.rep, 0.0), r.gbps)
        labels: List[str] = []
        for r in recs:
            if r.label not in labels:
                labels.append(r.label)
        labels = [l for l in labels if l.startswith("fio")] + [l for l in labels if not l.startswith("fio")]
        fio_meds = {l: median([r.gbps for r in recs if r.label == l]) for l in labels if l.startswith("fio")}
        fio_ref = max(fio_meds.values()) if fio_meds else float("nan")
        summary[f"fio_{op}_gbps"] = fio_ref
        summary[f"fio_{op}_point"] = max(fio_meds, key=fio_meds.get) if fio_meds else None
        for l in labels:
            rs = [r for r in recs if r.label == l]
            g = [r.gbps for r in rs]
            med = median(g)
            paired = median([r.gbps / fio_by_rep[r.rep] for r in rs if r.rep in fio_by_rep])
            v = [r.extra["verified"] for r in rs if "verified" in r.extra]
            note = ("verified" if all(v) else "MISMATCH") if v else ""
            backend = rs[0].backend
            if rs[0].tool == "fio":
                backend += "+fixedbufs" if rs[0].extra.get("fixedbufs") else ""
            rows[op].append(Row(l, rs[0].tool, op, backend, rs[0].bs, rs[0].qd, rs[0].flush, len(rs), med,
                                min(g), max(g), med / fio_ref if fio_ref == fio_ref else float("nan"), paired,
                                median([r.cpu_s / (r.bytes / 1e9) for r in rs]),
                                median([r.machine_cpu_s / (r.bytes / 1e9) for r in rs]),
                                median([r.extra.get("dev", {}).get("kib_per_request", float("nan")) for r in rs]),
                                median([r.extra.get("dev", {}).get("flushes", float("nan")) for r in rs]),
                                median([r.extra.get("stats", {}).get("flush_seconds", float("nan")) * 1e3
                                        for r in rs]),
                                note))
        eng = [row for row in rows[op] if row.tool == "engine"]
        if eng:
            best = max(eng, key=lambda row: row.gbps)
            summary[f"engine_{op}_best"] = best.__dict__
        default = [row for row in eng if row.backend == "uring" and row.bs == 8 * MiB and row.qd == 8 and not row.flush]
        if default:
            summary[f"engine_{op}_default"] = default[0].__dict__
    return rows, summary


def print_table(rows: List[Row], op: str, size: int) -> None:
    hdr = ["tool", "backend", "block", "depth", "flush", "n", f"{op} GB/s (median)", "min", "max", "x fio", "paired",
           "CPU-s/GB", "machine CPU-s/GB", "req KiB"] + (["flushes", "commit ms"] if op == "write" else []) + ["check"]
    lines = []
    for r in rows:
        lines.append([r.tool, r.backend, fmt_size(r.bs), str(r.qd), fmt_size(r.flush) if r.flush else "0",
                      str(r.n), f"{r.gbps:.3f}", f"{r.lo:.3f}", f"{r.hi:.3f}",
                      f"{r.ratio:.2f}" if r.ratio == r.ratio else "-",
                      f"{r.paired:.2f}" if r.paired == r.paired else "-",
                      f"{r.cpu_per_gb:.3f}", f"{r.machine_per_gb:.3f}",
                      f"{r.req_kib:.0f}" if r.req_kib == r.req_kib else "-"]
                     + ([f"{r.flushes:g}" if r.flushes == r.flushes else "-",
                         f"{r.commit_ms:.1f}" if r.commit_ms == r.commit_ms else "-"] if op == "write" else [])
                     + [r.note])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(hdr)]
    print(f"\n### {op}: {size / 1e9:.2f} GB ({fmt_size(size)}) per run\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(hdr, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for l in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(l, widths)) + " |")


def describe(d: Dict[str, object]) -> str:
    fl = f" flush={fmt_size(d['flush'])}" if d["flush"] else " flush=0"
    return f"{d['backend']} bs={fmt_size(d['bs'])} qd={d['qd']}{fl}"


def report(bench: Bench, ctx: Dict[str, object]) -> Dict[str, object]:
    a = bench.args
    print("## fastckpt engine benchmark\n")
    blk = ctx.get("block") or {}
    print(f"- kernel {ctx['kernel']}, {ctx['nproc']} CPUs ({ctx['cpus_usable']} usable), {ctx.get('cpu', '?')}, "
          f"{ctx.get('mem_total_gb', '?')} GB RAM; torch {ctx['torch']}, fastckpt {ctx['git']}")
    print(f"- dir {ctx['dir']}: {ctx['fstype']} on {ctx['mount']['source']} (mounted at {ctx['mount']['mount_point']})"
          + (f"; device {blk.get('device')}: scheduler {blk.get('scheduler')}, rotational {blk.get('rotational')}, "
             f"max_sectors_kb {blk.get('max_sectors_kb')}, nr_requests {blk.get('nr_requests')}, "
             f"write_cache {blk.get('write_cache')}" if blk else ""))
    print(f"- direct-I/O alignment: {ctx['dio_alignment']}")
    print(f"- io_uring: compiled {ctx['uring_compiled']}, kernel.io_uring_disabled={ctx['io_uring_disabled_sysctl']}, "
          f"auto backend -> {ctx['auto_backend']}"
          + (f" (refused: {ctx['uring_refusal']})" if ctx["uring_refusal"] else ""))
    print(f"- fio: {ctx['fio']}")
    if bench.drop_error:
        print(f"- page cache: NOT dropped ({bench.drop_error}); all reads are O_DIRECT, which bypasses it")
    else:
        print(f"- page cache: dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before each of {bench.drop_ok} reads")
    print(f"- size {a.size} bytes ({a.size / 1e9:.2f} GB) written as {len(bench.src_chunks)} write() calls of up to "
          f"{fmt_size(CHUNK)}; {a.reps} repetitions, sweep '{a.mode}'; fio and engine interleaved, order reversed on "
          f"odd repetitions; thread backend runs queue_depth threads; buffer_count = max(8, queue_depth)")
    print("- columns: x fio = engine median / best fio median (same op, same run); paired = median over "
          "repetitions of engine / best fio of that repetition")
    print("- CPU-s/GB = user+sys of this process (fio: its own usr+sys); machine = busy time of all CPUs in the "
          "window (includes interrupts and kernel threads; for fio also its start-up)")
    print("- req KiB = mean size of the requests the device completed (/sys/class/block/DEV/stat); an O_DIRECT "
          "request is cut at max_segments pages unless the memory is physically contiguous, so it depends on the "
          "buffer too; flushes = device cache flushes; commit ms = the engine's commit() (final fdatasync + rename "
          "+ directory fsync)")
    rows, summary = summarize(bench)
    for op in ("write", "read"):
        if rows[op]:
            print_table(rows[op], op, a.size)
    print("\n## summary\n")
    for op in ("write", "read"):
        best = summary.get(f"engine_{op}_best")
        fio_ref = summary.get(f"fio_{op}_gbps")
        if not best:
            continue
        if fio_ref == fio_ref and fio_ref is not None:
            ok = "MET" if best["ratio"] >= TARGET_RATIO else "NOT MET"
            print(f"{op}: engine best {best['gbps']:.3f} GB/s ({describe(best)}) = {best['ratio']:.2f} x fio "
                  f"{fio_ref:.3f} GB/s ({summary[f'fio_{op}_point']}); paired {best['paired']:.2f} "
                  f"(target >= {TARGET_RATIO}): {ok}")
        else:
            print(f"{op}: engine best {best['gbps']:.3f} GB/s ({describe(best)}); no fio figure (fio not run)")
        d = summary.get(f"engine_{op}_default")
        if d and d["item_label"] != best["item_label"]:
            vs = f" = {d['ratio']:.2f} x fio, paired {d['paired']:.2f}" if d["ratio"] == d["ratio"] else ""
            print(f"{op}: engine default config {d['gbps']:.3f} GB/s ({describe(d)}){vs}")
    for op in ("write", "read"):
        best = summary.get(f"engine_{op}_best")
        if best:
            ok = "MET" if best["cpu_per_gb"] <= TARGET_CPU else "NOT MET"
            print(f"CPU ({op}, {describe(best)}): {best['cpu_per_gb']:.3f} CPU-s/GB of this process, "
                  f"{best['machine_per_gb']:.3f} machine-wide (target <= {TARGET_CPU}): {ok}")
    bad = [r for r in bench.records if r.extra.get("verified") is False]
    checked = sorted({r.label for r in bench.records if "verified" in r.extra})
    print(f"data check: {len(checked)} engine configurations read back and compared with the source: "
          + ("all equal" if not bad else f"{len(bad)} MISMATCHES"))
    if bench.fio:
        print("note: 'best' picks the maximum of several noisy medians on both sides (engine configs vs fio points); "
              "the paired column and the default-config line are less exposed to that selection.")
    for n in dict.fromkeys(bench.notes):
        print(f"note: {n}")
    return summary


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to test; the files go to a temporary .bench-tmp-* "
                                  "directory inside it, removed at the end (default: the repository root)")
    ap.add_argument("--size", type=parse_size, default=2 * GiB, help="bytes per write/read (default 2G; 512M, 1G, ...)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported (default 3)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick",
                   help="small sweep (uring and threads at 8M/qd8, plus 16M and flush_interval=256M)")
    g.add_argument("--full", dest="mode", action="store_const", const="full",
                   help="backends x queue depth {2,4,8,16} x block {1,4,8,16}M x flush_interval {0,256M}")
    ap.set_defaults(mode="default")
    ap.add_argument("--json", metavar="PATH", help="write all raw results, the context and the summary here")
    ap.add_argument("--no-fio", action="store_true", help="do not run fio")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be at least 1")

    # Always a private directory of our own (inside --dir, or in the repository, i.e. on the
    # project's disk, not tmpfs), so that the clean-up never touches anyone else's files.
    parent = os.path.abspath(args.dir) if args.dir else REPO_ROOT
    os.makedirs(parent, exist_ok=True)
    created = workdir = tempfile.mkdtemp(prefix=".bench-tmp-", dir=parent)
    bench = Bench(args, workdir)
    try:
        if not args.no_fio and not bench.fio:
            log("NOTE: fio is not installed (Debian package 'fio'); the fio rows are skipped and no ratio can be "
                "given. Install it or pass --no-fio to silence this.")
        if ":" in workdir and bench.fio:
            raise SystemExit(f"--dir must not contain ':' (fio separates file names with it): {workdir}")
        ctx = context(bench, workdir)
        if ctx["fstype"] in ("tmpfs", "ramfs"):
            log(f"WARNING: {workdir} is on {ctx['fstype']}: this measures memory, not the disk")
        free = shutil.disk_usage(workdir).free
        if free < 2 * args.size + GiB:
            raise SystemExit(f"not enough free space in {workdir}: {free / 1e9:.1f} GB free, need about "
                             f"{(2 * args.size + GiB) / 1e9:.1f} GB")
        engine, fio = sweep(args.mode, bool(bench.fio))
        need = 2 * args.size + sum(max(8, i.qd) * i.bs for i in engine)
        if ctx.get("mem_available_gb") and need > 0.8 * ctx["mem_available_gb"] * 1e9:
            raise SystemExit(f"not enough memory: about {need / 1e9:.1f} GB needed (source, read buffer and "
                             f"staging pools), {ctx['mem_available_gb']} GB available; use a smaller --size")
        bench.prepare_data()
        order = interleave(engine, fio)
        log(f"sweep '{args.mode}': {len(engine)} engine configurations, {len(fio)} fio points, {args.reps} reps, "
            f"in {workdir} ({ctx['fstype']})")
        t = time.perf_counter()
        bench.run(order)
        log(f"measured in {time.perf_counter() - t:.0f} s")

        def dump(summary):
            with open(args.json, "w") as f:
                json.dump({"args": dict(vars(args)), "context": ctx, "summary": summary,
                           "notes": list(dict.fromkeys(bench.notes)), "drop_caches_error": bench.drop_error,
                           "records": [r.__dict__ for r in bench.records]}, f, indent=1, default=str)

        if args.json:
            dump(None)  # the raw results are safe even if the report fails
        summary = report(bench, ctx)
        if args.json:
            dump(summary)
            log(f"raw results written to {args.json}")
    finally:
        bench.cleanup_files()
        bench.engines.clear()
        shutil.rmtree(created, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
