#!/usr/bin/env python3
"""The cluster benchmark's report: bench_cluster.py's JSON (one per world size) -> Markdown, a
scaling chart and the cluster targets.

    python benchmarks/cluster_report.py build/bench-cluster/w1.json build/bench-cluster/w2.json ... \\
        --out build/bench-cluster

writes CLUSTER.md, cluster.json (every run) and cluster_scaling.png into --out. cluster_emulate.py
and bench_cluster.py (one world size, on stdout) use the same functions.

Definitions (stated in the report too): N = nodes; B = each node's bandwidth to storage
(--link-mbps); checkpoint GB/s = checkpoint bytes / the slowest rank's seconds (from the barrier
before the operation to the rank's return); all-ranks GB/s = bytes written (read) by all ranks,
from /proc/self/io, / the same seconds.
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

MODE_ORDER = ("rank0", "collective", "node", "fastdcp", "dcp")
SHORT = {"rank0": "rank-0-only", "collective": "collective (shared file)", "node": "node-local copies",
         "fastdcp": "DCP FastWriter/FastReader", "dcp": "DCP stock FileSystemWriter/Reader"}
TITLE = "Cluster benchmark: replicated state, every rank (bench_cluster.py)"
# A rank's share of the writes the blkio cgroup did not see, above which its row is flagged as not
# (fully) throttled: cgroup v1 charges buffered writeback to the flusher threads, not to the writer.
UNTHROTTLED_FRACTION = 0.10


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:.0f}"


def _f(x: Optional[float], fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def link_gbps(run: Dict[str, Any]) -> Optional[float]:
    return run["link_mbps"] / 1e3 if run.get("link_mbps") else None


def nodes(run: Dict[str, Any]) -> int:
    return len(run.get("nodes") or []) or run["world"]


def mode(run: Dict[str, Any], name: str) -> Optional[Dict[str, Any]]:
    return next((m for m in run["modes"] if m["mode"] == name), None)


def throttled(op: Dict[str, Any], key: str) -> Optional[float]:
    """The smallest fraction, over ranks that moved at least 1 MB, of a rank's bytes its blkio cgroup saw."""
    fr = []
    for r in op.get("ranks") or []:
        got, cg = r.get(key), r.get("cgroup_" + key)
        if got and got >= 1e6 and cg is not None:
            fr.append(min(1.0, cg / got))
    return min(fr) if fr else None


def op_row(run: Dict[str, Any], m: Dict[str, Any], opname: str) -> List[str]:
    op = m.get(opname) or {}
    b, n = link_gbps(run), nodes(run)
    if op.get("skipped"):
        return [SHORT[m["mode"]], opname, op["skipped"]] + [""] * (len(HEADER) - 3)
    key = "write_bytes" if opname == "save" else "read_bytes"
    per_rank_b = "/".join(_mb(r.get(key)) for r in op["ranks"])
    per_rank_s = "/".join(f"{r['seconds']:.2f}" for r in op["ranks"])
    th = throttled(op, key)
    if th is None:
        th_s = "-"
    else:
        th_s = f"{th * 100:.0f}%" + (" (NOT throttled: buffered writeback)" if th < 1 - UNTHROTTLED_FRACTION else "")
    notes = []
    if opname == "load":
        notes.append(op.get("check", ""))
    notes += op.get("errors") or []
    return [SHORT[m["mode"]], opname, _f(op.get("slowest_s")), _f(op.get("ckpt_gbps"), ".3f"),
            _f(_ratio(op.get("ckpt_gbps"), b)), _f(op.get("aggregate_gbps"), ".3f"),
            _f(_ratio(op.get("aggregate_gbps"), b * n if b else None)), per_rank_b, per_rank_s, th_s,
            "; ".join(x for x in notes if x)]


HEADER = ["mode", "op", "slowest rank s", "checkpoint GB/s", "x B", "all ranks GB/s", "x N*B",
          "MB per rank (save: written, load: read)", "s per rank", "seen by the rank's blkio cgroup", "check, errors"]


def run_rows(run: Dict[str, Any]) -> List[List[str]]:
    rows = []
    for m in sorted(run["modes"], key=lambda m: MODE_ORDER.index(m["mode"])):
        if not m.get("available"):
            rows.append([SHORT[m["mode"]], "-", m.get("reason", "unavailable")] + [""] * (len(HEADER) - 3))
            continue
        rows.append(op_row(run, m, "save"))
        rows.append(op_row(run, m, "load"))
    return rows


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


# ----------------------------------------------------------------------------- targets

