"""The measuring pieces every benchmark of this repository shares (one copy).

Size parsing and formatting, CPU and block-device counters, dropping the page cache, the
machine's description, the fio runner, file helpers, forked children that report their time,
CPU and peak RSS, the benchmark's private workspace, and a Markdown table. The synthetic state
dict is in ``benchmarks/workload.py``; ``fastckpt bench`` is ``benchmarks/bench_quick.py`` (quick
mode) and ``benchmarks/bench_tune.py`` (``--tune``); ``benchmarks/bench_*.py`` and
``benchmarks/report.py`` import from here. Progress and diagnostics go to the ``fastckpt.bench``
logger.

This directory is not part of the installed package (the runtime package holds only what users
import): run it from a source checkout.
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

from benchmarks.ports import free_port  # noqa: F401  (the benchmarks take it from here)

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


def descendants(pid: Optional[int] = None) -> List[int]:
    """The live processes below pid (default: this one), children first (from /proc/PID/task/TID/children)."""
    out: List[int] = []
    todo = [pid or os.getpid()]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def _proc_cpu(pid: int) -> float:
    """utime + stime + cutime + cstime of a process (all its threads, and its reaped children), seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_tree() -> Tuple[float, float]:
    """(CPU seconds of this process and of every process it started, the part of the helpers): this
    process's user+sys, its reaped children's, and every live descendant's own and reaped children's.
    The sum only grows: a helper's time moves into its parent's reaped-children figure when it is reaped,
    so a delta over a window counts the work of every helper process (a writer process spawned by a
    checkpointing library, its resource tracker) that ran in it."""
    helpers = cpu_children() + sum(_proc_cpu(p) for p in descendants())
    return cpu_self() + helpers, helpers


def peak_rss_descendants() -> int:
    """The sum of the live descendants' VmHWM (bytes): the helpers' peak memory, beside this process's."""
    total = 0
    for p in descendants():
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")), 0)
        except OSError:
            pass
    return total


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
    """Requests, bytes, mean request size and flushes the device completed between two dev_stat()s (of the
    whole device: what other processes read or wrote meanwhile counts too)."""
    if not a or not b:
        return {}
    ios, sectors = (0, 2) if op == "read" else (4, 6)
    n = b[ios] - a[ios]
    moved = (b[sectors] - a[sectors]) * 512
    out = {"requests": n, "bytes": moved, "kib_per_request": moved / 1024 / n if n else float("nan")}
    if len(a) >= 17:
        out["flushes"] = b[15] - a[15]
    return out


def fastckpt_version() -> str:
    """fastckpt's version, with ``git describe`` when it runs from a checkout."""
    from fastckpt import __version__
    here = os.path.dirname(os.path.abspath(sys.modules["fastckpt"].__file__))
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


def fsync_tree(path: str) -> None:
    """A checkpoint directory made durable the way the benchmarks' peers are: fsync of every file and every
    directory in it, of the directory itself and of its parent (FileNotFoundError if there is none)."""
    fsync_dir(path)  # raises for a missing path (os.walk would walk nothing, silently)
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_dir(root)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


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
    from fastckpt._core import engine as _engine
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
    """Run op with the garbage collector off: ({seconds, cpu_s, helpers_cpu_s, machine_cpu_s}, (result, dev0,
    dev1)). cpu_s is cpu_tree()'s: this process's CPU and that of every helper process it started
    (helpers_cpu_s, 0 for a method that starts none)."""
    gc.collect()
    gc.disable()
    try:
        d0, m0, (c0, h0), t0 = dev_stat(dev), cpu_machine(), cpu_tree(), time.perf_counter()
        result = op()
        t1, (c1, h1), m1, d1 = time.perf_counter(), cpu_tree(), cpu_machine(), dev_stat(dev)
    finally:
        gc.enable()
    return {"seconds": t1 - t0, "cpu_s": c1 - c0, "helpers_cpu_s": h1 - h0, "machine_cpu_s": m1 - m0}, (result, d0, d1)


# ----------------------------------------------------------------------------- a benchmark's set-up and output

@contextlib.contextmanager
def progress(quiet: bool) -> Iterator[None]:
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
def single_threaded_parent() -> Iterator[None]:
    """The parent builds the state dict and forks children: keep it out of torch's OpenMP pool."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def workspace(parent: str, disk_need: int, mem_need: int) -> Iterator[str]:
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



def warm_copy_seconds(tensors: Sequence[torch.Tensor], reps: int = 3) -> float:
    """The memory-copy limit of a snapshot: median seconds of ``copy_`` of every tensor into
    preallocated destinations already faulted in (a first, untimed pass touches them)."""
    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors):
            d.copy_(s)
        times.append(time.perf_counter() - t0)
    return median(times[1:])


def fmt_opt(x: Optional[float], fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)


def md_table(header: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return out



# ---------------------------------------------------------------- standalone scripts (report.py's STANDALONE)

def pair_targets(seconds: Dict[str, float], pairs: Dict[str, Tuple[str, float]]) -> List[Dict[str, Any]]:
    """The targets of a standalone report: op -> (reference op, speed-up wanted), judged on median seconds."""
    out = []
    for op, (ref, want) in pairs.items():
        x = seconds[ref] / seconds[op] if seconds.get(op, 0) > 0 else None
        out.append({"target": f"{op} >= {want}x {ref}", "measured": None if x is None else round(x, 2),
                    "unit": "x", "met": None if x is None else x >= want})
    return out


def emit_standalone(rep: Dict[str, Any], json_path: Optional[str]) -> int:
    """A standalone report on stdout (Markdown: its table, targets, notes and errors) and, with `json_path`,
    as JSON for benchmarks/report.py; the exit status (1 when it has errors)."""
    print(f"### {rep['title']}\n")
    print("| " + " | ".join(rep["columns"]) + " |")
    print("|" + "---|" * len(rep["columns"]))
    for row in rep["rows"]:
        print("| " + " | ".join("" if v is None else str(v) for v in row) + " |")
    print()
    for t in rep["targets"]:
        m = t["measured"]
        print(f"- {t['target']}: {m if not isinstance(m, float) else round(m, 3)}{t.get('unit', 'x')} "
              f"({'met' if t['met'] else 'NOT met'})")
    for n in rep["notes"] + rep["errors"]:
        print(f"- {n}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rep, f, indent=1)
    return 1 if rep["errors"] else 0
