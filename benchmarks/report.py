#!/usr/bin/env python3
"""The benchmark report (``make bench``): one Markdown report, its JSON and PNG charts in build/bench/.

What it runs, on the directory ``--dir`` (default: the repository root, i.e. the project's disk):

1. for every size of ``--sizes`` (default 256M, 1G, 4G), ``benchmarks/bench_save_load.py``: the
   disk's limits (fio O_DIRECT write with end_fsync, and read), fastckpt.save/load,
   fastckpt.async_save, torch.save(+fsync)/torch.load, DCP FileSystemWriter/Reader (stock) and
   FastWriter/FastReader, safetensors (+fsync) and, with ``--deepspeed yes``, DeepSpeed's
   FastPersist writer (FastFileWriter); every operation in a fresh forked child, durable saves,
   cold loads, all of them interleaved with fio in each repetition, medians of ``--reps``;
2. with ``--tune-size`` (default 1G; 0 for none), the knob sweep of ``fastckpt bench --tune``
   (benchmarks/bench_tune.py) on the same directory;
3. the standalone scripts of ``STANDALONE`` (``--standalone``; the small-tensor and
   first-load figures: bench_small.py, bench_first_load.py), each rendered from its JSON (the
   contract is at ``STANDALONE``); a script missing from the checkout is reported as not run;
4. with ``--extras`` (make bench-full): bench_engine.py --full and bench_dcp.py, whose own reports
   are kept in results/raw/ and linked.

The targets are stated next to the figures they are judged on ("Targets" section:
bench_save_load.py's ``size_targets`` per size, and the standalone scripts' own).

``--quick`` checks the whole pipeline in about a minute (64M, one repetition, no knob sweep,
one fio point, DCP thread_count 2 only), into build/bench-quick/ unless ``--out`` is given:
``make bench-quick``.

Then it writes, into ``--out`` (default build/bench/, outside the tracked tree; the committed report in
benchmarks/results/ changes only when asked: ``--out benchmarks/results``, ``make bench BENCH_OUT=benchmarks/results``):

* ``REPORT.md``: the machine, the disk's limits, a summary across sizes, one table per size
  (save and load GB/s, ratio to the disk's limit, CPU-s/GB, peak extra RSS, for every method),
  the knob sweep, what was not run and why;
* ``results.json``: the same figures, machine-readable;
* ``save_gbps.png``, ``load_gbps.png`` (GB/s against the size, per method, the fio limit dashed)
  and ``cpu_per_gb.png`` (CPU-s/GB per method at the largest size);
* ``raw/``: every script's own JSON and Markdown output.

``--assemble-only`` rebuilds the report from ``raw/`` without measuring anything.

Examples::

    .venv/bin/python benchmarks/report.py                                  # what make bench runs
    .venv/bin/python benchmarks/report.py --sizes 256M,1G --reps 2 --tune-size 0
    .venv/bin/python benchmarks/report.py --assemble-only --out benchmarks/results
    .venv/bin/python benchmarks/report.py --quick                         # make bench-quick
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
try:
    import fastckpt  # noqa: F401
except ImportError:  # a checkout whose extension was built in place but not installed
    sys.path.insert(0, REPO_ROOT)
if REPO_ROOT not in sys.path:  # the checkout's `benchmarks` package
    sys.path.insert(1, REPO_ROOT)
from benchmarks import harness as fb  # noqa: E402
from fastckpt._core.units import human  # noqa: E402  (the package's one size formatter)

DEFAULT_SIZES = "256M,1G,4G"
DEFAULT_OUT = os.path.join(REPO_ROOT, "build", "bench")  # the committed report (HERE/results) only by --out
QUICK_OUT = os.path.join(REPO_ROOT, "build", "bench-quick")

# Standalone measurements run after the save/load sizes, each rendered from its JSON: the hook for
# measurements that do not fit the per-size save/load table (many small tensors, the first
# load in a fresh process). Each entry: (name, script in benchmarks/, what it measures). The report runs
#     python benchmarks/SCRIPT --dir DIR --json raw/NAME.json [--quick]
# (stdout, Markdown, kept as raw/NAME.md; progress on stderr; exit 0 unless a measurement failed) and
# renders the JSON object it wrote:
#     {"title": str,                              the section's title
#      "columns": [str, ...], "rows": [[cell, ...], ...],   one table (cells: str or number)
#      "targets": [{"target": str, "measured": number | null, "unit": "x" | "ms" | "s/GB" | ...,
#                   "met": true | false | null}, ...],     stated in the Targets section
#      "notes": [str, ...], "errors": [str, ...]}
# A script missing from this checkout is reported as not run. Add an entry here to plug one in.
STANDALONE = (
    ("small", "bench_small.py", "100,000 scalar tensors: save, load and verify against torch, file size"),
    ("first_load", "bench_first_load.py", "the first small load in a fresh process against torch.load"),
    ("safetensors", "bench_safetensors.py", "fastckpt.safetensors save_file/load_file against the "
     "safetensors package (durable saves, loads with every page read)"),
    ("frameworks", "bench_frameworks.py", "Lightning's and Accelerate's own durable checkpoints against "
     "fastckpt.integrations (about 3 minutes)"),
    ("remote", "bench_remote.py", "upload, download and restore against a local S3 endpoint (moto): "
     "fastckpt against s3fs and boto3"),
    ("memory", "bench_memory.py", "the memory tier: snapshot blocking against a plain copy, async_save and "
     "dcp.async_save; restore from memory against disk; replication between two emulated nodes"),
    ("fullsize", "bench_fullsize.py", "full-size files from sharded jobs (every rank writes its shards) against "
     "gather + torch.save / safetensors and DCP + convert; load_into against torch.load + load_state_dict"),
    ("stall", "bench_training.py", "the stall a training loop feels: blocked, staged and durable times of a checkpoint "
     "every K steps, the step slowdown while it writes and the goodput, fastckpt against DCP and torch_checkpointing"),
    ("cluster", "cluster_emulate.py", "the cluster benchmark: N = 1, 2, 4 emulated nodes (root: loop "
     "filesystems, blkio cgroups), every save/load mode of replicated state"),
    ("zipnn", "bench_zipnn.py", "zipnn before an upload: compressed size against compress/decompress time, per link speed"),
)
# Standalone scripts run only when named in --standalone (minutes, or root): the cluster benchmark is
# `make bench-cluster`; `make bench BENCH_ARGS="--standalone small,first_load,cluster"` puts it in the report.
# A script's JSON may also name "images": [path relative to its JSON file, ...], shown under its table.
OPT_IN = ("cluster",)
REPORT_VERSION = 1
DS_INSTALL = ".ci/install_deepspeed.sh"

# chart lines: (series name, save-row predicate, load-row predicate), in legend order
SERIES = [
    ("fastckpt", lambda r: r["key"] == "fastckpt", lambda r: r["key"] == "fastckpt"),
    ("fastckpt.async_save", lambda r: r["key"] == "async", None),
    ("torch", lambda r: r["key"] == "torch", lambda r: r["key"] == "torch"),
    ("DCP stock (best t)", lambda r: r["key"] == "dcp", lambda r: r["key"] == "dcp"),
    ("DCP FastWriter/Reader", lambda r: r["key"] == "fastdcp", lambda r: r["key"] == "fastdcp"),
    ("safetensors", lambda r: r["key"] == "safetensors", lambda r: r["key"] == "safetensors"),
    ("fastckpt.load verify off", None, lambda r: r["key"] == "fastckpt_noverify"),
    ("torch.load mmap, touched", None, lambda r: r["key"] == "torch_mmap"),
    ("DeepSpeed FastPersist (best p)", lambda r: r["key"] == "deepspeed", None),
    ("torch-checkpointing sync", lambda r: r["key"] == "tc", lambda r: r["key"] == "tc"),
    ("torch-checkpointing async", lambda r: r["key"] == "tc_async", None),
    ("dcp.async_save (best executor)", lambda r: r["key"] == "dcp_async", None),
    ("fastckpt.safetensors.load_file", None, lambda r: r["key"] == "st_fastckpt"),
    ("fastsafetensors", None, lambda r: r["key"] == "fastsafetensors"),
    ("runai-model-streamer", None, lambda r: r["key"] == "runai"),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def size_tag(n: int) -> str:
    return fb.fmt_size(n)


def human_size(n: int) -> str:
    return human(n, digits=2, trim=True)


def clean(x: Any) -> Any:
    """NaN -> None, recursively (results.json is strict JSON)."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def num(x: Any) -> Optional[float]:
    return None if x is None or (isinstance(x, float) and x != x) else float(x)


