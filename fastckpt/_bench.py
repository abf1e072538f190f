"""``fastckpt bench``: measure checkpoint I/O on your own disk, and the measuring pieces the repository's benchmarks share.

Quick mode (``fastckpt bench [DIR] [--size 2G] [--reps 3] [--json PATH]``): in a private
temporary directory inside DIR, fio's O_DIRECT write and read rates (the disk's limit, if fio
is installed), then ``fastckpt.save`` / ``fastckpt.load`` and ``torch.save`` (+fsync) /
``torch.load`` of a synthetic model + AdamW state dict, interleaved, medians of the
repetitions: GB/s, ratio to the disk's limit, CPU-seconds per GB and peak extra RSS.

Knob sweep (``fastckpt bench DIR --tune``): ``fastckpt.save`` + ``fastckpt.load`` under a small
grid of engine settings (backend, buffer size, buffer count, queue depth, I/O threads), then the
best one as ``FASTCKPT_*`` environment lines and a ``fastckpt.knobs.override(...)`` line.

The helpers below (size parsing, CPU and block-device counters, dropping the page cache, the
fio runner, the synthetic state dict, forked children that report time, CPU and peak RSS) are
the one copy that ``benchmarks/*.py`` import as well. Results go to stdout; progress and
diagnostics go to the ``fastckpt.bench`` logger.
"""

import argparse
import contextlib
import datetime
import gc
import json
import logging
import math
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ["add_arguments", "run", "main"]

log = logging.getLogger("fastckpt.bench")

MiB = 1 << 20
GiB = 1 << 30
PAGE = 4096
SEED = 20240611
DEFAULT_SIZE = 2 * GiB
FIO_POINTS: Tuple[Tuple[int, int], ...] = ((1 * MiB, 16), (8 * MiB, 8))  # (block, depth); best = disk limit
JSON_VERSION = 1


class BenchError(Exception):
    """A benchmark that cannot run here (no space, no memory, not a directory): said, not traced."""


# ----------------------------------------------------------------------------- sizes