def targets(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The cluster targets per world size: [{"target", "measured", "unit", "met", "at"}]."""
    out = []
    for run in sorted(runs, key=lambda r: r["world"]):
        n, b = nodes(run), link_gbps(run)
        at = f"N={n}"

        def add(target, measured, unit, met):
            out.append({"target": target, "measured": measured, "unit": unit, "met": met, "at": at})

        def op(name, opname):
            m = mode(run, name)
            o = (m or {}).get(opname) or {}
            return None if not m or not m.get("available") or o.get("skipped") or o.get("errors") else o

        c = op("collective", "save")
        if b:
            x = _ratio(c and c.get("ckpt_gbps"), n * b)
            add("collective save >= 0.9 x N x B (checkpoint GB/s)", x, "x N*B", None if x is None else x >= 0.9)
            s = op("node", "save")
            x = _ratio(s and s.get("aggregate_gbps"), n * b)
            add("node-local save >= 0.9 x N x B (all nodes' copies)", x, "x N*B", None if x is None else x >= 0.9)
            r = op("rank0", "save")
            x = _ratio(r and r.get("ckpt_gbps"), b)
            add("rank-0-only save about B (0.75-1.15 x B)", x, "x B", None if x is None else 0.75 <= x <= 1.15)
        cl, whole = op("collective", "load"), op("rank0", "load")
        if cl and cl.get("ckpt_bytes") and all(r.get("read_bytes") is not None for r in cl["ranks"]):
            x = max(r["read_bytes"] for r in cl["ranks"]) / cl["ckpt_bytes"] * n
            add("collective load reads about 1/N per rank (largest rank's bytes <= 1.15 x file/N)", x,
                "x file/N", x <= 1.15)
        else:
            add("collective load reads about 1/N per rank", None, "x file/N", None)
        x = _ratio(whole and whole.get("slowest_s"), cl and cl.get("slowest_s"))
        add("collective load >= 0.8 x N times faster than every rank reading the whole file", x,
            f"x (target {0.8 * n:.1f})", None if x is None else x >= 0.8 * n)
    return out


def _verdict(met: Optional[bool]) -> str:
    return "n/a" if met is None else ("**met**" if met else "**NOT met**")


# ----------------------------------------------------------------------------- Markdown

def notes(runs: List[Dict[str, Any]]) -> List[str]:
    out = []
    emu = next((r.get("emulation") for r in runs if r.get("emulation")), None)
    if emu:
        out.append(emu.get("description", "emulated"))
        out.append("cgroup v1 blkio throttles only I/O charged to the rank's cgroup (O_DIRECT, reads, writeback the "
                   "rank itself starts, e.g. by fsync): buffered writes written back by the kernel's flusher threads "
                   "are charged to the root cgroup and escape the limit, so a save through the page cache (stock "
                   "DCP's FileSystemWriter) can beat B here. The column 'seen by the rank's blkio cgroup' is the "
                   "smallest share, over ranks, of a rank's /proc/self/io bytes that its cgroup counted; rows under "
                   f"{100 - UNTHROTTLED_FRACTION * 100:.0f}% are flagged NOT throttled (their figure is the host "
                   "disk's, not the emulated link's). Every save's fsyncs are inside its timing.")
    else:
        out.append("not emulated: whatever disks and network this ran on (no blkio throttling).")
    loads = [f"N={nodes(r)}: {r['load_avg'][0]:g}" for r in runs if r.get("load_avg")]
    if loads:
        out.append("load average (1 min) at the start of each world size: " + ", ".join(loads))
    caches = sorted({m.get("cache") for r in runs for m in r["modes"] if m.get("cache")})
    out.append("page cache before each load: " + ("; ".join(caches) if caches else "no load ran"))
    out.append("checkpoint GB/s = checkpoint bytes / the slowest rank's seconds (barrier before the operation to "
               "the rank's return); all ranks GB/s = bytes all ranks wrote (read), from /proc/self/io, / the same "
               "seconds; x B = checkpoint GB/s / B; x N*B = all ranks GB/s / (N x B). Node-local copies: N copies "
               "are written, so the checkpoint GB/s stays about B while all ranks write N x B.")
    out.append("DCP with replicated (plain tensor) state: its planner deduplicates every tensor onto one rank "
               "(spread over the ranks); every rank then reads every tensor on load (bytes per rank above).")
    return out


def markdown(runs: List[Dict[str, Any]], chart: Optional[str] = None, level: int = 2) -> List[str]:
    h = "#" * level
    runs = sorted(runs, key=lambda r: r["world"])
    if not runs:
        return [f"{h} {TITLE}", "", "No results (no world size produced its JSON)."]
    r0 = runs[0]
    sd = r0.get("state_dict") or {}
    b = r0.get("link_mbps")
    L = [f"{h} {TITLE}", "",
         f"{sd.get('bytes', 0) / 1e9:.3f} GB of tensors ({sd.get('tensors', '?')} tensors, model + AdamW), "
         f"world sizes {', '.join(str(r['world']) for r in runs)}, backend {r0.get('backend')}, "
         + (f"B = {b:g} MB/s per node" if b else "B not given (no x B columns)")
         + f"; fastckpt {r0.get('fastckpt')}, torch {r0.get('torch')}, started {r0.get('started')}."]
    L += [""] + [f"- {n}" for n in notes(runs)]
    for run in runs:
        L += ["", f"{h}# N = {nodes(run)} node(s), {run['world']} rank(s)", ""]
        L += _table(HEADER, run_rows(run))
    t = targets(runs)
    if t:
        L += ["", f"{h}# Targets", ""]
        L += _table(["target", "at", "measured", "verdict"],
                    [[x["target"], x["at"], "not measured" if x["measured"] is None else
                      f"{x['measured']:.2f} {x['unit']}", _verdict(x["met"])] for x in t])
    if chart:
        L += ["", f"![cluster scaling]({chart})"]
    return L


# ----------------------------------------------------------------------------- chart

def draw(runs: List[Dict[str, Any]], path: str) -> Optional[str]:
    """The scaling chart: checkpoint GB/s against N per mode, save and load; B and N x B dashed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no chart: matplotlib unavailable ({e})", file=sys.stderr)
        return None
    runs = sorted(runs, key=lambda r: r["world"])
    ns = [nodes(r) for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    for ax, opname in zip(axes, ("save", "load")):
        for i, name in enumerate(MODE_ORDER):
            xs, ys, xa, ya = [], [], [], []
            for run, n in zip(runs, ns):
                m = mode(run, name)
                o = (m or {}).get(opname) or {}
                if m and m.get("available") and o.get("ckpt_gbps") is not None and not o.get("errors"):
                    xs.append(n)
                    ys.append(o["ckpt_gbps"])
                    if o.get("aggregate_gbps") is not None:
                        xa.append(n)
                        ya.append(o["aggregate_gbps"])
            if xs:
                ax.plot(xs, ys, marker="o", color=f"C{i}", label=SHORT[name])
            if name == "node" and opname == "save" and xa:
                ax.plot(xa, ya, marker="s", linestyle=":", color=f"C{i}", label=SHORT[name] + ": all nodes' writes")
        b = link_gbps(runs[0])
        if b:
            ax.plot(ns, [n * b for n in ns], "k--", linewidth=1, label="N x B")
            ax.plot(ns, [b for _ in ns], "k:", linewidth=1, label="B (one node's link)")
        ax.set_xticks(ns)
        ax.set_xlabel("N (nodes)")
        ax.set_ylabel("GB/s (1e9 B/s) over the slowest rank's time")
        ax.set_ylim(bottom=0)
        ax.set_title(opname + (" (cold: the checkpoint evicted from the page cache)" if opname == "load"
                               else " (durable: fsync inside)"), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    emu = next((r.get("emulation") for r in runs if r.get("emulation")), None)
    fig.suptitle("fastckpt cluster benchmark" + (": emulated nodes (loop filesystems, blkio throttle)" if emu else ""),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- outputs

def standalone(runs: List[Dict[str, Any]], chart_rel: Optional[str], errors: List[str]) -> Dict[str, Any]:
    """benchmarks/report.py's standalone contract (its STANDALONE): one table, targets, notes, images."""
    rows = []
    for run in sorted(runs, key=lambda r: r["world"]):
        for r in run_rows(run):
            rows.append([str(nodes(run))] + r)
    return {"title": TITLE, "columns": ["N"] + HEADER, "rows": rows,
            "targets": [{"target": f"{t['target']} at {t['at']}", "measured": t["measured"], "unit": t["unit"],
                         "met": t["met"]} for t in targets(runs)],
            "notes": notes(runs) if runs else [], "errors": errors, "images": [chart_rel] if chart_rel else []}


def write(runs: List[Dict[str, Any]], out: str) -> List[str]:
    """CLUSTER.md, cluster.json and cluster_scaling.png into out; returns the paths."""
    os.makedirs(out, exist_ok=True)
    paths = []
    png = draw(runs, os.path.join(out, "cluster_scaling.png")) if runs else None
    if png:
        paths.append(png)
    p = os.path.join(out, "cluster.json")
    with open(p, "w") as f:
        json.dump({"kind": "fastckpt-bench-cluster-report", "version": 1, "runs": runs, "targets": targets(runs)},
                  f, indent=1)
        f.write("\n")
    paths.append(p)
    p = os.path.join(out, "CLUSTER.md")
    with open(p, "w") as f:
        f.write("\n".join(markdown(runs, os.path.basename(png) if png else None, level=1)) + "\n")
    paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_cluster.py --json files (one per world size)")
    ap.add_argument("--out", required=True, help="directory for CLUSTER.md, cluster.json, cluster_scaling.png")
    args = ap.parse_args(argv)
    runs = []
    for p in args.runs:
        with open(p) as f:
            runs.append(json.load(f))
    for p in write(runs, args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