# ----------------------------------------------------------------------------- running the scripts

def run_script(cmd: List[str], md_path: str) -> Tuple[int, float, str]:
    """Run a benchmark script: its stdout (a Markdown report) to md_path, its progress passed on to our
    stderr as it comes; returns (exit status, seconds, its last stderr line: why it failed, if it did)."""
    log("$ " + " ".join(cmd))
    t = time.perf_counter()
    last = ""
    with open(md_path, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, cwd=REPO_ROOT, text=True)
        for line in p.stderr:
            sys.stderr.write(line)
            if line.strip():
                last = line.strip()
        code = p.wait()
    return code, time.perf_counter() - t, last


def deepspeed_status(mode: str) -> Tuple[bool, str]:
    """(run it?, what the report says about DeepSpeed)."""
    if mode == "no":
        return False, ("not run: left out by BENCH_DEEPSPEED=no (`make bench` installs and runs it by default; "
                       f"{DS_INSTALL} installs it)")
    try:
        import importlib.util
        if importlib.util.find_spec("deepspeed") is None:
            raise ImportError("no module named deepspeed")
    except Exception as e:  # noqa: BLE001
        return False, f"not run: DeepSpeed is not installed here ({e}); `bash {DS_INSTALL}` installs it"
    return True, "run"


def measure(args: argparse.Namespace, raw: str) -> Dict[str, Any]:
    """Run everything; returns {'runs': [...], 'deepspeed': str, 'tune': path or None, 'extras': {...}}."""
    py = sys.executable
    sizes = [fb.parse_size(s) for s in args.sizes.split(",") if s.strip()]
    run_ds, ds_note = deepspeed_status(args.deepspeed)
    meta: Dict[str, Any] = {"runs": [], "deepspeed": ds_note, "tune": None, "extras": {}}
    for size in sizes:
        tag = size_tag(size)
        js, md = os.path.join(raw, f"save_load-{tag}.json"), os.path.join(raw, f"save_load-{tag}.md")
        cmd = [py, os.path.join(HERE, "bench_save_load.py"), "--dir", args.dir, "--size", str(size),
               "--reps", str(args.reps), "--json", js] + (["--deepspeed"] if run_ds else []) + args.save_load_args
        log(f"== {human_size(size)}: save/load of every method, {args.reps} repetitions")
        code, sec, last = run_script(cmd, md)
        meta["runs"].append({"size": size, "json": os.path.relpath(js, args.out), "md": os.path.relpath(md, args.out),
                             "exit": code, "seconds": round(sec, 1), "last_line": last})
        log(f"   {human_size(size)} done in {sec:.0f} s (exit {code})")
    if args.tune_size not in ("", "0"):
        js, md = os.path.join(raw, "tune.json"), os.path.join(raw, "tune.md")
        cmd = [py, os.path.join(HERE, "bench_quick.py"), args.dir, "--tune", "--size", args.tune_size, "--reps",
               str(args.tune_reps), "--json", js]
        log(f"== knob sweep (fastckpt bench --tune) at {args.tune_size}")
        code, sec, last = run_script(cmd, md)
        meta["tune"] = {"json": os.path.relpath(js, args.out), "md": os.path.relpath(md, args.out), "exit": code,
                        "seconds": round(sec, 1), "last_line": last}
    meta["standalone"] = {}
    for name, script, what in STANDALONE:
        if name not in args.standalone:
            continue
        path = os.path.join(HERE, script)
        if not os.path.exists(path):
            meta["standalone"][name] = {"missing": f"not run: benchmarks/{script} is not in this checkout"}
            log(f"== {script}: not in this checkout, not run")
            continue
        js, md = os.path.join(raw, f"{name}.json"), os.path.join(raw, f"{name}.md")
        cmd = [py, path, "--dir", args.dir, "--json", js] + (["--quick"] if args.quick else [])
        log(f"== {script}: {what}")
        code, sec, last = run_script(cmd, md)
        meta["standalone"][name] = {"json": os.path.relpath(js, args.out), "md": os.path.relpath(md, args.out),
                                    "exit": code, "seconds": round(sec, 1), "last_line": last}
    extras = [x for x in (args.extras or "").split(",") if x]
    for x in extras:
        md = os.path.join(raw, f"{x}.md")
        js = os.path.join(raw, f"{x}.json")
        script = {"engine": ["bench_engine.py", "--full"], "dcp": ["bench_dcp.py"]}[x]
        cmd = [py, os.path.join(HERE, script[0])] + script[1:] + ["--dir", args.dir, "--json", js]
        log(f"== extra: {' '.join(script)}")
        code, sec, last = run_script(cmd, md)
        meta["extras"][x] = {"md": os.path.relpath(md, args.out), "exit": code, "seconds": round(sec, 1),
                             "last_line": last}
    return meta