def parse_size(text: str) -> int:
    """'512M', '1G', '2GiB', '1.5g', '1048576' -> bytes (K/M/G/T are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KkMmGgTt]?)(i?[Bb])?\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 1G, 2GiB, 1048576)")
    mult = {"": 1, "K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}[m.group(2).upper()]
    n = int(float(m.group(1)) * mult)
    if n < 4096:
        raise argparse.ArgumentTypeError(f"size too small: {text!r} (at least 4 KiB)")
    return n


def fmt_size(n: int) -> str:
    """Bytes as the shortest exact K/M/G form (8388608 -> '8M'), else the number."""
    for unit, mult in (("G", GiB), ("M", MiB), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- counters

def cpu_self() -> float:
    """User+system CPU seconds of this process so far (all its threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_children() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_machine() -> float:
    """Busy CPU-seconds of the whole machine so far (all CPUs; idle, iowait and steal excluded)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
        return (user + nice + system + irq + softirq) / _CLK_TCK
    except (OSError, ValueError):
        return float("nan")


def status_kb(field_name: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM, ...), or -1."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def reset_peak_rss() -> Tuple[int, bool]:
    """Reset this process's RSS high-water mark (VmHWM); returns (VmRSS bytes, whether the reset worked)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ok = True
    except OSError:
        ok = False
    return status_kb("VmRSS") * 1024, ok


# ----------------------------------------------------------------------------- the page cache

def drop_caches() -> Optional[str]:
    """Flush dirty data and drop the whole page cache. None on success, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"cannot write /proc/sys/vm/drop_caches: {e.strerror}" + (" (not root)" if os.geteuid() else "")


def evict_file_cache(path: str) -> None:
    """Best effort without privileges: flush a file (or every file under a directory) and ask the
    kernel to drop its cached pages (posix_fadvise DONTNEED; pages mapped by someone stay)."""
    paths = ([os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns] if os.path.isdir(path) else [path])
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def make_cold(path: str) -> Optional[str]:
    """Before a timed read of path: drop the page cache, else evict path's pages. None if the
    whole cache was dropped, else a note saying what was done instead."""
    err = drop_caches()
    if err is None:
        return None
    evict_file_cache(path)
    return f"{err}; evicted the file's pages with posix_fadvise(DONTNEED) instead (best effort)"


# ----------------------------------------------------------------------------- where the files go

def mount_of(path: str) -> Dict[str, str]:
    """The mount (point, fstype, source) that holds path, from /proc/self/mountinfo."""
    real = os.path.realpath(path)
    best = {"mount_point": "?", "fstype": "?", "source": "?"}
    best_len = -1
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mp = left.split()[4].encode().decode("unicode_escape")
                fstype, source = right.split()[:2]
                inside = real == mp or real.startswith(mp.rstrip("/") + "/")
                if inside and len(mp) >= best_len:
                    best, best_len = {"mount_point": mp, "fstype": fstype, "source": source}, len(mp)
    except OSError:
        pass
    return best


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def block_queue_info(source: str) -> Dict[str, str]:
    """A few attributes of the block device behind a mount source (the whole disk if a partition)."""
    if not source.startswith("/dev/"):
        return {}
    try:
        dev = os.path.basename(os.path.realpath(source))
        sysdir = f"/sys/class/block/{dev}"
        if os.path.exists(os.path.join(sysdir, "partition")):
            dev = os.path.basename(os.path.dirname(os.path.realpath(sysdir)))
        q = f"/sys/block/{dev}/queue"
        out = {"device": dev}
        for k in ("scheduler", "rotational", "logical_block_size", "max_sectors_kb", "nr_requests", "write_cache"):
            v = _read(os.path.join(q, k))
            if v is not None:
                out[k] = v
        model = _read(f"/sys/block/{dev}/device/model")
        if model:
            out["model"] = " ".join(x for x in (_read(f"/sys/block/{dev}/device/vendor"), model) if x)
        drv = f"/sys/block/{dev}/device/driver"
        if os.path.exists(drv):
            out["driver"] = os.path.basename(os.path.realpath(drv))
        if os.path.exists(os.path.join(f"/sys/block/{dev}", "size")):
            out["size_gb"] = round(int(_read(f"/sys/block/{dev}/size") or 0) * 512 / 1e9, 1)
        return out
    except (OSError, ValueError):
        return {}


def stat_device(path: str) -> Optional[str]:
    """The block device (sysfs name) whose /stat counts path's I/O, or None."""
    src = mount_of(path)["source"]
    if not src.startswith("/dev/"):
        return None
    dev = os.path.basename(os.path.realpath(src))
    return dev if dev_stat(dev) is not None else None


def dev_stat(dev: Optional[str]) -> Optional[List[int]]:
    """The block device's I/O counters (Documentation/block/stat.rst), or None."""
    if not dev:
        return None
    try:
        with open(f"/sys/class/block/{dev}/stat") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None


def dev_delta(a: Optional[List[int]], b: Optional[List[int]], op: str) -> Dict[str, float]:
    """Requests, mean request size and flushes the device completed between two dev_stat()s."""
    if not a or not b:
        return {}
    ios, sectors = (0, 2) if op == "read" else (4, 6)
    n = b[ios] - a[ios]
    out = {"requests": n, "kib_per_request": (b[sectors] - a[sectors]) * 512 / 1024 / n if n else float("nan")}
    if len(a) >= 17:
        out["flushes"] = b[15] - a[15]
    return out


def fastckpt_version() -> str:
    """fastckpt's version, with ``git describe`` when it runs from a checkout."""
    from . import __version__
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.exists(os.path.join(os.path.dirname(here), ".git")):
        try:
            g = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
            if g:
                return f"{__version__} ({g})"
        except (OSError, subprocess.SubprocessError):
            pass
    return __version__


def machine_info(path: str, fio: Optional[str] = None) -> Dict[str, Any]:
    """What a reader needs to judge figures measured in path: CPUs, memory, kernel, filesystem, device, versions."""
    ctx: Dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                           "kernel": platform.release(), "nproc": os.cpu_count(),
                           "cpus_usable": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                           "torch": torch.__version__, "fastckpt": fastckpt_version()}
    try:
        with open("/proc/cpuinfo") as f:
            ctx["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            mem = dict(l.split(":", 1) for l in f if ":" in l)
        ctx["mem_total_gb"] = round(int(mem["MemTotal"].split()[0]) * 1024 / 1e9, 1)
        ctx["mem_available_gb"] = round(int(mem["MemAvailable"].split()[0]) * 1024 / 1e9, 1)
    except (OSError, KeyError, ValueError):
        pass
    virt = " ".join(x for x in (_read("/sys/class/dmi/id/sys_vendor"), _read("/sys/class/dmi/id/product_name"))
                    if x)
    if virt:
        ctx["system"] = virt
    try:
        ctx["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    m = mount_of(path)
    ctx.update(dir=os.path.abspath(path), fstype=m["fstype"], mount=m, block=block_queue_info(m["source"]))
    if fio:
        try:
            ctx["fio"] = subprocess.run([fio, "--version"], capture_output=True, text=True,
                                        timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            ctx["fio"] = "?"
    return ctx


def describe_machine(ctx: Dict[str, Any]) -> List[str]:
    """machine_info() as a few human lines."""
    blk = ctx.get("block") or {}
    dev = ctx["mount"]["source"]
    if blk:
        extras = [x for x in (blk.get("model"), blk.get("driver"),
                              f"{blk['size_gb']} GB" if blk.get("size_gb") else None,
                              "rotational" if blk.get("rotational") == "1" else None,
                              f"scheduler {blk['scheduler']}" if blk.get("scheduler") else None,
                              f"write cache {blk['write_cache']}" if blk.get("write_cache") else None) if x]
        dev += f" ({', '.join(extras)})" if extras else ""
    lines = [f"{ctx['nproc']} CPUs ({ctx.get('cpus_usable', '?')} usable, {ctx.get('cpu', '?')}), "
             f"{ctx.get('mem_total_gb', '?')} GB RAM, Linux {ctx['kernel']}"
             + (f", {ctx['system']}" if ctx.get("system") else "")
             + (f"; load average {ctx['load_avg'][0]} at the start" if ctx.get("load_avg") else ""),
             f"{ctx['dir']}: {ctx['fstype']} on {dev}",
             f"torch {ctx['torch']}, fastckpt {ctx['fastckpt']}, Python {ctx['python']}"
             + (f", {ctx['fio']}" if ctx.get("fio") else "") + f"; {ctx['date']}"]
    return lines


# ----------------------------------------------------------------------------- fio

def find_fio() -> Optional[str]:
    return shutil.which("fio")


FIO_MISSING = "fio is not installed (Debian/Ubuntu: apt install fio): no disk limit, no ratio to it"


def run_fio(fio: str, path: str, size: int, op: str, bs: int, qd: int, *, fixedbufs: bool = True,
            dev: Optional[str] = None) -> Dict[str, Any]:
    """One fio job on ``path``: O_DIRECT, io_uring, ``--rw=write --end_fsync=1`` (its runtime includes
    the final fsync) or ``--rw=read`` (the caller makes the cache cold; O_DIRECT bypasses it anyway).

    Returns bytes, seconds, gbps, cpu_s (fio's own usr+sys), machine_cpu_s and extra. A failure of
    ``--fixedbufs=1`` (registered buffers need RLIMIT_MEMLOCK) is retried without it and said in
    ``extra['fixedbufs_error']``.
    """
    cmd = [fio, "--name=fastckpt-bench", f"--filename={path}", f"--size={size}", f"--bs={bs}",
           f"--iodepth={qd}", "--direct=1", "--ioengine=io_uring", "--output-format=json"]
    cmd += ["--rw=write", "--end_fsync=1"] if op == "write" else ["--rw=read"]
    if fixedbufs:
        cmd.append("--fixedbufs=1")
    d0, m0, ch0, t0 = dev_stat(dev), cpu_machine(), cpu_children(), time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t1, ch1, m1, d1 = time.perf_counter(), cpu_children(), cpu_machine(), dev_stat(dev)
    if p.returncode != 0 and fixedbufs:
        r = run_fio(fio, path, size, op, bs, qd, fixedbufs=False, dev=dev)
        r["extra"]["fixedbufs_error"] = p.stderr.strip()[-200:]
        return r
    if p.returncode != 0:
        raise RuntimeError(f"fio failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr.strip()}")
    out = p.stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio reported error {job['error']}: {' '.join(cmd)}")
    d = job[op]
    sec = d["runtime"] / 1e3  # ms; for writes it includes --end_fsync (unlike fsync_on_close)
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1e3
    return {"bytes": d["io_bytes"], "seconds": sec, "gbps": d["io_bytes"] / sec / 1e9, "cpu_s": cpu,
            "machine_cpu_s": m1 - m0,
            "extra": {"dev": dev_delta(d0, d1, op), "wall": t1 - t0, "children_cpu": ch1 - ch0,
                      "usr_cpu_pct": job["usr_cpu"], "sys_cpu_pct": job["sys_cpu"],
                      "job_runtime_ms": job["job_runtime"], "bw_bytes": d["bw_bytes"],
                      "fixedbufs": fixedbufs, "cmd": " ".join(cmd)}}


def fio_size(payload: int, points: Sequence[Tuple[int, int]] = FIO_POINTS) -> int:
    """The payload rounded up to whole fio blocks of every point (fio moves whole blocks only)."""
    unit = math.lcm(MiB, *(bs for bs, _ in points))
    return -(-payload // unit) * unit


# ----------------------------------------------------------------------------- the state dict

def build_state_dict(total: int, seed: int = SEED) -> Dict[str, Any]:
    """A model + AdamW state dict of about ``total`` bytes of tensors (fixed seed, fully touched)::

        {"model": {name: tensor}, "optimizer": {"state": {i: {"step", "exp_avg", "exp_avg_sq"}},
         "param_groups": [{..., "params": [0..n-1]}]}, "step": int}

    AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype and shape, so the parameters take
    about a third of the bytes: three large ones (64-128 MiB each at 2 GiB, scaled with the size)
    and 24 transformer-like layers of 12 parameters, alternately float32 and bfloat16 (about a
    thousand tensors in all, most of them small).
    """
    scale = total / (2 * GiB)
    g = torch.Generator().manual_seed(seed)
    specs: List[Tuple[str, torch.dtype, Tuple[int, ...]]] = []
    cols = 1024
    big = [("embed_tokens.weight", torch.float32, 128), ("lm_head.weight", torch.bfloat16, 64),
           ("vision_proj.weight", torch.float32, 96)]
    big_bytes = 0
    for name, dt, mib in big:
        elt = torch.empty((), dtype=dt).element_size()
        rows = max(1, int(mib * MiB * scale) // (elt * cols))
        specs.append((name, dt, (rows, cols)))
        big_bytes += 3 * rows * cols * elt
    layers = 24
    per_layer = max(0, total - big_bytes) / 3 / layers  # parameter bytes per layer
    # 12 h^2 elements of matrices per layer, half the layers float32 (4 B), half bfloat16 (2 B)
    h = max(16, int(math.sqrt(per_layer / (12 * 3))) // 16 * 16)
    for i in range(layers):
        dt = torch.float32 if i % 2 == 0 else torch.bfloat16
        p = f"layers.{i}."
        specs += [(p + "attn.qkv.weight", dt, (3 * h, h)), (p + "attn.qkv.bias", dt, (3 * h,)),
                  (p + "attn.out.weight", dt, (h, h)), (p + "attn.out.bias", dt, (h,)),
                  (p + "mlp.fc1.weight", dt, (4 * h, h)), (p + "mlp.fc1.bias", dt, (4 * h,)),
                  (p + "mlp.fc2.weight", dt, (h, 4 * h)), (p + "mlp.fc2.bias", dt, (h,)),
                  (p + "ln1.weight", torch.float32, (h,)), (p + "ln1.bias", torch.float32, (h,)),
                  (p + "ln2.weight", torch.float32, (h,)), (p + "ln2.bias", torch.float32, (h,))]
    specs += [("final_ln.weight", torch.float32, (h,)), ("final_ln.bias", torch.float32, (h,))]

    model: Dict[str, torch.Tensor] = {}
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    for i, (name, dt, shape) in enumerate(specs):
        model[name] = torch.randn(shape, generator=g, dtype=dt)
        avg = torch.randn(shape, generator=g, dtype=dt).mul_(1e-3)
        sq = torch.randn(shape, generator=g, dtype=dt).square_().mul_(1e-6)
        state[i] = {"step": torch.tensor(1000.0), "exp_avg": avg, "exp_avg_sq": sq}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
               "fused": None, "decoupled_weight_decay": True, "params": list(range(len(specs)))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "step": 1000}


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def payload_bytes(obj: Any) -> int:
    return sum(t.nbytes for t in iter_tensors(obj))


def describe_sd(sd: Any) -> Dict[str, Any]:
    ts = list(iter_tensors(sd))
    sizes = sorted((t.nbytes for t in ts), reverse=True)
    by_dtype: Dict[str, int] = {}
    for t in ts:
        k = str(t.dtype).replace("torch.", "")
        by_dtype[k] = by_dtype.get(k, 0) + t.nbytes
    return {"tensors": len(ts), "bytes": sum(sizes), "largest_mib": [round(s / MiB, 1) for s in sizes[:9]],
            "at_least_64mib": sum(1 for s in sizes if s >= 64 * MiB),
            "under_1mib": sum(1 for s in sizes if s < MiB), "bytes_by_dtype": by_dtype}


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


def compare(a: Any, b: Any, path: str = "", out: Optional[List[str]] = None) -> List[str]:
    """Differences between the original ``a`` and the loaded ``b`` (at most 5 reported)."""
    out = [] if out is None else out
    if len(out) >= 5:
        return out
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            out.append(f"{path}: {type(b).__name__} instead of a tensor")
        elif a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{path}: {b.dtype}{list(b.shape)} instead of {a.dtype}{list(a.shape)}")
        elif b.device.type != "cpu":
            out.append(f"{path}: on {b.device}")
        elif not torch.equal(a, b):
            out.append(f"{path}: values differ")
    elif isinstance(a, dict):
        if not isinstance(b, dict):
            out.append(f"{path}: {type(b).__name__} instead of dict")
        elif list(a.keys()) != list(b.keys()):
            ka, kb = set(a), set(b)
            out.append(f"{path}: keys differ (missing {sorted(map(repr, ka - kb))[:3]}, "
                       f"extra {sorted(map(repr, kb - ka))[:3]})" if ka != kb else f"{path}: key order differs")
        else:
            for k in a:
                compare(a[k], b[k], f"{path}.{k}" if path else str(k), out)
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            out.append(f"{path}: {type(b).__name__}[{len(b) if hasattr(b, '__len__') else '?'}] instead of "
                       f"{type(a).__name__}[{len(a)}]")
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                compare(x, y, f"{path}.{i}", out)
    elif type(a) is not type(b) or a != b:
        out.append(f"{path}: {b!r} instead of {a!r}")
    return out


def touch_pages(sd: Any) -> int:
    """Read one byte of every 4 KiB page of every tensor (makes lazily mapped results resident)."""
    s = 0
    for t in iter_tensors(sd):
        if t.numel():
            b = t.reshape(-1).view(torch.uint8)
            s += int(b[::PAGE].sum()) + int(b[-1])
    return s


# ----------------------------------------------------------------------------- files

def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def path_bytes(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path) if os.path.exists(path) else 0


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


# ----------------------------------------------------------------------------- forked children

_parent_engines: List[Any] = []  # a child's inherited engines: kept, never used nor destroyed


def _detach_from_parent() -> None:
    """In a forked child: never touch the parent's engines. Their worker threads do not exist here
    (destroying one would wait for them forever) and an io_uring ring's registered buffers are the
    parent's pages, so the child gets engines of its own on first use."""
    from . import engine as _engine
    _parent_engines.extend(_engine._engines.values())
    _engine._engines.clear()


def run_in_child(fn: Callable[[], Dict[str, Any]], threads: int, timeout_s: int) -> Dict[str, Any]:
    """Run fn in a process forked from this one (sharing its memory copy-on-write, e.g. a state dict
    built once); returns fn's dict (JSON round trip), or {'error': ...}; adds child_cpu_total_s.

    torch's intra-op pool does not survive fork(): a parent that may have used it must pass
    threads=1 (the children then never enter an OpenMP region).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(timeout_s)
            _detach_from_parent()
            torch.set_num_threads(threads)
            out = fn()
        except BaseException as e:  # noqa: BLE001
            out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            code = 1
        try:
            data = json.dumps(out, default=str).encode()
            with os.fdopen(w, "wb") as f:
                f.write(data)
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status, ru = os.wait4(pid, 0)
    try:
        out = json.loads(data) if data else {}
    except ValueError:
        out = {}
    if not out:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        out = {"error": f"child died (status {status}" + (f", signal {sig}" if sig else "") + ")"
               + (" - timed out" if sig == signal.SIGALRM else "")}
    out["child_cpu_total_s"] = ru.ru_utime + ru.ru_stime
    return out


def timed(op: Callable[[], Any], dev: Optional[str] = None) -> Tuple[Dict[str, Any], Any]:
    """Run op with the garbage collector off: ({seconds, cpu_s, machine_cpu_s}, (result, dev0, dev1))."""
    gc.collect()
    gc.disable()
    try:
        d0, m0, c0, t0 = dev_stat(dev), cpu_machine(), cpu_self(), time.perf_counter()
        result = op()
        t1, c1, m1, d1 = time.perf_counter(), cpu_self(), cpu_machine(), dev_stat(dev)
    finally:
        gc.enable()
    return {"seconds": t1 - t0, "cpu_s": c1 - c0, "machine_cpu_s": m1 - m0}, (result, d0, d1)


# ----------------------------------------------------------------------------- fastckpt bench (quick)

def _fc():
    import fastckpt
    return fastckpt


def _torch_save(sd: Any, path: str) -> None:
    torch.save(sd, path)
    fsync_path(path)
    fsync_dir(os.path.dirname(path))


METHODS: Dict[str, Dict[str, Any]] = {
    "fastckpt": {"save_label": "fastckpt.save", "load_label": "fastckpt.load",
                 "save": lambda sd, p: _fc().save(sd, p),
                 "load": lambda p: _fc().load(p, map_location="cpu", weights_only=True)},
    "torch": {"save_label": "torch.save+fsync", "load_label": "torch.load",
              "save": _torch_save, "load": lambda p: torch.load(p, map_location="cpu", weights_only=True)},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fastckpt bench`` (and of ``python -m fastckpt._bench``)."""
    parser.add_argument("dir", nargs="?", default=".", metavar="DIR",
                        help="a directory on the disk to measure (default: the current one); the files go to a "
                             "private .fastckpt-bench-* directory inside it, removed at the end")
    parser.add_argument("--size", type=parse_size, default=DEFAULT_SIZE, metavar="SIZE",
                        help="bytes of tensors in the state dict, K/M/G suffixes (default 2G)")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions, interleaved; medians are reported (default 3; --tune: 2)")
    parser.add_argument("--json", metavar="PATH", nargs="?", const="-",
                        help="JSON on stdout instead of the table; --json PATH: the table, and the JSON written "
                             "to PATH (put DIR before --json)")
    parser.add_argument("--tune", action="store_true",
                        help="sweep the engine's knobs (backend, buffer size and count, queue depth, I/O threads) "
                             "with fastckpt.save + load and print the best as FASTCKPT_* lines; about 12 "
                             "configurations x 2 reps, 2-3 minutes at 2G on a 2.5 GB/s disk")
    parser.add_argument("--grid", metavar="SPEC",
                        help="--tune configurations, comma-separated BACKEND:BUFFER_SIZE:BUFFER_COUNT:QUEUE_DEPTH"
                             "[:IO_THREADS], e.g. uring:8M:8:8,threads:8M:8:8:4 (default: a built-in grid of 12)")
    parser.add_argument("--no-fio", action="store_true", help="do not run fio (no disk limit, no ratio)")
    parser.add_argument("--no-torch", action="store_true", help="quick mode: skip torch.save / torch.load")
    try:
        parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    except argparse.ArgumentError:
        pass  # the fastckpt command's common -q/--quiet


@contextlib.contextmanager
def _progress(quiet: bool) -> Iterator[None]:
    """Progress lines (and warnings) of the fastckpt.bench logger on stderr, plain, for the duration of a run;
    not also through the handlers of the loggers above it (the fastckpt command's would prefix every line)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level, old_propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        log.propagate = old_propagate


@contextlib.contextmanager
def _single_threaded_parent() -> Iterator[None]:
    """The parent builds the state dict and forks children: keep it out of torch's OpenMP pool."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def _workspace(parent: str, disk_need: int, mem_need: int) -> Iterator[str]:
    parent = os.path.abspath(parent)
    if not os.path.isdir(parent):
        raise BenchError(f"{parent}: not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BenchError(f"{parent}: not writable")
    free = shutil.disk_usage(parent).free
    if free < disk_need:
        raise BenchError(f"not enough free space in {parent}: {free / 1e9:.1f} GB free, about "
                         f"{disk_need / 1e9:.1f} GB needed; use a smaller --size")
    try:
        with open("/proc/meminfo") as f:
            avail = int(next(l for l in f if l.startswith("MemAvailable")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        avail = None
    if avail is not None and mem_need > 0.9 * avail:
        raise BenchError(f"not enough memory: about {mem_need / 1e9:.1f} GB needed, {avail / 1e9:.1f} GB "
                         f"available; use a smaller --size")
    work = tempfile.mkdtemp(prefix=".fastckpt-bench-", dir=parent)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build(size: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    log.info("building the state dict (%.2f GB of tensors, seed %d) ...", size / 1e9, SEED)
    t = time.perf_counter()
    sd = build_state_dict(size)
    touch_pages(sd)
    info = describe_sd(sd)
    info["build_s"] = round(time.perf_counter() - t, 2)
    log.info("  %d tensors, %.3f GB, in %.1f s", info["tensors"], info["bytes"] / 1e9, info["build_s"])
    return sd, info


_TINY = {"model": {"w": torch.ones(256, 64)}, "step": 1}


class _Quick:
    """The quick benchmark: fio, then each method's save and cold load in forked children."""

    def __init__(self, args: argparse.Namespace, work: str, sd: Any, fio: Optional[str]):
        self.args, self.work, self.sd, self.fio = args, work, sd, fio
        self.payload = payload_bytes(sd)
        self.dev = stat_device(work)
        self.records: List[Dict[str, Any]] = []
        self.notes: List[str] = []
        self.errors: List[str] = []
        self.cache_note: Optional[str] = None
        self.fio_size = fio_size(self.payload)

    def _cold(self, path: str) -> None:
        note = make_cold(path)
        if note and self.cache_note is None:
            self.cache_note = note
            log.warning("page cache: %s; load figures may be partly from the cache", note)

    def add(self, rec: Dict[str, Any]) -> None:
        self.records.append(rec)
        rss = f"  rss +{rec['rss_extra'] / MiB:.0f} MiB" if rec.get("rss_extra") is not None else ""
        log.info("  rep %d  %-20s %-4s %6.2f GB/s  %6.2f s  cpu %.3f s/GB%s", rec["rep"] + 1, rec["label"],
                 rec["op"], rec["gbps"], rec["seconds"], rec["cpu_s"] / (rec["bytes"] / 1e9), rss)

    def run_fio_point(self, bs: int, qd: int, rep: int) -> None:
        path = os.path.join(self.work, "fio.bin")
        try:
            for op in ("write", "read"):
                if op == "read":
                    self._cold(path)
                r = run_fio(self.fio, path, self.fio_size, op, bs, qd, dev=self.dev)
                if r["extra"].get("fixedbufs_error"):
                    self.notes.append(f"fio --fixedbufs=1 failed, ran without: {r['extra']['fixedbufs_error']}")
                self.add({"method": "fio", "label": f"fio bs={fmt_size(bs)} qd={qd}",
                          "op": "save" if op == "write" else "load", "rep": rep, "bytes": r["bytes"],
                          "seconds": r["seconds"], "gbps": r["gbps"], "cpu_s": r["cpu_s"],
                          "machine_cpu_s": r["machine_cpu_s"], "rss_extra": None})
        finally:
            remove(path)

    def _child_save(self, m: Dict[str, Any], path: str) -> Dict[str, Any]:
        base, reset_ok = reset_peak_rss()
        warm = os.path.join(self.work, f"warmup-{os.getpid()}")
        m["save"](_TINY, warm)  # untimed: engine, staging pool (what a trainer did long before)
        m["load"](warm)
        remove(warm)
        os.sync()
        t, _ = timed(lambda: m["save"](self.sd, path), self.dev)
        return dict(t, rss_extra=status_kb("VmHWM") * 1024 - base, reset_ok=reset_ok)

    def _child_load(self, m: Dict[str, Any], path: str, verify: bool) -> Dict[str, Any]:
        base, reset_ok = reset_peak_rss()
        warm = os.path.join(self.work, f"warmup-{os.getpid()}")
        m["save"](_TINY, warm)
        m["load"](warm)
        remove(warm)
        note = make_cold(path)
        t, (res, _, _) = timed(lambda: (lambda sd: (sd, touch_pages(sd)))(m["load"](path)), self.dev)
        out = dict(t, rss_extra=status_kb("VmHWM") * 1024 - base, reset_ok=reset_ok, cache_note=note)
        if verify:
            out["diffs"] = compare(self.sd, res[0])
        return out

    def _record(self, key: str, op: str, rep: int, out: Dict[str, Any]) -> bool:
        label = METHODS[key][f"{op}_label"]
        if "error" in out:
            msg = f"{label} (rep {rep + 1}) FAILED: {out['error']}"
            self.errors.append(msg)
            log.error("%s%s", msg, "\n" + out["traceback"] if "traceback" in out else "")
            return False
        if out.get("cache_note") and self.cache_note is None:
            self.cache_note = out["cache_note"]
            log.warning("page cache: %s; load figures may be partly from the cache", out["cache_note"])
        if not out.get("reset_ok", True):
            self.notes.append("could not reset the RSS high-water mark (/proc/self/clear_refs): peak RSS is "
                              "VmHWM since the fork")
        if out.get("diffs"):
            self.errors.append(f"{label}: DATA MISMATCH after rep {rep + 1}: {out['diffs']}")
        rec = {"method": key, "label": label, "op": op, "rep": rep, "bytes": self.payload,
               "seconds": out["seconds"], "gbps": self.payload / out["seconds"] / 1e9, "cpu_s": out["cpu_s"],
               "machine_cpu_s": out["machine_cpu_s"], "rss_extra": out["rss_extra"]}
        if "diffs" in out:
            rec["verified"] = not out["diffs"]
        self.add(rec)
        return True

    def run_method(self, key: str, rep: int) -> None:
        m = METHODS[key]
        path = os.path.join(self.work, f"ckpt-{key}.pt")
        remove(path)
        drop_caches()  # earlier writes flushed: every save starts from the same state
        timeout = max(600, int(self.payload / 20e6))  # 20 MB/s would be a stuck disk
        out = run_in_child(lambda: self._child_save(m, path), 1, timeout)
        if self._record(key, "save", rep, out):
            out = run_in_child(lambda: self._child_load(m, path, verify=(rep == 0)), 1, timeout)
            self._record(key, "load", rep, out)
        remove(path)
        for n in os.listdir(self.work):  # a failed save's temporary file
            if n.startswith("."):
                remove(os.path.join(self.work, n))

    def run(self) -> None:
        order: List[Any] = list(FIO_POINTS) if self.fio else []
        keys = ["fastckpt"] + ([] if self.args.no_torch else ["torch"])
        # fio between the methods: F M F M ...; reversed on odd repetitions
        seq: List[Any] = []
        for i, k in enumerate(keys):
            if i < len(order):
                seq.append(order[i])
            seq.append(k)
        seq += order[len(keys):]
        for rep in range(self.args.reps):
            t = time.perf_counter()
            s = seq if rep % 2 == 0 else list(reversed(seq))
            log.info("repetition %d/%d", rep + 1, self.args.reps)
            for x in s:
                if isinstance(x, tuple):
                    self.run_fio_point(x[0], x[1], rep)
                else:
                    self.run_method(x, rep)
            if rep == 0 and self.args.reps > 1:
                log.info("  (%.0f s per repetition; about %.0f s to go)", time.perf_counter() - t,
                         (time.perf_counter() - t) * (self.args.reps - 1))

    def summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for op in ("save", "load"):
            recs = [r for r in self.records if r["op"] == op]
            fio_labels = list(dict.fromkeys(r["label"] for r in recs if r["method"] == "fio"))
            fio_meds = {l: median([r["gbps"] for r in recs if r["label"] == l]) for l in fio_labels}
            disk = max(fio_meds.values()) if fio_meds else None
            fio_by_rep: Dict[int, float] = {}
            for r in recs:
                if r["method"] == "fio":
                    fio_by_rep[r["rep"]] = max(fio_by_rep.get(r["rep"], 0.0), r["gbps"])
            rows = []
            if disk is not None:
                best = max(fio_meds, key=fio_meds.get)
                rs = [r for r in recs if r["label"] == best]
                rows.append(self._row("disk", f"disk (fio O_DIRECT {'write' if op == 'save' else 'read'}, {best[4:]})",
                                      rs, disk, fio_by_rep))
            for key in METHODS:
                rs = [r for r in recs if r["method"] == key]
                if rs:
                    rows.append(self._row(key, rs[0]["label"], rs, disk, fio_by_rep))
            out[op] = rows
            out[f"disk_{op}_gbps"] = disk
        return out

    @staticmethod
    def _row(key: str, label: str, rs: List[Dict[str, Any]], disk: Optional[float],
             fio_by_rep: Dict[int, float]) -> Dict[str, Any]:
        g = [r["gbps"] for r in rs]
        med = median(g)
        rss = [r["rss_extra"] / MiB for r in rs if r.get("rss_extra") is not None]
        v = [r["verified"] for r in rs if "verified" in r]
        return {"method": key, "label": label, "n": len(rs), "gbps": med, "gbps_min": min(g), "gbps_max": max(g),
                "x_disk": med / disk if disk else None,
                "x_disk_paired": median([r["gbps"] / fio_by_rep[r["rep"]] for r in rs if r["rep"] in fio_by_rep])
                if fio_by_rep else None,
                "cpu_s_per_gb": median([r["cpu_s"] / (r["bytes"] / 1e9) for r in rs]),
                "machine_cpu_s_per_gb": median([r["machine_cpu_s"] / (r["bytes"] / 1e9) for r in rs]),
                "peak_rss_mb": median(rss) if rss else None,
                "verified": (all(v) if v else None)}


def _f(x: Optional[float], fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)


def _md_table(header: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return out


def _quick(args: argparse.Namespace) -> Tuple[int, Dict[str, Any]]:
    fio = None if args.no_fio else find_fio()
    notes: List[str] = []
    if not args.no_fio and fio is None:
        notes.append(FIO_MISSING)
        log.warning("%s", FIO_MISSING)
    if fio and ":" in os.path.abspath(args.dir):
        notes.append("fio not run: the directory's path contains ':' (fio's file-name separator)")
        fio = None
    size = args.size
    with _workspace(args.dir, int(1.1 * size) + 256 * MiB, int(2.3 * size) + 512 * MiB) as work, \
            _single_threaded_parent():
        ctx = machine_info(work, fio)
        ctx["dir"] = os.path.abspath(args.dir)
        if ctx["fstype"] in ("tmpfs", "ramfs"):
            notes.append(f"{ctx['dir']} is on {ctx['fstype']}: this measures memory, not a disk")
            log.warning("%s", notes[-1])
        sd, sd_info = _build(size)
        q = _Quick(args, work, sd, fio)
        q.notes += notes
        t = time.perf_counter()
        q.run()
        seconds = time.perf_counter() - t
    summ = q.summary()
    result = {"kind": "fastckpt-bench", "version": JSON_VERSION, "machine": ctx, "state_dict": sd_info,
              "args": {"dir": ctx["dir"], "size": size, "reps": args.reps, "fio": bool(fio)},
              "cache": q.cache_note or "dropped before every load (echo 3 > /proc/sys/vm/drop_caches)",
              "children_torch_threads": 1, "seconds": round(seconds, 1), "summary": summ,
              "notes": list(dict.fromkeys(q.notes)), "errors": q.errors, "records": q.records}
    return (1 if q.errors else 0), result


def _print_quick(res: Dict[str, Any]) -> None:
    sd, a = res["state_dict"], res["args"]
    print(f"fastckpt bench: {sd['bytes'] / 1e9:.2f} GB state dict ({sd['tensors']} tensors, model + AdamW), "
          f"{a['reps']} repetition{'s' if a['reps'] != 1 else ''} interleaved, medians ({res['seconds']:.0f} s)")
    for line in describe_machine(res["machine"]):
        print(f"  {line}")
    print(f"  saves durable; page cache before each load: {res['cache']}")
    print()
    rows = []
    for op in ("save", "load"):
        for r in res["summary"][op]:
            rows.append([op, r["label"], f"{r['gbps']:.2f}", _f(r["x_disk"], ".2f"), _f(r["cpu_s_per_gb"], ".3f"),
                         _f(r["peak_rss_mb"], ".0f")])
    for line in _md_table(["op", "method", "GB/s", "x disk", "CPU-s/GB", "peak extra RSS MB"], rows):
        print(line)
    by = {(op, r["method"]): r for op in ("save", "load") for r in res["summary"][op]}
    print()
    for op in ("save", "load"):
        f, t, d = by.get((op, "fastckpt")), by.get((op, "torch")), by.get((op, "disk"))
        if f is None:
            continue
        parts = []
        if t is not None:
            parts.append(f"{f['gbps'] / t['gbps']:.2f} x {t['label']}")
        if d is not None:
            parts.append(f"{f['x_disk']:.2f} x the disk's limit (paired by repetition: {f['x_disk_paired']:.2f})")
        if parts:
            print(f"{f['label']}: " + ", ".join(parts))
    for n in res["notes"]:
        print(f"note: {n}")
    for e in res["errors"]:
        print(f"ERROR: {e}")


# ----------------------------------------------------------------------------- fastckpt bench --tune

# backend, buffer_size, buffer_count, queue_depth, io_threads (the thread backend's workers)
DEFAULT_GRID = ("uring:8M:8:8", "uring:1M:32:32", "uring:2M:32:32", "uring:4M:16:16", "uring:8M:16:16",
                "uring:8M:16:8", "uring:16M:8:8", "uring:16M:4:4", "uring:32M:8:8",
                "threads:8M:8:8:4", "threads:8M:8:8:8", "threads:16M:8:8:2")
TUNED = ("backend", "buffer_size", "buffer_count", "queue_depth", "io_threads")
ENV = {"backend": "FASTCKPT_BACKEND", "buffer_size": "FASTCKPT_BUFFER_SIZE", "buffer_count": "FASTCKPT_BUFFER_COUNT",
       "queue_depth": "FASTCKPT_QUEUE_DEPTH", "io_threads": "FASTCKPT_IO_THREADS"}


def parse_grid(spec: str) -> List[Dict[str, Any]]:
    """'uring:8M:8:8,threads:8M:8:8:4' -> [{backend, buffer_size, buffer_count, queue_depth[, io_threads]}]."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (4, 5) or parts[0] not in ("uring", "threads", "auto"):
            raise argparse.ArgumentTypeError(f"--grid: {item!r} is not BACKEND:BUFFER_SIZE:BUFFER_COUNT:QUEUE_DEPTH"
                                             "[:IO_THREADS] (BACKEND uring, threads or auto)")
        try:
            cfg = {"backend": parts[0], "buffer_size": parse_size(parts[1]), "buffer_count": int(parts[2]),
                   "queue_depth": int(parts[3])}
            if len(parts) == 5:
                cfg["io_threads"] = int(parts[4])
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--grid: {item!r}: {e}") from None
        out.append(cfg)
    if not out:
        raise argparse.ArgumentTypeError("--grid: no configuration")
    return out


def _knobs_label(cfg: Dict[str, Any]) -> str:
    s = f"{cfg['backend']} {fmt_size(cfg['buffer_size'])} x {cfg['buffer_count']} buffers, depth {cfg['queue_depth']}"
    if "io_threads" in cfg:
        s += f", {cfg['io_threads']} threads"
    return s


def _env_lines(cfg: Dict[str, Any]) -> List[str]:
    return [f"export {ENV[k]}={fmt_size(v) if k == 'buffer_size' else v}" for k, v in cfg.items() if k in ENV]


def _override_line(cfg: Dict[str, Any]) -> str:
    def val(k, v):
        if k == "backend":
            return json.dumps(v)
        if k == "buffer_size" and v % MiB == 0:
            return f"{v // MiB} << 20"
        return str(v)
    return "fastckpt.knobs.override(" + ", ".join(f"{k}={val(k, v)}" for k, v in cfg.items() if k in ENV) + ")"


def _current_knobs() -> Dict[str, Any]:
    d = _fc().knobs.as_dict()
    cfg = {k: d[k] for k in TUNED}
    cfg["backend"] = str(cfg["backend"]).split(".")[-1].lower()
    if cfg["backend"] != "threads":
        cfg.pop("io_threads")
    return cfg


def _same_knobs(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    norm = lambda c: {k: v for k, v in c.items() if k != "io_threads" or c["backend"] == "threads"}  # noqa: E731
    ba, bb = a["backend"], b["backend"]
    return norm(dict(a, backend="uring" if ba == "auto" else ba)) == norm(dict(b, backend="uring" if bb == "auto" else bb))


def _tune(args: argparse.Namespace) -> Tuple[int, Dict[str, Any]]:
    fc = _fc()
    grid = parse_grid(args.grid) if args.grid else parse_grid(",".join(DEFAULT_GRID))
    current = _current_knobs()
    if not any(_same_knobs(c, current) for c in grid):
        grid.insert(0, current)
    fio = None if args.no_fio or ":" in os.path.abspath(args.dir) else find_fio()
    notes: List[str] = []
    if not args.no_fio and fio is None:
        notes.append(FIO_MISSING)
        log.warning("%s", FIO_MISSING)
    size = args.size
    biggest_pool = max(c["buffer_size"] * c["buffer_count"] for c in grid)
    t_all = time.perf_counter()
    with _workspace(args.dir, int(1.1 * size) + 256 * MiB, int(2.3 * size) + biggest_pool + 512 * MiB) as work, \
            _single_threaded_parent():
        ctx = machine_info(work, fio)
        ctx["dir"] = os.path.abspath(args.dir)
        dev = stat_device(work)
        sd, sd_info = _build(size)
        payload = sd_info["bytes"]
        results = [{"knobs": c, "save": [], "load": [], "save_cpu": [], "load_cpu": [], "error": None} for c in grid]
        disk: Dict[str, List[float]] = {"save": [], "load": []}
        cache_note: Optional[str] = None
        path = os.path.join(work, "ckpt.pt")
        fsize = fio_size(payload, FIO_POINTS[1:])
        log.info("knob sweep: %d configurations x %d repetitions at %.2f GB", len(grid), args.reps, payload / 1e9)
        for rep in range(args.reps):
            t_rep = time.perf_counter()
            order = list(range(len(grid))) if rep % 2 == 0 else list(reversed(range(len(grid))))
            if fio:  # the disk's limit at the middle of every repetition (fio's 8M qd8 point)
                order.insert(len(order) // 2, -1)
            log.info("repetition %d/%d", rep + 1, args.reps)
            for i in order:
                if i < 0:
                    fpath = os.path.join(work, "fio.bin")
                    try:
                        w = run_fio(fio, fpath, fsize, "write", FIO_POINTS[1][0], FIO_POINTS[1][1], dev=dev)
                        make_cold(fpath)
                        r = run_fio(fio, fpath, fsize, "read", FIO_POINTS[1][0], FIO_POINTS[1][1], dev=dev)
                    finally:
                        remove(fpath)
                    disk["save"].append(w["gbps"])
                    disk["load"].append(r["gbps"])
                    log.info("  rep %d  %-44s save %5.2f GB/s  load %5.2f GB/s", rep + 1, "disk (fio 8M qd8)",
                             w["gbps"], r["gbps"])
                    continue
                res = results[i]
                if res["error"]:
                    continue
                cfg = res["knobs"]
                try:
                    fc.reset_engine()
                    with fc.knobs.override(**cfg):
                        eng = fc.get_engine()
                        if cfg["backend"] == "uring" and eng.backend != "io_uring":
                            raise OSError(f"io_uring not used ({eng.uring_refusal or eng.backend})")
                        warm = os.path.join(work, "warmup.pt")
                        fc.save(_TINY, warm)
                        fc.load(warm)
                        remove(warm)
                        drop_caches()
                        ts, _ = timed(lambda: fc.save(sd, path), dev)
                        note = make_cold(path)
                        cache_note = cache_note or note
                        tl, (loaded, _, _) = timed(lambda: (lambda x: (x, touch_pages(x)))(fc.load(path)), dev)
                        if rep == 0:
                            diffs = compare(sd, loaded[0])
                            if diffs:
                                raise RuntimeError(f"DATA MISMATCH after the load: {diffs}")
                        del loaded
                except Exception as e:  # noqa: BLE001  (a configuration this machine refuses: said, skipped)
                    res["error"] = f"{type(e).__name__}: {e}"
                    log.warning("  %s: %s", _knobs_label(cfg), res["error"])
                    continue
                finally:
                    fc.reset_engine()
                    remove(path)
                res["save"].append(payload / ts["seconds"] / 1e9)
                res["load"].append(payload / tl["seconds"] / 1e9)
                res["save_cpu"].append(ts["cpu_s"] / (payload / 1e9))
                res["load_cpu"].append(tl["cpu_s"] / (payload / 1e9))
                log.info("  rep %d  %-44s save %5.2f GB/s  load %5.2f GB/s", rep + 1, _knobs_label(cfg),
                         res["save"][-1], res["load"][-1])
            if rep == 0 and args.reps > 1:
                log.info("  (%.0f s per repetition; about %.0f s to go)", time.perf_counter() - t_rep,
                         (time.perf_counter() - t_rep) * (args.reps - 1))
    rows = []
    for res in results:
        if not res["save"]:
            continue
        s, l = median(res["save"]), median(res["load"])
        both = [2 / (1 / a + 1 / b) for a, b in zip(res["save"], res["load"])]
        rows.append({"knobs": res["knobs"], "label": _knobs_label(res["knobs"]), "save_gbps": s, "load_gbps": l,
                     "combined_gbps": 2 / (1 / s + 1 / l), "combined_runs": both,
                     "save_cpu_s_per_gb": median(res["save_cpu"]), "load_cpu_s_per_gb": median(res["load_cpu"]),
                     "save_runs": res["save"], "load_runs": res["load"],
                     "default": _same_knobs(res["knobs"], current)})
    rows.sort(key=lambda r: -r["combined_gbps"])
    failed = {_knobs_label(r["knobs"]): r["error"] for r in results if r["error"]}
    out: Dict[str, Any] = {"kind": "fastckpt-bench-tune", "version": JSON_VERSION, "machine": ctx,
                           "state_dict": sd_info, "args": {"dir": ctx["dir"], "size": size, "reps": args.reps},
                           "seconds": round(time.perf_counter() - t_all, 1), "configs": rows, "failed": failed,
                           "disk": {"save_gbps": median(disk["save"]) if disk["save"] else None,
                                    "load_gbps": median(disk["load"]) if disk["load"] else None},
                           "cache": cache_note or "dropped before every load", "notes": notes}
    if rows:
        best = rows[0]
        dflt = next((r for r in rows if r["default"]), None)
        out["best"] = best
        out["env"] = [l.replace("export ", "") for l in _env_lines(best["knobs"])]
        out["override"] = _override_line(best["knobs"])
        if dflt is not None:
            # noise: the larger relative spread (max - min over the repetitions) of the two
            spread = max((max(r["combined_runs"]) - min(r["combined_runs"])) / r["combined_gbps"] for r in (best, dflt))
            gain = best["combined_gbps"] / dflt["combined_gbps"] - 1
            out["gain_over_default"] = gain
            out["significant"] = bool(gain > max(spread, 0.05)) if args.reps > 1 else None
    return (1 if not rows else 0), out


def _print_tune(res: Dict[str, Any]) -> None:
    sd = res["state_dict"]
    print(f"fastckpt bench --tune: {len(res['configs'])} configurations x {res['args']['reps']} "
          f"repetition{'s' if res['args']['reps'] != 1 else ''} "
          f"(interleaved, medians) of fastckpt.save + cold fastckpt.load of a {sd['bytes'] / 1e9:.2f} GB state dict, "
          f"in {res['seconds']:.0f} s")
    for line in describe_machine(res["machine"]):
        print(f"  {line}")
    d = res["disk"]
    if d["save_gbps"]:
        print(f"  disk (fio O_DIRECT 8M qd8): write {d['save_gbps']:.2f} GB/s, read {d['load_gbps']:.2f} GB/s")
    print()
    rows = [[r["label"] + (" (current)" if r["default"] else ""), f"{r['save_gbps']:.2f}", f"{r['load_gbps']:.2f}",
             f"{r['combined_gbps']:.2f}", f"{r['save_cpu_s_per_gb']:.3f}", f"{r['load_cpu_s_per_gb']:.3f}"]
            for r in res["configs"]]
    for line in _md_table(["knobs", "save GB/s", "load GB/s", "save+load GB/s", "save CPU-s/GB", "load CPU-s/GB"],
                          rows):
        print(line)
    for label, err in res["failed"].items():
        print(f"failed: {label}: {err}")
    if "best" not in res:
        print("\nno configuration could be measured")
        return
    print(f"\nbest for {res['args']['dir']} (save+load, harmonic mean): {res['best']['label']}")
    for line in _env_lines(res["best"]["knobs"]):
        print(f"  {line}")
    print(f"  {res['override']}")
    if "gain_over_default" in res:
        g = res["gain_over_default"]
        if res["best"]["default"]:
            print("the current settings are the best measured: nothing to change")
        elif res["significant"]:
            print(f"{g * 100:.0f}% over the current settings")
        elif res["significant"] is None:
            print(f"{g * 100:.0f}% over the current settings (one repetition: no noise estimate; use --reps 2 or more)")
        else:
            print(f"only {g * 100:.0f}% over the current settings, within this run's noise: keep them")
    for n in res["notes"]:
        print(f"note: {n}")


# ----------------------------------------------------------------------------- entry points

def run(args: argparse.Namespace) -> int:
    """``fastckpt bench``: the quick benchmark, or the knob sweep with ``--tune``. Returns an exit status
    (0 ok, 1 a measurement failed or data did not match, 2 cannot run here)."""
    if args.reps is None:
        args.reps = 2 if args.tune else 3
    if args.reps < 1:
        print("fastckpt bench: --reps must be at least 1", file=sys.stderr)
        return 2
    with _progress(args.quiet):
        try:
            if args.tune:
                if args.grid:
                    parse_grid(args.grid)  # a bad spec fails before minutes of set-up
                code, res = _tune(args)
            else:
                code, res = _quick(args)
        except (BenchError, argparse.ArgumentTypeError) as e:
            print(f"fastckpt bench: {e}", file=sys.stderr)
            return 2
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        log.info("results written to %s", args.json)
    if args.json == "-":
        json.dump(res, sys.stdout, indent=1, default=str)
        print()
    elif args.tune:
        _print_tune(res)
    else:
        _print_quick(res)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastckpt._bench", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
