"""``fastckpt bench``: measure checkpoint I/O on your own disk.

Quick mode (``fastckpt bench [DIR] [--size 2G] [--reps 3] [--json PATH]``): in a private
temporary directory inside DIR, fio's O_DIRECT write and read rates (the disk's limit, if fio
is installed), then ``fastckpt.save`` / ``fastckpt.load`` and ``torch.save`` (+fsync) /
``torch.load`` of a synthetic model + AdamW state dict, interleaved, medians of the
repetitions: GB/s, ratio to the disk's limit, CPU-seconds per GB and peak extra RSS.

Knob sweep (``fastckpt bench DIR --tune``): benchmarks/bench_tune.py.

The ``fastckpt bench`` command (fastckpt/cli.py) is a thin face over ``add_arguments`` and
``run`` here; from a checkout, ``python benchmarks/bench_quick.py DIR`` and
``python -m benchmarks.bench_quick DIR`` do the same. Results go to stdout; progress and
diagnostics go to the ``fastckpt.bench`` logger.
"""

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: the checkout's root on sys.path, for `benchmarks` and `fastckpt`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"  # noqa: A001

import torch  # noqa: E402

import fastckpt  # noqa: E402

from .harness import (  # noqa: E402
    DEFAULT_SIZE, FIO_MISSING, FIO_POINTS, JSON_VERSION, MiB, BenchError, describe_machine, drop_caches, find_fio,
    fio_size, fmt_opt, fmt_size, fsync_dir, fsync_path, log, machine_info, make_cold, md_table, median, parse_size,
    progress, remove, reset_peak_rss, run_fio, run_in_child, single_threaded_parent, stat_device, status_kb, timed,
    workspace)
from .workload import TINY, build, compare, payload_bytes, touch_pages  # noqa: E402
from . import bench_tune  # noqa: E402

__all__ = ["add_arguments", "run", "main"]


# ----------------------------------------------------------------------------- the quick benchmark

def _torch_save(sd: Any, path: str) -> None:
    torch.save(sd, path)
    fsync_path(path)
    fsync_dir(os.path.dirname(path))


METHODS: Dict[str, Dict[str, Any]] = {
    "fastckpt": {"save_label": "fastckpt.save", "load_label": "fastckpt.load",
                 "save": lambda sd, p: fastckpt.save(sd, p),
                 "load": lambda p: fastckpt.load(p, map_location="cpu", weights_only=True)},
    "torch": {"save_label": "torch.save+fsync", "load_label": "torch.load",
              "save": _torch_save, "load": lambda p: torch.load(p, map_location="cpu", weights_only=True)},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fastckpt bench`` (and of ``python benchmarks/bench_quick.py``)."""
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
        m["save"](TINY, warm)  # untimed: engine, staging pool (what a trainer did long before)
        m["load"](warm)
        remove(warm)
        os.sync()
        t, _ = timed(lambda: m["save"](self.sd, path), self.dev)
        return dict(t, rss_extra=status_kb("VmHWM") * 1024 - base, reset_ok=reset_ok)

    def _child_load(self, m: Dict[str, Any], path: str, verify: bool) -> Dict[str, Any]:
        base, reset_ok = reset_peak_rss()
        warm = os.path.join(self.work, f"warmup-{os.getpid()}")
        m["save"](TINY, warm)
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
    with workspace(args.dir, int(1.1 * size) + 256 * MiB, int(2.3 * size) + 512 * MiB) as work, \
            single_threaded_parent():
        ctx = machine_info(work, fio)
        ctx["dir"] = os.path.abspath(args.dir)
        if ctx["fstype"] in ("tmpfs", "ramfs"):
            notes.append(f"{ctx['dir']} is on {ctx['fstype']}: this measures memory, not a disk")
            log.warning("%s", notes[-1])
        sd, sd_info = build(size)
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
            rows.append([op, r["label"], f"{r['gbps']:.2f}", fmt_opt(r["x_disk"], ".2f"),
                         fmt_opt(r["cpu_s_per_gb"], ".3f"), fmt_opt(r["peak_rss_mb"], ".0f")])
    for line in md_table(["op", "method", "GB/s", "x disk", "CPU-s/GB", "peak extra RSS MB"], rows):
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



# ----------------------------------------------------------------------------- entry points

def run(args: argparse.Namespace) -> int:
    """``fastckpt bench``: the quick benchmark, or the knob sweep with ``--tune``. Returns an exit status
    (0 ok, 1 a measurement failed or data did not match, 2 cannot run here)."""
    if args.reps is None:
        args.reps = 2 if args.tune else 3
    if args.reps < 1:
        print("fastckpt bench: --reps must be at least 1", file=sys.stderr)
        return 2
    with progress(args.quiet):
        try:
            if args.tune:
                if args.grid:
                    bench_tune.parse_grid(args.grid)  # a bad spec fails before minutes of set-up
                code, res = bench_tune.run_tune(args)
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
        bench_tune.print_tune(res)
    else:
        _print_quick(res)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/bench_quick.py", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