# ----------------------------------------------------------------------------- collecting

def collect_size(raw_json: Dict[str, Any]) -> Dict[str, Any]:
    """One bench_save_load.py JSON -> the report's entry for that size (rows pairing each save with its load)."""
    s = raw_json.get("summary") or {}
    saves, loads = s.get("rows_save", []), s.get("rows_load", [])
    load_of = raw_json.get("load_label_of") or {}
    by_label = {r["label"]: r for r in loads}
    rows: List[Dict[str, Any]] = []

    def cell(r: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if r is None:
            return None
        return {"label": r["label"], "n": r["n"], "gbps": num(r["gbps"]), "min": num(r["lo"]), "max": num(r["hi"]),
                "x_disk": num(r.get("x_disk")), "x_disk_paired": num(r.get("x_disk_paired")),
                "cpu_s_per_gb": num(r.get("cpu_per_gb")), "machine_cpu_s_per_gb": num(r.get("machine_per_gb")),
                "peak_rss_mb": num(r.get("rss_mb")), "pool_mb": num(r.get("pool_mb")), "check": r.get("check", ""),
                "dev_x": num(r.get("dev_x"))}

    fio_s = [r for r in saves if r["key"] == "fio"]
    fio_l = [r for r in loads if r["key"] == "fio"]
    disk = {"write_gbps": num(s.get("disk_save_gbps")), "read_gbps": num(s.get("disk_load_gbps")),
            "write_point": s.get("disk_save_point"), "read_point": s.get("disk_load_point"),
            "points": {"write": {r["label"]: num(r["gbps"]) for r in fio_s},
                       "read": {r["label"]: num(r["gbps"]) for r in fio_l}}}
    if fio_s or fio_l:
        bs = max(fio_s, key=lambda r: r["gbps"]) if fio_s else None
        bl = max(fio_l, key=lambda r: r["gbps"]) if fio_l else None
        rows.append({"key": "fio", "name": "disk limit (fio O_DIRECT, best point)", "save": cell(bs),
                     "load": cell(bl)})
    used = set()
    for r in saves:
        if r["key"] in ("fio", "ref"):
            continue
        lr = by_label.get(load_of.get(r["label"], ""))
        if lr is not None:
            used.add(lr["label"])
        row = {"key": r["key"], "name": r["label"] + (f" / {lr['label']}" if lr else ""), "save": cell(r),
               "load": cell(lr)}
        if num(r.get("blocked_s")) is not None:
            row["blocked_s"] = num(r["blocked_s"])
        rows.append(row)
    for r in loads:
        if r["key"] != "fio" and r["label"] not in used:
            rows.append({"key": r["key"], "name": r["label"], "save": None, "load": cell(r)})
    ctx = raw_json.get("context") or {}
    return {"size": (raw_json.get("args") or {}).get("size"), "payload": (raw_json.get("state_dict") or {}).get("bytes"),
            "state_dict": raw_json.get("state_dict"), "reps": (raw_json.get("args") or {}).get("reps"),
            "disk": disk, "rows": rows, "skipped": raw_json.get("skipped") or {},
            "notes": raw_json.get("notes") or [], "errors": raw_json.get("errors") or [],
            "cache": ("NOT dropped: " + raw_json["drop_caches_error"]) if raw_json.get("drop_caches_error")
            else "dropped before every load", "targets": s.get("targets"),
            "size_targets": s.get("size_targets") or [],
            "versions": {k: ctx[k] for k in ("safetensors", "deepspeed", "torch-checkpointing", "fastsafetensors",
                                                   "runai-model-streamer", "zipnn") if k in ctx},
            "load_avg": ctx.get("load_avg")}


def collect(out: str, meta: Dict[str, Any], machine: Dict[str, Any], settings: Dict[str, Any]) -> Dict[str, Any]:
    sizes = []
    for run in meta["runs"]:
        path = os.path.join(out, run["json"])
        if not os.path.exists(path):
            why = f": {run['last_line']}" if run.get("last_line") else ""
            sizes.append({"size": run["size"], "failed": f"no results (exit {run.get('exit')}{why}); see {run['md']}",
                          "rows": []})
            continue
        with open(path) as f:
            entry = collect_size(json.load(f))
        entry.update(md=run["md"], seconds=run.get("seconds"), exit=run.get("exit"))
        sizes.append(entry)
    sizes.sort(key=lambda e: e["size"] or 0)
    tune = None
    if meta.get("tune"):
        path = os.path.join(out, meta["tune"]["json"])
        if os.path.exists(path):
            with open(path) as f:
                t = json.load(f)
            tune = {k: t.get(k) for k in ("args", "seconds", "configs", "failed", "disk", "best", "env", "override",
                                           "gain_over_default", "significant", "cache", "notes")}
            tune["state_dict_bytes"] = (t.get("state_dict") or {}).get("bytes")
            tune["md"] = meta["tune"]["md"]
        else:
            why = f": {meta['tune']['last_line']}" if meta["tune"].get("last_line") else ""
            tune = {"failed": f"no results (exit {meta['tune'].get('exit')}{why}); see {meta['tune']['md']}"}
    versions: Dict[str, str] = {}
    for e in sizes:
        versions.update(e.get("versions") or {})
    return {"kind": "fastckpt-bench-report", "version": REPORT_VERSION, "machine": machine, "settings": settings,
            "versions": versions, "sizes": sizes, "tune": tune, "deepspeed": meta.get("deepspeed"),
            "standalone": collect_standalone(out, meta.get("standalone") or {}),
            "extras": meta.get("extras") or {}}


def collect_standalone(out: str, runs: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The standalone scripts' results (STANDALONE), in its order: their JSON, or why there is none."""
    found = []
    for name, script, what in STANDALONE:
        run = runs.get(name)
        if run is None:
            continue
        entry: Dict[str, Any] = {"name": name, "script": script, "title": what}
        if run.get("missing"):
            entry["failed"] = run["missing"]
        elif not os.path.exists(os.path.join(out, run["json"])):
            why = f": {run['last_line']}" if run.get("last_line") else ""
            entry["failed"] = f"no results (exit {run.get('exit')}{why}); see {run['md']}"
        else:
            with open(os.path.join(out, run["json"])) as f:
                got = json.load(f)
            entry.update({k: got.get(k) for k in ("columns", "rows", "targets", "notes", "errors")})
            entry["images"] = [os.path.join(os.path.dirname(run["json"]), p) for p in got.get("images") or []]
            entry["title"] = got.get("title") or what
            entry.update(md=run["md"], exit=run.get("exit"), seconds=run.get("seconds"))
        found.append(entry)
    return found


# ----------------------------------------------------------------------------- writing

def _f(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _series(entry: Dict[str, Any], op: str, pred) -> Optional[Dict[str, Any]]:
    """The best cell of op among the rows matching pred (e.g. the best DCP thread count)."""
    cells = [r[op] for r in entry["rows"] if pred(r) and r.get(op) and r[op].get("gbps") is not None]
    return max(cells, key=lambda c: c["gbps"]) if cells else None


def _row_by_key(entry: Dict[str, Any], key: str) -> Optional[Dict[str, Any]]:
    return next((r for r in entry["rows"] if r["key"] == key), None)


def disk_points(sizes: List[Dict[str, Any]], op: str) -> List[Tuple[float, float]]:
    """The disk-limit line of the save or load chart: (GiB, GB/s) per size that fio measured."""
    pts = [(e["size"] / fb.GiB, e["disk"]["write_gbps" if op == "save" else "read_gbps"]) for e in sizes]
    return [(x, y) for x, y in pts if y is not None]


def cpu_bars(rows: List[Dict[str, Any]]) -> List[Tuple[str, str, float]]:
    """The CPU chart's bars, (name, "save" or "load", CPU-s/GB): a row "writer / reader" gives the writer's
    name to its save bar and the reader's to its load bar; a row that measured one side keeps its name;
    sides with no figure get no bar; saves first, then loads, in the table's order."""
    out: List[Tuple[str, str, float]] = []
    for op in ("save", "load"):
        for r in rows:
            v = (r.get(op) or {}).get("cpu_s_per_gb")
            if r["key"] == "fio" or v is None:
                continue
            parts = r["name"].split(" / ")
            name = parts[0 if op == "save" else -1] if len(parts) == 2 else r["name"]
            out.append((name, op, float(v)))
    return out


def charts(res: Dict[str, Any], out: str) -> List[str]:
    """save_gbps.png, load_gbps.png, cpu_per_gb.png; returns the files written (none without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        log(f"no charts: matplotlib unavailable ({e})")
        return []
    sizes = [e for e in res["sizes"] if e.get("rows")]
    if not sizes:
        return []
    m = res["machine"]
    where = f"{m.get('fstype', '?')} on {m.get('mount', {}).get('source', '?')}, {m.get('nproc', '?')} CPUs"
    written = []
    xs_all = [e["size"] / fb.GiB for e in sizes]
    for op, fname, title in (("save", "save_gbps.png", "durable save"), ("load", "load_gbps.png", "cold load")):
        fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
        for idx, (name, sp, lp) in enumerate(SERIES):
            pred = sp if op == "save" else lp
            if pred is None:
                continue
            xs, ys, lo, hi = [], [], [], []
            for e in sizes:
                c = _series(e, op, pred)
                if c is not None:
                    xs.append(e["size"] / fb.GiB)
                    ys.append(c["gbps"])
                    lo.append(c["gbps"] - (c["min"] if c["min"] is not None else c["gbps"]))
                    hi.append((c["max"] if c["max"] is not None else c["gbps"]) - c["gbps"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="os^"[idx // 10 % 3], capsize=3, label=name,
                            color=f"C{idx % 10}", linestyle="-" if idx < 10 else "--",  # 10 colours, then marks
                            linewidth=2.5 if name == "fastckpt" else 1.5)
        disk = disk_points(sizes, op)
        label = f"disk limit (fio O_DIRECT {'write' if op == 'save' else 'read'})"
        if len(disk) == 1:  # one size: a line across the chart (a dashed line through one point draws nothing)
            ax.axhline(disk[0][1], color="k", linestyle="--", linewidth=1.5, label=label)
        elif disk:
            ax.plot([x for x, _ in disk], [y for _, y in disk], "k--", marker="s", markersize=4, linewidth=1.5,
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all)
        ax.set_xticklabels([size_tag(e["size"]) for e in sizes])
        ax.set_xlabel("state dict size (tensor bytes)")
        ax.set_ylabel("GB/s (1e9 bytes/s), median; bars: min-max")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{title} ({where})", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        p = os.path.join(out, fname)
        fig.savefig(p)
        plt.close(fig)
        written.append(p)
    # CPU-s/GB at the largest size: one bar per measured save and per measured load, each under its own name
    e = sizes[-1]
    bars = cpu_bars(e["rows"])
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.32 * max(len(bars), 1)), dpi=110)
    ys = list(range(len(bars)))
    for op, color in (("save", "C0"), ("load", "C1")):
        mine = [(y, v) for y, (_, o, v) in zip(ys, bars) if o == op]
        if mine:
            ax.barh([y for y, _ in mine], [v for _, v in mine], height=0.7, color=color, label=op)
    ax.set_yticks(ys)
    ax.set_yticklabels([name for name, _, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("CPU-seconds per GB (user+sys of the process), median")
    ax.set_title(f"CPU cost at {human_size(e['size'])} ({where})", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = os.path.join(out, "cpu_per_gb.png")
    fig.savefig(p)
    plt.close(fig)
    written.append(p)
    return written


def markdown(res: Dict[str, Any], pngs: List[str]) -> str:
    m, st = res["machine"], res["settings"]
    L: List[str] = ["# fastckpt benchmark report", ""]
    took = f" in {st['seconds'] / 60:.0f} min" if st.get("seconds") else ""
    L.append(f"Produced by `{st.get('command', 'make bench')}` (benchmarks/report.py) on {m.get('date', '?')}{took}. "
             "Do not compare these figures with another machine's: the ratios to the disk's limit travel better.")
    L += ["", "## Machine", ""]
    L += [f"- {line}" for line in fb.describe_machine(m)]
    if res.get("versions"):
        L.append("- " + ", ".join(f"{k} {v}" for k, v in sorted(res["versions"].items())))
    if m.get("fstype") in ("tmpfs", "ramfs"):
        L.append(f"- **WARNING**: {m['dir']} is on {m['fstype']}: these figures measure memory, not a disk")
    L += ["", "## How it was measured", ""]
    L.append("- State dict: a model + AdamW optimizer state (float32 and bfloat16; a few 64-128 MiB tensors scaled "
             "with the size and about a thousand small ones), built once per size with a fixed seed.")
    L.append(f"- Every save is durable before the clock stops (fsync of the file and its directory for the peers), "
             f"every load starts from a cold page cache (dropped before each); every operation runs in a fresh "
             f"forked child after an untimed warm-up; {st.get('reps', '?')} repetition{'' if st.get('reps') == 1 else 's'} "
             f"per size, all methods and fio "
             f"interleaved (order reversed on odd repetitions); medians, [min-max].")
    L.append("- GB/s: tensor bytes (1e9) / wall time. x disk: the median over the disk's limit, the best fio O_DIRECT "
             "median of the same run and size (write with --end_fsync=1; read). CPU-s/GB: the child's user+sys "
             "(all its threads, and every helper process it started: a peer's writer process or checkpoint daemon). "
             "Peak RSS: the child's extra peak resident memory (its long-lived buffers included; "
             "for loads the loaded state dict too, about the payload).")
    L.append("- Loads: fastckpt.load with verify on (the row paired with fastckpt.save) and off, torch.load and "
             "torch.load(mmap=True), safetensors load_file (and fastckpt.safetensors, fastsafetensors and "
             "runai-model-streamer reading the same file), torch-checkpointing's load, DCP FileSystemReader and "
             "FastReader (verify on); "
             "a lazily mapped result (mmap, safetensors) has one byte of every 4 KiB page read inside the timing, "
             "so that every loader has really read the data when the clock stops.")
    L.append("- Loads allocate fresh memory for their result (see the '(ref) fresh memory' rows: the rate at which "
             "this machine faults in and zeroes new memory, on small pages and on transparent huge pages, which "
             "fastckpt's loads use for storages of 2 MiB or more), except DCP's, which fill a state dict allocated "
             "beforehand, outside the timing (as dcp.load is used); fio reads into a reused buffer.")
    sizes = [e for e in res["sizes"] if e.get("rows")]
    L += ["", "## The disk's limits (fio)", ""]
    L += _table(["size", "write GB/s", "read GB/s", "points (write; read)"],
                [[human_size(e["size"]), _f(e["disk"]["write_gbps"], ".2f"), _f(e["disk"]["read_gbps"], ".2f"),
                  "; ".join(", ".join(f"{k[4:]} {v:.2f}" for k, v in e["disk"]["points"][op].items() if v is not None)
                            for op in ("write", "read"))] for e in sizes]
                if sizes else [])
    L += ["", "## Summary", ""]
    srows = []
    for e in sizes:
        f, t = _row_by_key(e, "fastckpt"), _row_by_key(e, "torch")
        if f is None:
            continue
        fs, fl = f.get("save") or {}, f.get("load") or {}
        ts, tl = (t or {}).get("save") or {}, (t or {}).get("load") or {}
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
        srows.append([human_size(e["size"]), _f(fs.get("gbps"), ".2f"), _f(fs.get("x_disk"), ".2f"),
                      ratio(fs.get("gbps"), ts.get("gbps")), _f(fs.get("cpu_s_per_gb"), ".2f"),
                      _f(fl.get("gbps"), ".2f"), _f(fl.get("x_disk"), ".2f"), ratio(fl.get("gbps"), tl.get("gbps")),
                      _f(fl.get("cpu_s_per_gb"), ".2f")])
    L += _table(["size", "fastckpt.save GB/s", "x disk", "x torch.save+fsync", "CPU-s/GB",
                 "fastckpt.load GB/s", "x disk", "x torch.load", "CPU-s/GB"], srows)
    L += targets_section(res)
    if pngs:
        L.append("")
        for p in pngs:
            name = os.path.basename(p)
            L.append(f"![{name[:-4]}]({name})")
    for e in res["sizes"]:
        L += ["", f"## {human_size(e['size'])}" if e.get("size") else "## ?", ""]
        if not e.get("rows"):
            L.append(f"Not measured: {e.get('failed', 'no results')}")
            continue
        sd = e.get("state_dict") or {}
        L.append(f"{sd.get('bytes', 0) / 1e9:.3f} GB of tensors in {sd.get('tensors', '?')} tensors; "
                 f"{e.get('reps', '?')} repetition{'' if e.get('reps') == 1 else 's'}; page cache {e['cache']}"
                 + (f"; measured in {e['seconds']:.0f} s" if e.get("seconds") else "")
                 + (f"; load average {e['load_avg'][0]} at the start" if e.get("load_avg") else "")
                 + (f" ([raw output]({e['md']}))" if e.get("md") else "") + ".")
        L.append("")
        rows = []
        for r in e["rows"]:
            s, l = r.get("save"), r.get("load")

            def part(c):
                if not c:
                    return ["", "", "", ""]
                g = f"{c['gbps']:.2f}" + (f" [{c['min']:.2f}-{c['max']:.2f}]" if c.get("n", 1) > 1 else "")
                return [g, _f(c.get("x_disk"), ".2f"), _f(c.get("cpu_s_per_gb"), ".2f"), _f(c.get("peak_rss_mb"), ".0f")]
            name = r["name"] if r["key"] != "fio" else "**" + r["name"] + "**"
            if r["key"] == "fastckpt":
                name = f"**{name}**"
            checks = sorted({c.get("check") for c in (s, l) if c and c.get("check")})
            note = "verified" if checks and all(c.startswith("verified") for c in checks) else "; ".join(checks)
            if r.get("blocked_s") is not None:
                note = (note + "; " if note else "") + f"caller blocked {r['blocked_s']:.2f} s"
            if l and l.get("dev_x") is not None and r["key"] not in ("fio", "ref"):  # a cold load reads each byte once
                note = (note + "; " if note else "") + f"disk read {l['dev_x']:.2f}x the tensor bytes"
            rows.append([name] + part(s) + part(l) + [note])
        L += _table(["method (save / load)", "save GB/s", "x disk", "CPU-s/GB", "peak RSS MB", "load GB/s", "x disk",
                     "CPU-s/GB", "peak RSS MB", "check, notes"], rows)
        extra = []
        for k, why in (e.get("skipped") or {}).items():
            if k != "deepspeed":
                extra.append(f"- not run: {k}: {why}")
        extra += [f"- note: {n}" for n in e.get("notes") or []]
        extra += [f"- **ERROR**: {x}" for x in e.get("errors") or []]
        if extra:
            L += [""] + extra
    L += standalone_section(res)
    L += ["", "## DeepSpeed FastPersist", ""]
    ds_rows = [r for e in sizes for r in e["rows"] if r["key"] == "deepspeed"]
    ds_skip = next((e["skipped"]["deepspeed"] for e in sizes if "deepspeed" in (e.get("skipped") or {})), None)
    if ds_rows:
        L.append("Measured (rows above): `torch.save(sd, FastFileWriter(path))` + close (its fsync) + fsync of the "
                 "directory, with DeepSpeed's checkpoint defaults (1 MiB blocks, queue depth 8, 64 MiB page-locked "
                 "double buffer); no load row (DeepSpeed loads with torch.load).")
    elif ds_skip:
        L.append(f"Not run: {ds_skip}")
    else:
        L.append(f"DeepSpeed: {res.get('deepspeed') or 'not run'}")
    t = res.get("tune")
    L += ["", "## Knob sweep (`fastckpt bench --tune`)", ""]
    if not t:
        L.append("Not run (`--tune-size 0`); `fastckpt bench DIR --tune` runs it.")
    elif t.get("failed") and not t.get("configs"):
        L.append(f"Failed: {t['failed']}")
    else:
        a = t.get("args") or {}
        L.append(f"fastckpt.save + cold fastckpt.load of a {(t.get('state_dict_bytes') or 0) / 1e9:.2f} GB state dict "
                 f"under {len(t['configs'])} engine configurations, {a.get('reps', '?')} repetitions interleaved, "
                 f"medians, in {t.get('seconds', 0):.0f} s; ranked by the harmonic mean of save and load GB/s"
                 + (f" ([raw output]({t['md']}))" if t.get("md") else "") + ".")
        L.append("")
        L += _table(["knobs", "save GB/s", "load GB/s", "save+load GB/s", "save CPU-s/GB", "load CPU-s/GB"],
                    [[c["label"] + (" (default)" if c.get("default") else ""), f"{c['save_gbps']:.2f}",
                      f"{c['load_gbps']:.2f}", f"{c['combined_gbps']:.2f}", f"{c['save_cpu_s_per_gb']:.3f}",
                      f"{c['load_cpu_s_per_gb']:.3f}"] for c in t["configs"]])
        if t.get("best"):
            L += ["", f"Best here: {t['best']['label']}:", "", "```"]
            L += [f"export {x}" for x in t.get("env") or []]
            L += [t.get("override", ""), "```"]
            g = t.get("gain_over_default")
            if g is not None:
                if t["best"].get("default"):
                    L.append("The defaults were the best measured.")
                else:
                    L.append(f"{g * 100:.0f}% over the defaults" + (
                        "." if t.get("significant") else
                        " (one repetition: no noise estimate)." if t.get("significant") is None else
                        ", within this run's noise: keep the defaults."))
        for label, err in (t.get("failed") or {}).items():
            L.append(f"- failed: {label}: {err}")
    if res.get("extras"):
        L += ["", "## More (`make bench-full`)", ""]
        for k, x in res["extras"].items():
            L.append(f"- {k}: [{x['md']}]({x['md']}) (exit {x['exit']}, {x['seconds']:.0f} s)")
    L += ["", "## Files", "",
          "`results.json` (these figures, machine-readable), the PNG charts, `raw/` (every script's own JSON "
          "and Markdown output, with every repetition's figures).", ""]
    return "\n".join(L)


def _verdict(met: Optional[bool]) -> str:
    return "n/a" if met is None else ("**met**" if met else "**NOT met**")


def _figure(x: Optional[float], unit: str) -> str:
    if x is None:
        return "not measured"
    return f"{x:.2f} x" if unit == "x" else f"{x:.3f} {unit}" if unit == "s/GB" else f"{x:g} {unit}"


def targets_section(res: Dict[str, Any]) -> List[str]:
    """The targets next to the figures they are judged on: every size's, then the standalone scripts'."""
    rows = []
    for e in res["sizes"]:
        for t in e.get("size_targets") or []:
            rows.append([t["target"], human_size(e["size"]), _figure(num(t.get("measured")), t.get("unit", "")),
                         _verdict(t.get("met"))])
    for x in res.get("standalone") or []:
        for t in x.get("targets") or []:
            rows.append([t.get("target", "?"), x["script"], _figure(num(t.get("measured")), t.get("unit", "")),
                         _verdict(t.get("met"))])
        if x.get("failed"):
            rows.append([x["title"], x["script"], x["failed"], "n/a"])
    if not rows:
        return []
    return ["", "## Targets", "",
            "Each operation in a fresh process from a cold page cache, interleaved with its peers and with fio "
            "(the rows of each size below); one machine, so the verdicts hold for this disk and these CPUs.", ""] + \
        _table(["target", "measured at", "figure", "verdict"], rows)


def standalone_section(res: Dict[str, Any]) -> List[str]:
    """The standalone scripts' tables (STANDALONE): what does not fit the per-size save/load table."""
    L: List[str] = []
    for x in res.get("standalone") or []:
        L += ["", f"## {x['title']}", ""]
        if x.get("failed"):
            L.append(f"Not measured ({x['script']}): {x['failed']}")
            continue
        if x.get("columns") and x.get("rows"):
            L += _table([str(c) for c in x["columns"]],
                        [[format(c, ".3g") if isinstance(c, float) else str(c) for c in r] for r in x["rows"]])
        L += [f"- note: {n}" for n in x.get("notes") or []]
        L += [f"- **ERROR**: {n}" for n in x.get("errors") or []]
        L.append(f"- ({x['script']}, [raw output]({x['md']}))")
        L += [f"\n![{os.path.basename(p)[:-4]}]({p})" for p in x.get("images") or []]
    return L


def assemble(res: Dict[str, Any], out: str) -> List[str]:
    """Write REPORT.md, results.json and the charts into out; returns the paths written."""
    os.makedirs(out, exist_ok=True)
    pngs = charts(res, out)
    paths = list(pngs)
    p = os.path.join(out, "results.json")
    with open(p, "w") as f:
        json.dump(clean(res), f, indent=1, default=str)
        f.write("\n")
    paths.append(p)
    p = os.path.join(out, "REPORT.md")
    with open(p, "w") as f:
        f.write(markdown(res, pngs))
    paths.append(p)
    return paths


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=REPO_ROOT, help="directory on the disk to measure (default: the repository "
                                                     "root); each script works in a private temporary directory")
    ap.add_argument("--sizes", default=None, help=f"state dict sizes (default {DEFAULT_SIZES}; --quick: 64M)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per size, interleaved (default 3; --quick: 1)")
    ap.add_argument("--quick", action="store_true",
                    help="the whole pipeline in about a minute: --sizes 64M --reps 1 --tune-size 0, "
                         "bench_save_load.py --quick (one fio point, DCP thread_count 2 only), the standalone "
                         "scripts with --quick; output in build/bench-quick/ unless --out (make bench-quick)")
    ap.add_argument("--standalone", default=",".join(n for n, _, _ in STANDALONE if n not in OPT_IN),
                    help="comma-separated standalone scripts to run (default: " +
                         ", ".join(f"{n} ({s})" for n, s, _ in STANDALONE if n not in OPT_IN) + "; also: " +
                         ", ".join(f"{n} ({s})" for n, s, _ in STANDALONE if n in OPT_IN) + "; '' for none)")
    ap.add_argument("--deepspeed", choices=("yes", "no"), default="no",
                    help="also DeepSpeed's FastFileWriter (must be installed: " + DS_INSTALL + "; default no)")
    ap.add_argument("--tune-size", default=None, help="knob sweep at this size (default 1G; --quick and 0: none)")
    ap.add_argument("--tune-reps", type=int, default=2, help="knob sweep repetitions (default 2)")
    ap.add_argument("--extras", default="", help="comma-separated: engine (bench_engine.py --full), dcp "
                                                  "(bench_dcp.py)")
    ap.add_argument("--out", default=None, help="where the report goes (default build/bench; --quick: "
                                               "build/bench-quick; benchmarks/results: the committed report)")
    ap.add_argument("--save-load-args", default="", help="more options for bench_save_load.py, in one string")
    ap.add_argument("--command", default="make bench", help="how the report says it was produced")
    ap.add_argument("--assemble-only", action="store_true", help="rebuild the report from OUT/raw, measure nothing")
    args = ap.parse_args(argv)
    args.sizes = args.sizes or ("64M" if args.quick else DEFAULT_SIZES)
    args.reps = args.reps or (1 if args.quick else 3)
    args.tune_size = args.tune_size if args.tune_size is not None else ("0" if args.quick else "1G")
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    args.standalone = [x for x in args.standalone.split(",") if x]
    bad = [x for x in args.standalone if x not in [n for n, _, _ in STANDALONE]]
    if bad:
        ap.error(f"--standalone: unknown {bad}")
    args.save_load_args = (["--quick"] if args.quick else []) + args.save_load_args.split()
    args.dir = os.path.abspath(args.dir)
    args.out = os.path.abspath(args.out)
    raw = os.path.join(args.out, "raw")
    bad = [x for x in args.extras.split(",") if x and x not in ("engine", "dcp")]
    if bad:
        ap.error(f"--extras: unknown {bad}")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    for s in args.sizes.split(","):
        try:
            fb.parse_size(s)
        except argparse.ArgumentTypeError as e:
            ap.error(f"--sizes: {e}")
    if args.tune_size not in ("", "0"):
        try:
            fb.parse_size(args.tune_size)
        except argparse.ArgumentTypeError as e:
            ap.error(f"--tune-size: {e}")
    meta_path = os.path.join(raw, "meta.json")
    t0 = time.perf_counter()
    if args.assemble_only:
        with open(meta_path) as f:
            saved = json.load(f)
        meta, machine, settings = saved["meta"], saved["machine"], saved["settings"]
    else:
        if not os.path.isdir(args.dir):
            ap.error(f"--dir {args.dir}: not a directory")
        fio = fb.find_fio()
        machine = fb.machine_info(args.dir, fio)
        if machine["fstype"] in ("tmpfs", "ramfs"):
            log(f"WARNING: {args.dir} is on {machine['fstype']}: this measures memory, not a disk (set BENCH_DIR)")
        if fio is None:
            log(f"NOTE: {fb.FIO_MISSING}")
        if os.path.isdir(raw):
            shutil.rmtree(raw)  # one run's raw files, never a mix of two runs
        os.makedirs(raw)
        log(f"benchmark report: {args.dir} ({machine['fstype']} on {machine['mount']['source']}), sizes {args.sizes}, "
            f"{args.reps} reps; output in {args.out}")
        meta = measure(args, raw)
        settings = {"sizes": args.sizes, "reps": args.reps, "tune_size": args.tune_size, "tune_reps": args.tune_reps,
                    "quick": args.quick, "standalone": args.standalone,
                    "deepspeed": args.deepspeed, "extras": args.extras, "command": args.command,
                    "save_load_args": args.save_load_args, "seconds": round(time.perf_counter() - t0, 1)}
        with open(meta_path, "w") as f:
            json.dump({"meta": meta, "machine": machine, "settings": settings}, f, indent=1)
    res = collect(args.out, meta, machine, settings)
    paths = assemble(res, args.out)
    print(f"report: {os.path.relpath(os.path.join(args.out, 'REPORT.md'))}")
    for p in paths:
        if not p.endswith("REPORT.md"):
            print(f"  {os.path.relpath(p)}")
    failed = [r for r in meta["runs"] if r.get("exit")] + ([meta["tune"]] if meta.get("tune") and
                                                          meta["tune"].get("exit") else [])
    failed += [r for r in (meta.get("standalone") or {}).values() if r.get("exit")]
    errors = [x for e in res["sizes"] for x in e.get("errors") or []]
    if failed or errors:
        log(f"{len(failed)} script(s) failed, {len(errors)} error(s): see the report")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
