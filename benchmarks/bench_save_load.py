#!/usr/bin/env python3
"""Benchmark fastckpt.save / fastckpt.load against torch, DCP, safetensors and DeepSpeed, beside the disk's limit (fio).

What is measured
----------------
A synthetic model + AdamW state dict, built once with a fixed seed and touched before any timing::

    {"model": {name: tensor}, "optimizer": {"state": {i: {"step", "exp_avg", "exp_avg_sq"}},
     "param_groups": [{..., "params": [0..n-1]}]}, "step": int}

A few 64-128 MiB tensors (at the default 2 GiB; they scale with --size) and about a thousand
small ones (24 "layers" of 12 parameters, each with its two AdamW moments and a 0-dim step
tensor), float32 and bfloat16. GB/s is always the state dict's tensor payload (sum of
``nbytes``, 1e9 bytes per GB) over the wall time, whatever the file format adds.

Saves (every one durable before the clock stops):

* ``fastckpt.save(sd, path)``: its own protocol (temporary name, O_DIRECT, fdatasync, rename,
  directory fsync).
* ``fastckpt.async_save(sd, path).result()``: the same file, written by the background thread;
  GB/s until it is durable, and how long the call itself blocked its caller (pickling + the host
  snapshot; "caller blocked"). Its snapshot arena is made once, untimed, as a trainer's first
  checkpoint would have (every later one reuses it); it shows in "pool MB". No load row (the file
  is fastckpt.save's); read back once with fastckpt.load and compared.
* ``torch.save(sd, path)``, then the file opened again (O_RDONLY) and ``fsync``-ed, then
  ``fsync`` of the directory.
* DCP: ``torch.distributed.checkpoint.save(sd, storage_writer=FileSystemWriter(dir,
  thread_count=k, sync_files=True))`` in this single process (no process group), then
  ``fsync`` of the checkpoint directory and of its parent; k = 1, 2, 4 (--dcp-threads).
  And fastckpt's ``FastWriter(dir)`` (its own fdatasync + rename + directory fsync), then
  ``fsync`` of the parent.
* safetensors: the nested state dict flattened to ``{dotted.name: tensor}`` (the non-tensor
  parts and the key types go, as JSON, into the header's metadata), ``save_file``, then
  ``fsync`` of the file (reopened) and of the directory.
* DeepSpeed FastPersist (``--deepspeed``): ``torch.save(sd, FastFileWriter(path, ...))`` +
  ``close()`` (DeepSpeed's own ``fsync``), then ``fsync`` of the directory; the libaio handle
  and its 64 MiB double buffer are DeepSpeed's checkpoint defaults (block 1 MiB, queue depth 8,
  ``intra_op_parallelism`` from --ds-parallelism), made once per process outside the timing.

The peers users would pick (``benchmarks/peers.py``, whose docstring says how each is configured and
made durable): torch-checkpointing's ``CheckpointManager`` (sync and async saves + fsync of every file
and directory, its load), ``dcp.async_save`` (thread and process executors, a reused DefaultStager),
and the fastckpt.safetensors, fastsafetensors and runai-model-streamer loaders of the safetensors
row's file (load variants of that row). Their helper processes' CPU is in CPU-s/GB.

Loads, each in its own fresh child from a cold page cache (``os.sync()`` and ``echo 3 >
/proc/sys/vm/drop_caches`` right before the clock starts), several of them reading the same
saved file (a method's ``load_variants``, their order reversed on odd repetitions):
``fastckpt.load(path, map_location="cpu", weights_only=True, verify=True)`` (paired with the
save; verify is on by default) and ``verify=False``; ``torch.load(path, map_location="cpu", weights_only=True)`` and the
same with ``mmap=True``; ``dcp.load`` (stock ``FileSystemReader`` of the t=2 checkpoint;
fastckpt's ``FastReader(verify=True)`` of the FastWriter one) into a pre-built state dict of the
same shapes (``zeros_like``, allocated and touched outside the timing: an advantage to DCP),
and safetensors ``load_file`` plus rebuilding the nesting from the header's metadata. The
targets are judged on these rows (``size_targets``: the report states them next to the
figures). DeepSpeed has no reader of its own (its checkpoint engine loads with torch.load), so
it has no load row. Every load is followed, inside the timing, by reading one byte of every
4 KiB page of every tensor, so that a lazily mapped result (safetensors maps the file) is
really read from disk; for the eager loaders this costs a few milliseconds. Every loaded state
dict is compared with the original outside the timing (``torch.equal`` on every tensor, dtype,
shape, keys and their types, the non-tensor values); saves without a load row (DCP's other
thread counts, DeepSpeed) are read back once and compared the same way.

Process, CPU and memory: every (method, repetition, save|load) runs in a child process forked
after the state dict was built, so the children share it copy-on-write and each starts from the
same memory. In the child, the method is warmed up first, outside the timing (a tiny save and
load: fastckpt's engine and staging pool, DeepSpeed's aio handle and pinned buffer), as a
long-lived trainer would have done long before. CPU-s/GB is the child's ``getrusage(RUSAGE_SELF)``
user+sys over the operation (all its threads: io_uring/libaio workers, DCP's writer threads),
plus that of every helper process it started (``harness.cpu_tree``: a peer's writer process or
checkpoint daemon, live or reaped; the helpers' own peak RSS is kept in the records beside the
row's); not kernel threads such as the page-cache flusher: see ``machine CPU-s/GB``, the busy time of
all CPUs from /proc/stat over the same window). Peak extra RSS: the child resets its high-water
mark at its start (``echo 5 > /proc/self/clear_refs``), so ``VmHWM`` after the operation minus
``VmRSS`` at that reset is the most memory the method added, its long-lived buffers included
(``pool MB`` shows those alone); for a load it includes the loaded state dict itself
(about the payload). fio's rows are fio's own usr+sys and have no RSS figure.

The disk limit: fio on the same directory with the payload's size, run with
``benchmarks/bench_engine.py``'s runner, ``--rw=write --direct=1 --ioengine=io_uring
--end_fsync=1`` and ``--rw=read --direct=1 --ioengine=io_uring`` (cold), at a few block
sizes/depths; the best median is "the disk's limit". Everything is interleaved in one run
(fio and the methods, A B A B, order reversed on odd repetitions), medians over --reps; the
``x disk paired`` column divides each figure by the best fio figure of the same repetition
first, which cancels slow drifts of the disk.

Examples::

    .venv/bin/python benchmarks/bench_save_load.py --quick
    .venv/bin/python benchmarks/bench_save_load.py --only torch,dcp,safetensors --size 256M --reps 2
    .venv/bin/python benchmarks/bench_save_load.py --deepspeed --json /tmp/save_load.json   # 2 GiB, 3 reps
"""

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if REPO_ROOT not in sys.path:  # the checkout's `benchmarks` package (harness.py, workload.py)
    sys.path.insert(1, REPO_ROOT)

import torch  # noqa: E402

import bench_engine as be  # noqa: E402  (fio runner, size parsing, drop_caches, /proc helpers)
from benchmarks.harness import (  # noqa: E402  (the shared measuring pieces)
    SEED, fsync_dir, fsync_path, path_bytes, peak_rss_descendants, remove, reset_peak_rss, run_in_child, status_kb,
    timed)
