"""``fastckpt bench DIR --tune``: fastckpt.save + cold fastckpt.load under a small grid of engine
settings (backend, buffer size, buffer count, queue depth, I/O threads), interleaved with fio's
8M qd8 point, medians; then the best one as ``FASTCKPT_*`` environment lines and a
``fastckpt.knobs.override(...)`` line. Entry point: ``benchmarks/bench_quick.py`` (``run``)."""

import argparse
import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import fastckpt

from .harness import (FIO_MISSING, FIO_POINTS, JSON_VERSION, MiB, describe_machine, drop_caches, find_fio, fmt_size,
                      log, machine_info, make_cold, md_table, median, parse_size, remove, run_fio, fio_size,
                      single_threaded_parent, stat_device, timed, workspace)
from .workload import TINY, build, compare, touch_pages

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
    d = fastckpt.knobs.as_dict()
    cfg = {k: d[k] for k in TUNED}
    cfg["backend"] = str(cfg["backend"]).split(".")[-1].lower()
    if cfg["backend"] != "threads":
        cfg.pop("io_threads")
    return cfg


def _same_knobs(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    norm = lambda c: {k: v for k, v in c.items() if k != "io_threads" or c["backend"] == "threads"}  # noqa: E731
    ba, bb = a["backend"], b["backend"]
    return norm(dict(a, backend="uring" if ba == "auto" else ba)) == norm(dict(b, backend="uring" if bb == "auto" else bb))


def run_tune(args: argparse.Namespace) -> Tuple[int, Dict[str, Any]]:
    fc = fastckpt
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
    with workspace(args.dir, int(1.1 * size) + 256 * MiB, int(2.3 * size) + biggest_pool + 512 * MiB) as work, \
            single_threaded_parent():
        ctx = machine_info(work, fio)
        ctx["dir"] = os.path.abspath(args.dir)
        dev = stat_device(work)
        sd, sd_info = build(size)
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
                        fc.save(TINY, warm)
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


def print_tune(res: Dict[str, Any]) -> None:
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
    for line in md_table(["knobs", "save GB/s", "load GB/s", "save+load GB/s", "save CPU-s/GB", "load CPU-s/GB"],
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