from benchmarks.workload import (  # noqa: E402  (the synthetic state dict)
    build_state_dict, compare, describe_sd, iter_tensors, map_tensors, touch_pages)
from benchmarks.method import Method, st_flatten, st_unflatten  # noqa: E402,F401  (the methods' interface)
from benchmarks import peers  # noqa: E402  (torch-checkpointing, dcp.async_save, fastsafetensors, runai)

MiB = be.MiB
GiB = be.GiB
TARGET_DISK = 0.95     # fastckpt save/load >= this x fio's O_DIRECT write/read
TARGET_TORCH_SAVE = 2.0  # fastckpt save >= this x torch.save+fsync
TARGET_CPU = 0.5       # "well below torch's": fastckpt CPU-s/GB <= this x torch's
DS_BLOCK = 1 * MiB     # DeepSpeed aio defaults (runtime/swap_tensor/constants.py)
DS_QUEUE_DEPTH = 8
DS_IO_BUFFER = 64 * MiB  # DeepSpeed checkpoint io_buffer_size default, double-buffered
KEYS = ("fastckpt", "async", "torch", "dcp", "fastdcp", "safetensors", "deepspeed") + peers.KEYS
LABEL_LOAD_VERIFY = "fastckpt.load (verify on)"
LABEL_LOAD_NOVERIFY = "fastckpt.load (verify off)"
LABEL_TORCH_MMAP = "torch.load(mmap=True), pages touched"
LABEL_FASTREADER = "DCP FastReader (verify on)"
LABEL_ST_LOAD = "safetensors load_file, pages touched"
TOUCH_LABEL = "(ref) fresh memory: empty+fill_"
TOUCH_HUGE_LABEL = "(ref) fresh memory on huge pages: MADV_HUGEPAGE+fill_"
REF_LABELS = (TOUCH_LABEL, TOUCH_HUGE_LABEL)
log = be.log


# ----------------------------------------------------------------------------- the state dict

# build_state_dict, iter_tensors, describe_sd, map_tensors, compare and touch_pages: benchmarks/workload.py
# (one copy, shared with `fastckpt bench`), imported at the top.


# st_flatten / st_unflatten (the safetensors encoding of the nested state dict) and Method (the interface
# of a measured way of saving and loading): benchmarks/method.py, shared with the peers of benchmarks/peers.py.


# ----------------------------------------------------------------------------- methods

class FastckptMethod(Method):
    key = "fastckpt"
    label = "fastckpt.save"
    load_label = LABEL_LOAD_VERIFY

    def __init__(self, mod):
        self.fc = mod

    def save(self, sd, path):
        return self.fc.save(sd, path)

    def load(self, path, prep):
        return self.fc.load(path, map_location="cpu", weights_only=True, verify=True)

    def load_unverified(self, path, prep):
        return self.fc.load(path, map_location="cpu", weights_only=True, verify=False)

    def load_variants(self):
        return [(self.key, self.load_label, self.load),
                ("fastckpt_noverify", LABEL_LOAD_NOVERIFY, self.load_unverified)]

    def info(self):
        try:
            eng = self.fc.get_engine()
            return {"backend": eng.backend, "uring_refusal": eng.uring_refusal,
                    "knobs": {k: str(v) for k, v in self.fc.knobs.as_dict().items()}}
        except Exception as e:  # noqa: BLE001  (informational only)
            return {"engine_info_error": repr(e)}


class AsyncSaveMethod(Method):
    """fastckpt.async_save until its future is done (the file durable); the caller's blocked time
    (pickling + the host snapshot) is in the record's ``returned`` and the report's 'caller blocked'."""

    key = "async"
    label = "fastckpt.async_save"
    has_load = False  # the file is fastckpt.save's: see the fastckpt.load row

    def __init__(self, mod):
        self.fc = mod

    def prime(self, sd, workdir):
        # A trainer's steady state: its snapshot arena already exists (the first async_save made it;
        # every later one reuses it): one untimed async_save of this state, through the public API.
        self.save_once(sd, workdir)

    def save(self, sd, path):
        t0 = time.perf_counter()
        fut = self.fc.async_save(sd, path)
        returned = time.perf_counter() - t0
        res = fut.result()
        return {"blocking_s": returned, "snapshot_s": res.snapshot_seconds, "write_s": res.write_seconds}

    def load(self, path, prep):
        return self.fc.load(path, map_location="cpu", weights_only=True)


class TorchMethod(Method):
    key = "torch"
    label = "torch.save+fsync"
    load_label = "torch.load"

    def save(self, sd, path):
        torch.save(sd, path)
        fsync_path(path)
        fsync_dir(os.path.dirname(path))

    def load(self, path, prep):
        return torch.load(path, map_location="cpu", weights_only=True)

    def load_mmap(self, path, prep):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # pages: touch_pages, timed

    def load_variants(self):
        return [(self.key, self.load_label, self.load), ("torch_mmap", LABEL_TORCH_MMAP, self.load_mmap)]


class DcpMethod(Method):
    key = "dcp"
    dir_output = True

    def __init__(self, threads: int, has_load: bool):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        self.dcp, self.Writer, self.Reader = dcp, FileSystemWriter, FileSystemReader
        self.threads = threads
        self.has_load = has_load
        self.label = f"DCP FileSystemWriter t={threads}"
        self.load_label = "DCP FileSystemReader"

    def save(self, sd, path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.dcp.save(sd, storage_writer=self.Writer(path, thread_count=self.threads, sync_files=True))
        fsync_dir(path)
        fsync_dir(os.path.dirname(path))

    def prepare_load(self, sd):
        return map_tensors(sd, torch.zeros_like)  # allocated and touched: a model already in memory

    def load(self, path, prep):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.dcp.load(prep, storage_reader=self.Reader(path))
        return prep


class FastDcpMethod(Method):
    """dcp.save with fastckpt's FastWriter, dcp.load with its FastReader (CRC-verified)."""

    key = "fastdcp"
    dir_output = True
    label = "DCP FastWriter"
    load_label = LABEL_FASTREADER

    def __init__(self):
        import torch.distributed.checkpoint as dcp
        from fastckpt.dcp import FastReader, FastWriter

        self.dcp, self.Writer, self.Reader = dcp, FastWriter, FastReader

    def save(self, sd, path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.dcp.save(sd, storage_writer=self.Writer(path))  # fdatasync + rename + fsync of its directory
        fsync_dir(os.path.dirname(path))  # as the stock rows: the parent too

    def prepare_load(self, sd):
        return map_tensors(sd, torch.zeros_like)

    def load(self, path, prep):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.dcp.load(prep, storage_reader=self.Reader(path, verify=True))
        return prep


class SafetensorsMethod(Method):
    key = "safetensors"
    label = "safetensors save_file+fsync"
    load_label = LABEL_ST_LOAD
    lazy_result = True

    def __init__(self, readers=()):
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        self.safe_open, self.save_file, self.load_file = safe_open, save_file, load_file
        self.readers = list(readers)  # the other libraries' loaders of this file (benchmarks/peers.py)

    def save(self, sd, path):
        flat, meta = st_flatten(sd)
        self.save_file(flat, path, metadata=meta)
        fsync_path(path)
        fsync_dir(os.path.dirname(path))

    def load(self, path, prep):
        flat = self.load_file(path, device="cpu")  # memory-mapped: touch_pages (timed) reads every page
        with self.safe_open(path, framework="pt", device="cpu") as f:  # the header's metadata: the nesting
            meta = f.metadata()
        return st_unflatten(flat, meta)

    def load_variants(self):
        return [(self.key, self.load_label, self.load)] + self.readers


class DeepSpeedMethod(Method):
    key = "deepspeed"
    has_load = False  # DeepSpeed's checkpoint engine loads with torch.load: see the torch.load row

    def __init__(self, aio_op, parallelism: int):
        from deepspeed.io import FastFileWriter, FastFileWriterConfig

        self.aio_op, self.FFW, self.Cfg = aio_op, FastFileWriter, FastFileWriterConfig
        self.par = parallelism
        self.label = f"DeepSpeed FastFileWriter p={parallelism}"
        self.handle = None
        self.buf = None

    def warmup(self, workdir):
        # As DeepSpeed's CheckpointWriterFactory: one aio handle and one page-locked double buffer.
        self.handle = self.aio_op.aio_handle(DS_BLOCK, DS_QUEUE_DEPTH, False, True, self.par)
        self.buf = self.handle.new_cpu_locked_tensor(DS_IO_BUFFER, torch.empty(0, dtype=torch.uint8))
        self.buf.zero_()
        super().warmup(workdir)

    def save(self, sd, path):
        w = self.FFW(path, self.Cfg(dnvme_handle=self.handle, pinned_tensor=self.buf, double_buffer=True))
        torch.save(sd, w)
        w.close()  # drains the buffers, fsync(fd) and close
        fsync_dir(os.path.dirname(path))

    def read_back(self, path, sd):
        return torch.load(path, map_location="cpu", weights_only=True)

    def info(self):
        return {"block_size": DS_BLOCK, "queue_depth": DS_QUEUE_DEPTH, "io_buffer": DS_IO_BUFFER,
                "double_buffer": True, "intra_op_parallelism": self.par}


def setup_deepspeed(notes: List[str]) -> Tuple[Optional[Any], Optional[str]]:
    """Import DeepSpeed and load (JIT-building once, cached) its AsyncIO op. (op, None) or (None, why not)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cache = os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR",
        os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fastckpt-bench",
                     "torch_extensions"))
    try:
        import deepspeed  # noqa: F401
        import deepspeed.io.fast_file_writer as ffw
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)  # its per-drain NVMe-endurance warning would flood stdout
        from deepspeed.ops.op_builder import AsyncIOBuilder  # the accelerator's builder (links -laio)
    except Exception as e:  # noqa: BLE001
        return None, (f"DeepSpeed not importable ({type(e).__name__}: {e}); install it with "
                      f"`.venv/bin/pip install -c .venv/torch-constraint.txt --no-deps deepspeed==0.19.8` "
                      f"plus einops hjson msgpack psutil py-cpuinfo pydantic tqdm, and Debian's libaio-dev")
    try:
        b = AsyncIOBuilder()
        if not b.is_compatible(verbose=False):
            return None, "DeepSpeed's AsyncIO op is not compatible here (libaio-dev missing? apt-get install libaio-dev)"
        log(f"loading DeepSpeed's AsyncIO op (JIT build cached in {cache}; the first build takes minutes) ...")
        t = time.perf_counter()
        aio_op = b.load(verbose=False)
        # On a CPU-only torch the accelerator (cpu) has no UtilsBuilder, which FastFileWriter
        # imports: use the generic one (it only provides cast_to_byte_tensor).
        from deepspeed.ops.op_builder.utils import UtilsBuilder as GenericUtilsBuilder
        acc = ffw.UtilsBuilder
        if getattr(acc, "__name__", "") == "NotImplementedBuilder" or not acc().is_compatible(verbose=False):
            ffw.UtilsBuilder = GenericUtilsBuilder
            notes.append("DeepSpeed: patched deepspeed.io.fast_file_writer.UtilsBuilder to the generic "
                         "deepspeed.ops.op_builder.utils.UtilsBuilder (the CPU accelerator has none)")
        ffw.UtilsBuilder().load(verbose=False)
        log(f"  DeepSpeed ops ready in {time.perf_counter() - t:.1f} s")
        return aio_op, None
    except Exception as e:  # noqa: BLE001
        return None, f"DeepSpeed's AsyncIO op could not be built or loaded: {type(e).__name__}: {str(e)[-400:]}"


# ----------------------------------------------------------------------------- children

# status_kb, reset_peak_rss, run_in_child (a forked child reporting its result, CPU and peak RSS) and
# timed: benchmarks/harness.py, imported at the top.
_status_kb = status_kb


# ----------------------------------------------------------------------------- records

@dataclass
class Rec:
    label: str
    key: str
    op: str                 # save | load
    rep: int
    bytes: int
    seconds: float
    gbps: float
    cpu_s: float
    machine_cpu_s: float
    rss_extra: float = float("nan")   # bytes
    pool: float = float("nan")        # bytes held after the warm-up (part of rss_extra)
    file_bytes: float = float("nan")
    verified: Optional[bool] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FioPoint:
    bs: int
    qd: int

    @property
    def item(self) -> "be.Item":
        return be.Item("fio", "io_uring", self.bs, self.qd)

    @property
    def label(self) -> str:
        return f"fio bs={be.fmt_size(self.bs)} qd={self.qd}"


class Bench:
    def __init__(self, args, workdir: str, sd, methods: List[Method], fio_points: List[FioPoint]):
        self.args = args
        self.dir = workdir
        self.sd = sd
        self.payload = sum(t.nbytes for t in iter_tensors(sd))
        self.methods = methods
        self.fio_points = fio_points
        self.records: List[Rec] = []
        self.notes: List[str] = []
        self.errors: List[str] = []
        self.drop_error: Optional[str] = None
        self.drop_ok = 0
        self.dev: Optional[str] = None
        self.verified_once: Dict[str, bool] = {}
        self.huge_slow: Dict[str, List[int]] = {}  # fastckpt load label -> [loads that found huge pages slow, loads]
        self.method_info: Dict[str, Any] = {}
        unit = math.lcm(MiB, *(fp.bs for fp in fio_points))  # fio moves whole blocks only
        self.fio_size = -(-self.payload // unit) * unit
        self.load_label_of = {m.label: m.load_label for m in methods if m.has_load}
        self.fio = be.Bench(SimpleNamespace(size=self.fio_size, no_fio=args.no_fio), workdir) if fio_points else None

    # -- helpers

    def drop(self) -> Optional[str]:
        err = be.drop_caches()
        if err is None:
            self.drop_ok += 1
        elif self.drop_error is None:
            self.drop_error = err
            log(f"NOTE: {err}: loads are NOT from a cold page cache (buffered readers profit from it)")
        return err

    def add(self, rec: Rec) -> None:
        self.records.append(rec)
        rss = f"  rss +{rec.rss_extra / MiB:.0f} MiB" if rec.rss_extra == rec.rss_extra else ""
        chk = "" if rec.verified is None else ("  verified" if rec.verified else "  MISMATCH")
        log(f"  rep {rec.rep + 1}  {rec.label:<36} {rec.op:<5} {rec.gbps:6.2f} GB/s  {rec.seconds:6.2f} s  "
            f"cpu {rec.cpu_s / (rec.bytes / 1e9):.3f} s/GB{rss}{chk}")

    # -- one method

    def _child_save(self, m: Method, path: str, verify: bool) -> Dict[str, Any]:
        base, reset_ok = reset_peak_rss()
        m.warmup(self.dir)
        m.prime(self.sd, self.dir)
        pool = _status_kb("VmRSS") * 1024 - base
        os.sync()
        t, (ret, d0, d1) = timed(lambda: m.save(self.sd, path), self.dev)
        hwm = _status_kb("VmHWM") * 1024
        helpers_hwm = peak_rss_descendants()
        out = dict(t, rss_extra=hwm - base, pool=pool, reset_ok=reset_ok, file_bytes=path_bytes(path),
                   dev=be.dev_delta(d0, d1, "write"), info=m.info(), helpers_peak_rss=helpers_hwm)
        if ret is not None:
            out["returned"] = dict(ret) if isinstance(ret, dict) else repr(ret)[:2000]
        if verify:
            diffs = compare(self.sd, m.read_back(path, self.sd))
            out["verified"], out["diffs"] = not diffs, diffs
        m.close()
        return out

    def _child_load(self, m: Method, path: str, load: Callable[[str, Any], Any]) -> Dict[str, Any]:
        base, reset_ok = reset_peak_rss()
        m.warmup(self.dir)
        pool = _status_kb("VmRSS") * 1024 - base
        prep = m.prepare_load(self.sd)
        drop_err = be.drop_caches()
        t, (res, d0, d1) = timed(lambda: (lambda sd: (sd, touch_pages(sd)))(load(path, prep)), self.dev)
        hwm = _status_kb("VmHWM") * 1024
        diffs = compare(self.sd, res[0])
        m.close()
        fc = sys.modules.get("fastckpt._C")  # whose reads found huge pages slow (knob load_huge_pages)
        return dict(t, rss_extra=hwm - base, pool=pool, reset_ok=reset_ok, drop_error=drop_err,
                    dev=be.dev_delta(d0, d1, "read"), verified=not diffs, diffs=diffs,
                    huge_slow=fc.huge_pages_verdict()["slow_seen"] if fc is not None else None)

    def _record(self, m: Method, op: str, rep: int, out: Dict[str, Any], label: Optional[str] = None,
                key: Optional[str] = None) -> bool:
        label = label or (m.label if op == "save" else m.load_label)
        key = key or m.key
        if "error" in out:
            msg = f"{label} ({op}, rep {rep + 1}) FAILED: {out['error']}"
            self.errors.append(msg)
            log("  " + msg + ("\n" + out["traceback"] if "traceback" in out else ""))
            return False
        if op == "load" and out.get("drop_error"):
            if self.drop_error is None:
                self.drop_error = out["drop_error"]
                log(f"NOTE: {out['drop_error']}: loads are NOT from a cold page cache")
        elif op == "load":
            self.drop_ok += 1
        if not out.get("reset_ok", True):
            self.notes.append("could not reset the RSS high-water mark (/proc/self/clear_refs): peak RSS figures "
                              "are VmHWM since the fork")
        if out.get("info"):
            self.method_info[m.label] = out["info"]
            self.notes += out["info"].get("notes", [])
        if op == "load" and key.startswith("fastckpt") and out.get("huge_slow") is not None:
            seen = self.huge_slow.setdefault(label, [0, 0])
            seen[0] += bool(out["huge_slow"])
            seen[1] += 1
        if "verified" in out:
            self.verified_once[label] = self.verified_once.get(label, True) and out["verified"]
            if not out["verified"]:
                self.errors.append(f"{label}: DATA MISMATCH after rep {rep + 1}: {out['diffs']}")
        extra = {k: out[k] for k in ("dev", "returned", "child_cpu_total_s", "helpers_cpu_s", "helpers_peak_rss",
                                     "diffs") if k in out}
        self.add(Rec(label, key, op, rep, self.payload, out["seconds"], self.payload / out["seconds"] / 1e9,
                     out["cpu_s"], out["machine_cpu_s"], out["rss_extra"], out["pool"],
                     out.get("file_bytes", float("nan")), out.get("verified"), extra))
        return True

    def run_method(self, m: Method, rep: int) -> None:
        path = os.path.join(self.dir, f"ckpt-{m.key}" + ("" if m.dir_output else ".bin"))
        remove(path)
        self.drop()  # flush earlier writes and empty the cache: every save starts from the same state
        verify = (not m.has_load) and rep == 0
        out = run_in_child(lambda: self._child_save(m, path, verify), self.args.threads, self.args.child_timeout)
        ok = self._record(m, "save", rep, out)
        variants = m.load_variants() if ok else []
        for key, label, load in (variants if rep % 2 == 0 else variants[::-1]):  # variants interleaved too
            out = run_in_child(lambda: self._child_load(m, path, load), self.args.threads, self.args.child_timeout)
            self._record(m, "load", rep, out, label, key)
        remove(path)
        for p in os.listdir(self.dir):  # leftovers of a failed save (temporary files)
            if p.startswith(".") or p.startswith("ckpt-") or p.startswith("warmup-"):
                remove(os.path.join(self.dir, p))

    # -- reference: first touch of fresh memory (what any loader that allocates its result pays)

    def _child_touch(self, huge: bool) -> Dict[str, Any]:
        base, reset_ok = reset_peak_rss()
        if huge:  # as fastckpt's loads allocate storages of 2 MiB or more (knob load_huge_pages)
            from fastckpt import _C
            fresh = lambda: _C.empty_aligned(self.payload, 4096, 0, True).fill_(0)  # noqa: E731
        else:
            fresh = lambda: torch.empty(self.payload, dtype=torch.uint8).fill_(0)  # noqa: E731
        t, _ = timed(fresh, None)
        return dict(t, rss_extra=_status_kb("VmHWM") * 1024 - base, pool=0, reset_ok=reset_ok)

    def run_touch(self, rep: int) -> None:
        for label in (REF_LABELS if rep % 2 == 0 else REF_LABELS[::-1]):
            out = run_in_child(lambda: self._child_touch(label == TOUCH_HUGE_LABEL), self.args.threads,
                               self.args.child_timeout)
            if "error" in out:
                self.errors.append(f"first-touch reference ({label}) failed: {out['error']}")
                continue
            self.add(Rec(label, "ref", "load", rep, self.payload, out["seconds"], self.payload / out["seconds"] / 1e9,
                         out["cpu_s"], out["machine_cpu_s"], out["rss_extra"], 0.0))

    # -- fio

    def run_fio(self, fp: FioPoint, rep: int) -> None:
        path = os.path.join(self.dir, "fio.bin")
        remove(path)
        self.drop()
        try:
            for op in ("write", "read"):
                r = self.fio.fio_run(fp.item, path, op, rep)  # the read drops the cache itself
                extra = dict(r.extra)
                extra.pop("cmd", None)
                self.add(Rec(fp.label, "fio", "save" if op == "write" else "load", rep, r.bytes, r.seconds, r.gbps,
                             r.cpu_s, r.machine_cpu_s, extra=dict(extra, cmd=r.extra.get("cmd"))))
        finally:
            remove(path)

    def run(self) -> None:
        order = be.interleave(list(self.methods), list(self.fio_points))
        for rep in range(self.args.reps):
            seq = order if rep % 2 == 0 else list(reversed(order))
            log(f"repetition {rep + 1}/{self.args.reps}: " + ", ".join(x.label for x in seq))
            if not self.args.no_touch_ref:
                self.run_touch(rep)
            for x in seq:
                if isinstance(x, FioPoint):
                    self.run_fio(x, rep)
                else:
                    self.run_method(x, rep)
        if self.fio:
            self.notes += self.fio.notes
            self.drop_ok += self.fio.drop_ok
            if self.fio.drop_error and not self.drop_error:
                self.drop_error = self.fio.drop_error


# ----------------------------------------------------------------------------- report

def median(xs: List[float]) -> float:
    return be.median(xs)


@dataclass
class Row:
    label: str
    key: str
    op: str
    n: int
    gbps: float
    lo: float
    hi: float
    x_fast: float = float("nan")
    x_disk: float = float("nan")
    x_disk_paired: float = float("nan")
    cpu_per_gb: float = float("nan")
    machine_per_gb: float = float("nan")
    rss_mb: float = float("nan")
    pool_mb: float = float("nan")
    file_mb: float = float("nan")
    check: str = ""
    blocked_s: float = float("nan")   # async_save: how long the caller waited (median)
    helpers_rss_mb: float = float("nan")  # the helper processes' own peak RSS (a peer's writer process)
    dev_x: float = float("nan")   # bytes the disk read (loads) or wrote (saves) per tensor byte (median)


def summarize(bench: Bench) -> Tuple[Dict[str, List[Row]], Dict[str, Any]]:
    rows: Dict[str, List[Row]] = {"save": [], "load": []}
    summary: Dict[str, Any] = {}
    for op in ("save", "load"):
        recs = [r for r in bench.records if r.op == op]
        labels = list(dict.fromkeys(r.label for r in recs))
        fio_labels = [l for l in labels if l.startswith("fio")]
        fio_meds = {l: median([r.gbps for r in recs if r.label == l]) for l in fio_labels}
        disk = max(fio_meds.values()) if fio_meds else float("nan")
        fio_by_rep: Dict[int, float] = {}
        for r in recs:
            if r.key == "fio":
                fio_by_rep[r.rep] = max(fio_by_rep.get(r.rep, 0.0), r.gbps)
        summary[f"disk_{op}_gbps"] = disk
        summary[f"disk_{op}_point"] = max(fio_meds, key=fio_meds.get) if fio_meds else None
        refs = [l for l in labels if l in REF_LABELS]
        for l in fio_labels + [l for l in labels if not l.startswith("fio") and l not in refs] + refs:
            rs = [r for r in recs if r.label == l]
            g = [r.gbps for r in rs]
            v = [r.verified for r in rs if r.verified is not None]
            check = ("verified" if all(v) else "MISMATCH") if v else ""
            if not v and bench.verified_once.get(l) is not None:
                check = "verified" if bench.verified_once[l] else "MISMATCH"
            if not v and op == "save" and l in bench.load_label_of:  # checked by its load row
                lv = [r.verified for r in bench.records if r.label == bench.load_label_of[l] and
                      r.verified is not None]
                check = ("verified (by load)" if all(lv) else "MISMATCH (load)") if lv else ""
            rows[op].append(Row(
                l, rs[0].key, op, len(rs), median(g), min(g), max(g),
                x_disk=median(g) / disk if disk == disk else float("nan"),
                x_disk_paired=median([r.gbps / fio_by_rep[r.rep] for r in rs if r.rep in fio_by_rep]),
                cpu_per_gb=median([r.cpu_s / (r.bytes / 1e9) for r in rs]),
                machine_per_gb=median([r.machine_cpu_s / (r.bytes / 1e9) for r in rs]),
                rss_mb=median([r.rss_extra / MiB for r in rs]), pool_mb=median([r.pool / MiB for r in rs]),
                file_mb=median([r.file_bytes / MiB for r in rs]), check=check,
                blocked_s=median([r.extra["returned"]["blocking_s"] for r in rs
                                  if isinstance(r.extra.get("returned"), dict)
                                  and "blocking_s" in r.extra["returned"]]),
                helpers_rss_mb=median([r.extra["helpers_peak_rss"] / MiB for r in rs
                                       if r.extra.get("helpers_peak_rss")]),
                dev_x=median([r.extra["dev"]["bytes"] / r.bytes for r in rs
                              if isinstance(r.extra.get("dev"), dict) and "bytes" in r.extra["dev"] and r.bytes])))
        fast = next((r for r in rows[op] if r.key == "fastckpt"), None)
        for r in rows[op]:
            if fast is not None:
                r.x_fast = r.gbps / fast.gbps
        summary[f"rows_{op}"] = [r.__dict__ for r in rows[op]]
    return rows, summary


def _f(x: float, fmt: str) -> str:
    return format(x, fmt) if x == x else "-"


def print_table(rows: List[Row], op: str, bench: Bench) -> None:
    hdr = ["method", "n", f"{op} GB/s median [min-max]", "x fastckpt",
           "x disk", "x disk paired", "CPU-s/GB", "machine CPU-s/GB", "peak extra RSS MB", "pool MB", "file MB",
           "disk " + ("read" if op == "load" else "wrote") + " x tensor bytes", "check"]
    lines = []
    for r in rows:
        lines.append([r.label, str(r.n), f"{r.gbps:.3f} [{r.lo:.3f}-{r.hi:.3f}]", _f(r.x_fast, ".2f"),
                      _f(r.x_disk, ".2f"), _f(r.x_disk_paired, ".2f"), _f(r.cpu_per_gb, ".3f"),
                      _f(r.machine_per_gb, ".3f"), _f(r.rss_mb, ".0f"), _f(r.pool_mb, ".0f"), _f(r.file_mb, ".0f"),
                      _f(r.dev_x, ".3f"), r.check])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(hdr)]
    what = "durable save" if op == "save" else "cold load"
    print(f"\n### {what}: {bench.payload / 1e9:.3f} GB of tensors per run\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(hdr, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for l in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(l, widths)) + " |")
    for r in rows:
        if r.helpers_rss_mb == r.helpers_rss_mb:
            print(f"\n{r.label}: its helper processes' own peak RSS {r.helpers_rss_mb:.0f} MB (median VmHWM since "
                  "they started, their imports included; beside the row's, which is the calling process's; shared "
                  "staging memory counts in both)")
        if r.blocked_s == r.blocked_s:
            print(f"\n{r.label}: the caller was blocked {r.blocked_s:.3f} s (median; until it may change the state "
                  f"again: for fastckpt.async_save pickling + host snapshot), "
                  f"{bench.payload / r.blocked_s / 1e9:.2f} GB/s; the GB/s above run until the file is durable")


def verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("MET" if ok else "NOT MET")


def targets(rows: Dict[str, List[Row]], summary: Dict[str, Any]) -> List[str]:
    out: List[str] = []
    res: Dict[str, Optional[bool]] = {}
    fs, fl = row_of(rows, "save", "fastckpt"), row_of(rows, "load", "fastckpt")
    ts, tl = row_of(rows, "save", "torch"), row_of(rows, "load", "torch")
    ds, dl = summary.get("disk_save_gbps", float("nan")), summary.get("disk_load_gbps", float("nan"))
    if fs is None:
        out.append("fastckpt.save was not measured: no target can be judged")
        return out
    if ds == ds:
        res["save_disk"] = fs.x_disk >= TARGET_DISK
        out.append(f"durable save vs fio O_DIRECT write: fastckpt {fs.gbps:.3f} GB/s = {fs.x_disk:.2f} x disk "
                   f"{ds:.3f} GB/s ({summary['disk_save_point']}), paired {fs.x_disk_paired:.2f} "
                   f"(target >= {TARGET_DISK}): {verdict(res['save_disk'])}")
    else:
        out.append("durable save vs disk: no fio figure (fio not run)")
    if ts is not None:
        res["save_torch"] = fs.gbps >= TARGET_TORCH_SAVE * ts.gbps
        out.append(f"durable save vs torch.save+fsync: {fs.gbps / ts.gbps:.2f} x ({ts.gbps:.3f} GB/s) "
                   f"(target >= {TARGET_TORCH_SAVE:g} x): {verdict(res['save_torch'])}")
    peers: Dict[str, Row] = {}
    for r in rows["save"]:
        if r.key in ("fio", "fastckpt", "ref"):
            continue
        best = peers.get(r.key)
        if best is None or r.gbps > best.gbps:
            peers[r.key] = r
    if peers:
        top = max(peers.values(), key=lambda r: r.gbps)
        res["save_peers"] = fs.gbps > top.gbps
        out.append("durable save ahead of every peer: " + ", ".join(
            f"{r.label} {r.gbps:.3f} GB/s ({fs.gbps / r.gbps:.2f} x)" for r in sorted(peers.values(),
                                                                                     key=lambda r: -r.gbps))
            + f": {verdict(res['save_peers'])}")
    if fl is not None:
        if dl == dl:
            res["load_disk"] = fl.x_disk >= TARGET_DISK
            out.append(f"cold load vs fio O_DIRECT read: fastckpt {fl.gbps:.3f} GB/s = {fl.x_disk:.2f} x disk "
                       f"{dl:.3f} GB/s ({summary['disk_load_point']}), paired {fl.x_disk_paired:.2f} "
                       f"(target >= {TARGET_DISK}): {verdict(res['load_disk'])}")
        if tl is not None:
            res["load_torch"] = fl.gbps > tl.gbps
            out.append(f"cold load ahead of torch.load: {fl.gbps / tl.gbps:.2f} x ({tl.gbps:.3f} GB/s): "
                       f"{verdict(res['load_torch'])}")
        lpeers = [r for r in rows["load"] if r.key not in ("fio", "fastckpt", "torch", "ref", "fastckpt_noverify")]
        if lpeers:
            out.append("cold load vs the other loaders (no target): " + ", ".join(
                f"{r.label} {r.gbps:.3f} GB/s ({fl.gbps / r.gbps:.2f} x)" for r in lpeers))
    for op, f, t in (("save", fs, ts), ("load", fl, tl)):
        if f is not None and t is not None:
            ok = f.cpu_per_gb <= TARGET_CPU * t.cpu_per_gb
            res[f"cpu_{op}"] = ok
            out.append(f"CPU ({op}): fastckpt {f.cpu_per_gb:.3f} CPU-s/GB vs {t.label} {t.cpu_per_gb:.3f} "
                       f"({f.cpu_per_gb / t.cpu_per_gb:.2f} x; machine-wide {f.machine_per_gb:.3f} vs "
                       f"{t.machine_per_gb:.3f}) (target 'well below', taken as <= {TARGET_CPU:g} x): {verdict(ok)}")
    summary["targets"] = res
    return out


def row_of(rows: Dict[str, List[Row]], op: str, key: str) -> Optional[Row]:
    """The first row of op measured for key (a method's own load comes before its variants)."""
    return next((r for r in rows[op] if r.key == key), None)


# The save/load targets (make bench and the report; never timed tests): (id, what, goal, how it is measured)
TARGETS_12 = (
    ("load_vs_torch_mmap", f"{LABEL_LOAD_VERIFY} vs {LABEL_TORCH_MMAP}", 1.3, "x"),
    ("load_vs_fio", f"{LABEL_LOAD_VERIFY} vs fio O_DIRECT read", 0.95, "x"),
    ("fastreader_vs_load", f"{LABEL_FASTREADER} vs {LABEL_LOAD_VERIFY}", 0.9, "x"),
    ("save_cpu", "fastckpt.save CPU-s/GB", 0.12, "s/GB"),
    ("load_cpu", f"{LABEL_LOAD_VERIFY} CPU-s/GB", 0.2, "s/GB"),
)


def size_targets(rows: Dict[str, List[Row]], summary: Dict[str, Any]) -> List[str]:
    """The save/load targets, each with the figure it is judged on: summary['size_targets'] is a list of
    {id, target, goal, unit, measured, met} (measured None and met None when a figure is missing)."""
    fs, fl = row_of(rows, "save", "fastckpt"), row_of(rows, "load", "fastckpt")
    tm, fr = row_of(rows, "load", "torch_mmap"), row_of(rows, "load", "fastdcp")
    dl = summary.get("disk_load_gbps", float("nan"))
    ratio = lambda a, b: a.gbps / b.gbps if a is not None and b is not None else None  # noqa: E731
    measured = {
        "load_vs_torch_mmap": ratio(fl, tm),
        "load_vs_fio": fl.gbps / dl if fl is not None and dl == dl else None,
        "fastreader_vs_load": ratio(fr, fl),
        "save_cpu": fs.cpu_per_gb if fs is not None else None,
        "load_cpu": fl.cpu_per_gb if fl is not None else None,
    }
    out, res = [], []
    for tid, what, goal, unit in TARGETS_12:
        m = measured[tid]
        met = None if m is None or m != m else (m <= goal if unit == "s/GB" else m >= goal)
        sign = "<=" if unit == "s/GB" else ">="
        res.append({"id": tid, "target": f"{what} {sign} {goal:g}{' x' if unit == 'x' else ' ' + unit}",
                    "goal": goal, "unit": unit, "measured": m, "met": met})
        shown = "not measured" if m is None or m != m else (f"{m:.2f} x" if unit == "x" else f"{m:.3f} {unit}")
        out.append(f"target: {res[-1]['target']}: {shown}: {verdict(met)}")
    summary["size_targets"] = res
    return out


def context(bench: Bench, workdir: str, threads: int) -> Dict[str, Any]:
    fio = bench.fio.fio if bench.fio is not None and bench.fio.fio else None
    ctx = be.machine_info(workdir, fio)  # CPUs, memory, kernel, filesystem, device, versions, date
    ctx.update(dir=workdir, git=ctx["fastckpt"], torch_threads_in_children=threads)
    m = ctx["mount"]
    if m["source"].startswith("/dev/"):
        bench.dev = os.path.basename(os.path.realpath(m["source"]))
        if be.dev_stat(bench.dev) is None:
            bench.dev = None
    if bench.fio is not None:
        bench.fio.dev = bench.dev
    for mod in ("safetensors", "deepspeed"):
        m_ = sys.modules.get(mod)
        if m_ is not None:
            ctx[mod] = getattr(m_, "__version__", "?")
    ctx.update(peers.versions())
    return ctx


def report(bench: Bench, ctx: Dict[str, Any], skipped: Dict[str, str]) -> Dict[str, Any]:
    a = bench.args
    blk = ctx.get("block") or {}
    print("## fastckpt save/load benchmark\n")
    print(f"- kernel {ctx['kernel']}, {ctx['nproc']} CPUs ({ctx['cpus_usable']} usable), {ctx.get('cpu', '?')}, "
          f"{ctx.get('mem_total_gb', '?')} GB RAM; torch {ctx['torch']} ({ctx['torch_threads_in_children']} "
          f"intra-op threads in the children), fastckpt {ctx['git']}"
          + "".join(f", {k} {ctx[k]}" for k in ("safetensors", "deepspeed") + peers.DISTRIBUTIONS if k in ctx))
    print(f"- dir {ctx['dir']}: {ctx['fstype']} on {ctx['mount']['source']}"
          + (f"; device {blk.get('device')}: scheduler {blk.get('scheduler')}, write_cache {blk.get('write_cache')}"
             if blk else ""))
    d = bench.sd_info
    print(f"- state dict: {d['tensors']} tensors, {d['bytes']} bytes ({d['bytes'] / 1e9:.3f} GB; "
          f"{', '.join(f'{k} {v / 1e9:.2f} GB' for k, v in d['bytes_by_dtype'].items())}); "
          f"{d['at_least_64mib']} tensors >= 64 MiB (largest {d['largest_mib'][:3]} MiB), {d['under_1mib']} under "
          f"1 MiB; seed {SEED}; built in {bench.build_s:.1f} s")
    print(f"- {a.reps} repetitions, interleaved (order reversed on odd repetitions); medians [min-max]")
    if not a.no_touch_ref:
        print(f"- '{TOUCH_LABEL}': torch.empty(payload bytes).fill_(0) in a fresh child, once per repetition: "
              "the page-fault + zeroing rate of fresh memory, which every loader that allocates its result pays "
              f"(fio reads into one reused buffer and does not); '{TOUCH_HUGE_LABEL}': the same on transparent "
              "huge pages, as fastckpt's loads allocate storages of 2 MiB or more unless their reads find huge "
              "pages faulting in slowly (knob load_huge_pages, default 2)")
    if bench.huge_slow:
        print("- fastckpt loads whose reads found huge pages faulting in slowly and moved the rest of the load "
              "to small pages (docs/ENGINE.md, 'Huge or small pages for a load'): "
              + "; ".join(f"{k} {n} of {m}" for k, (n, m) in bench.huge_slow.items()))
    print(f"- fio: {ctx.get('fio', 'not run')}" + (f", {bench.fio_size} bytes per run" if bench.fio_points else ""))
    if bench.drop_error:
        print(f"- page cache: NOT dropped ({bench.drop_error}): the loads are NOT cold")
    else:
        print(f"- page cache: dropped (os.sync(); echo 3 > /proc/sys/vm/drop_caches) before every load "
              f"({bench.drop_ok} times in all, saves included)")
    print("- durability: fastckpt.save: its own (tmp + fdatasync + rename + dir fsync); torch and safetensors: "
          "reopen + fsync(file) + fsync(dir); DCP: sync_files=True + fsync(checkpoint dir) + fsync(parent); "
          "DeepSpeed: FastFileWriter.close() (its fsync) + fsync(dir); torch-checkpointing: none of its own, "
          "fsync of every file and directory + the parent added (+fsync); dcp.async_save: sync_files=True + "
          "fsync(checkpoint dir) + fsync(parent). fastckpt and torch-checkpointing (a temporary directory) also "
          "rename atomically.")
    print("- GB/s: tensor payload / wall time; x fastckpt: median / fastckpt's median; x disk: median / best fio "
          "median (same op); paired: median over reps of GB/s / best fio of that rep")
    print("- CPU-s/GB: the child's user+sys (all its threads, and every helper process it started: live "
          "descendants' and reaped children's CPU from /proc) over the operation; machine: all CPUs' busy time in "
          "the window (includes kernel flusher threads, interrupts); peak extra RSS: VmHWM after the operation "
          "minus VmRSS at the child's start (after resetting VmHWM via /proc/self/clear_refs), including the "
          "method's long-lived buffers ('pool', made by the untimed warm-up) and, for loads, the loaded state dict")
    if a.deepspeed and "deepspeed" not in skipped:
        print(f"- DeepSpeed: aio block {be.fmt_size(DS_BLOCK)}, queue depth {DS_QUEUE_DEPTH}, "
              f"{be.fmt_size(DS_IO_BUFFER)} page-locked double buffer (its checkpoint defaults); its AsyncIO op "
              "is built by DeepSpeed with -O0; no load row (DeepSpeed loads with torch.load)")
    rows, summary = summarize(bench)
    for op in ("save", "load"):
        if rows[op]:
            print_table(rows[op], op, bench)
    print("\n## targets\n")
    for line in targets(rows, summary):
        print(line)
    for line in size_targets(rows, summary):
        print(line)
    for k, why in skipped.items():
        print(f"skipped {k}: {why}")
    for n in dict.fromkeys(bench.notes):
        print(f"note: {n}")
    for e in bench.errors:
        print(f"ERROR: {e}")
    if bench.method_info:
        for k, v in bench.method_info.items():
            print(f"info {k}: {json.dumps(v, default=str)}")
    return summary


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to test; files go to a temporary .bench-tmp-* directory "
                                  "inside it, removed at the end (default: the repository root)")
    ap.add_argument("--size", type=be.parse_size, default=None,
                    help="tensor bytes of the state dict (default 2G; --quick: 512M)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --quick: 2)")
    ap.add_argument("--quick", action="store_true", help="512M, 2 reps, DCP thread_count 2 only, one fio point")
    ap.add_argument("--only", help=f"comma-separated methods among {','.join(KEYS)} (default: all but deepspeed, "
                                   "which needs --deepspeed); fio runs unless --no-fio")
    ap.add_argument("--deepspeed", action="store_true", help="also DeepSpeed's FastFileWriter (JIT-builds its "
                                                             "AsyncIO op once, minutes; cached)")
    ap.add_argument("--ds-parallelism", default="1,2", help="DeepSpeed intra_op_parallelism values; the best is "
                                                            "the peer (default 1,2; DeepSpeed's own default is 1)")
    ap.add_argument("--dcp-threads", default=None, help="DCP FileSystemWriter thread_count values (default 1,2,4; "
                                                        "--quick: 2)")
    ap.add_argument("--fio-points", default=None,
                    help="fio block:depth points, best is the disk limit (default 1M:16,8M:8; --quick: 8M:8)")
    ap.add_argument("--no-fio", action="store_true", help="do not run fio")
    ap.add_argument("--no-touch-ref", action="store_true",
                    help="skip the reference row 'fresh memory' (torch.empty(payload).fill_(0) in a fresh child)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads in the children (default: torch's default here)")
    ap.add_argument("--child-timeout", type=int, default=1800, help="seconds before a stuck child is killed")
    ap.add_argument("--json", metavar="PATH", help="write raw results, context and summary here")
    args = ap.parse_args(argv)
    args.size = args.size or (512 * MiB if args.quick else 2 * GiB)
    args.reps = args.reps or (2 if args.quick else 3)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    dcp_threads = [int(x) for x in (args.dcp_threads or ("2" if args.quick else "1,2,4")).split(",") if x]
    ds_par = [int(x) for x in args.ds_parallelism.split(",") if x]
    fio_spec = args.fio_points or ("8M:8" if args.quick else "1M:16,8M:8")
    fio_points = [] if args.no_fio else [FioPoint(be.parse_size(p.split(":")[0]), int(p.split(":")[1]))
                                         for p in fio_spec.split(",") if p]
    if args.only:
        only = [k.strip() for k in args.only.split(",") if k.strip()]
        bad = [k for k in only if k not in KEYS]
        if bad:
            ap.error(f"--only: unknown {bad}; choose among {list(KEYS)}")
        if "deepspeed" in only:
            args.deepspeed = True
    else:
        only = [k for k in KEYS if k != "deepspeed" or args.deepspeed]
    if fio_points and not shutil.which("fio"):
        log("NOTE: fio is not installed (Debian package 'fio'): no disk limit in this run")
        fio_points = []
    # torch's default intra-op thread count for the children; the parent stays single-threaded so
    # that it never starts OpenMP's thread pool, which does not survive fork() (a child would hang).
    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(1)

    notes: List[str] = []
    skipped: Dict[str, str] = {}
    methods: List[Method] = []
    parent = os.path.abspath(args.dir) if args.dir else REPO_ROOT
    os.makedirs(parent, exist_ok=True)
    for key in only:
        if key == "fastckpt":
            try:
                import fastckpt
                if not (hasattr(fastckpt, "save") and hasattr(fastckpt, "load")):
                    raise ImportError("fastckpt has no save/load yet")
                methods.append(FastckptMethod(fastckpt))
            except Exception as e:  # noqa: BLE001
                skipped[key] = f"{type(e).__name__}: {e} (rebuild with `make build` if fastckpt._C fails to import)"
        elif key == "async":
            try:
                import fastckpt
                methods.append(AsyncSaveMethod(fastckpt))
            except Exception as e:  # noqa: BLE001
                skipped[key] = f"{type(e).__name__}: {e}"
        elif key == "torch":
            methods.append(TorchMethod())
        elif key == "fastdcp":
            try:
                methods.append(FastDcpMethod())
            except Exception as e:  # noqa: BLE001
                skipped[key] = f"fastckpt.dcp unavailable: {type(e).__name__}: {e}"
        elif key == "dcp":
            try:
                methods += [DcpMethod(k, has_load=(i == 0)) for i, k in
                            enumerate(sorted(dcp_threads, key=lambda k: (k != 2, k)))]
            except Exception as e:  # noqa: BLE001
                skipped[key] = f"torch.distributed.checkpoint unavailable: {e}"
        elif key == "safetensors":
            try:
                methods.append(SafetensorsMethod(peers.safetensors_readers(skipped)))
            except ImportError as e:
                skipped[key] = (f"{e}; install with `.venv/bin/pip install -c .venv/torch-constraint.txt "
                                f"safetensors`")
        elif key in ("tc", "tc_async"):
            if key == "tc" or "tc" not in only:  # both rows from one probe of use_direct_io
                methods += peers.torch_checkpointing_methods(parent, [k for k in ("tc", "tc_async") if k in only],
                                                             skipped, notes)
        elif key == "dcp_async":
            methods += peers.dcp_async_methods(skipped, notes)
        elif key == "deepspeed":
            aio_op, why = setup_deepspeed(notes)
            if aio_op is None:
                skipped[key] = why
            else:
                methods += [DeepSpeedMethod(aio_op, p) for p in ds_par]
    for k, why in skipped.items():
        log(f"SKIP {k}: {why}")
    if not methods:
        raise SystemExit("no method to measure")
    # the DCP load row sits with the thread_count=2 (or first) variant; keep the list order readable
    methods.sort(key=lambda m: (KEYS.index(m.key), getattr(m, "threads", 0), getattr(m, "par", 0)))

    workdir = tempfile.mkdtemp(prefix=".bench-tmp-", dir=parent)
    try:
        free = shutil.disk_usage(workdir).free
        if free < 2.5 * args.size + GiB:
            raise SystemExit(f"not enough free space in {workdir}: {free / 1e9:.1f} GB free, need about "
                             f"{(2.5 * args.size + GiB) / 1e9:.1f} GB")
        with open("/proc/meminfo") as f:
            avail = int(next(l for l in f if l.startswith("MemAvailable")).split()[1]) * 1024
        if 3.5 * args.size > 0.9 * avail:
            raise SystemExit(f"not enough memory: about {3.5 * args.size / 1e9:.1f} GB needed (the state dict, a "
                             f"loaded copy, format copies), {avail / 1e9:.1f} GB available; use a smaller --size")
        log(f"building the state dict ({args.size / 1e9:.2f} GB, seed {SEED}) ...")
        t = time.perf_counter()
        sd = build_state_dict(args.size)
        build_s = time.perf_counter() - t
        bench = Bench(args, workdir, sd, methods, fio_points)
        bench.notes += notes
        bench.sd_info = describe_sd(sd)
        bench.build_s = build_s
        touch_pages(sd)
        log(f"  {bench.sd_info['tensors']} tensors, {bench.payload / 1e9:.3f} GB, in {build_s:.1f} s")
        ctx = context(bench, workdir, args.threads)
        if ctx["fstype"] in ("tmpfs", "ramfs"):
            log(f"WARNING: {workdir} is on {ctx['fstype']}: this measures memory, not the disk")
        t = time.perf_counter()
        bench.run()
        log(f"measured in {time.perf_counter() - t:.0f} s")

        def dump(summary):
            with open(args.json, "w") as f:
                json.dump({"args": dict(vars(args)), "context": ctx, "state_dict": bench.sd_info,
                           "summary": summary, "skipped": skipped, "notes": list(dict.fromkeys(bench.notes)),
                           "errors": bench.errors, "drop_caches_error": bench.drop_error,
                           "method_info": bench.method_info, "load_label_of": bench.load_label_of,
                           "records": [r.__dict__ for r in bench.records]},
                          f, indent=1, default=str)

        if args.json:
            dump(None)
        summary = report(bench, ctx, skipped)
        if args.json:
            dump(summary)
            log(f"raw results written to {args.json}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
