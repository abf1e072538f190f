#!/usr/bin/env python3
"""Cluster benchmark: replicated (data-parallel) state saved and loaded by every rank of a job.

One process per rank, started by ``torchrun`` (or anything that sets torchrun's variables: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE), gloo on CPU. Every rank builds
the same state dict of ``--size`` bytes (benchmarks/workload.py: model + AdamW, fixed seed) and,
for each mode, saves it and then loads it back (the checkpoint's pages evicted from the page cache
in between), timing every rank between two barriers:

* ``rank0``: rank 0 ``fastckpt.save(sd, path)`` while the others wait; load: every rank
  ``fastckpt.load(path)`` of the whole file (the DDP way without the collective load);
* ``collective``: ``fastckpt.save(sd, path, group=pg)`` into ONE file on the shared directory;
  load: ``fastckpt.load(path, group=pg)`` (each rank reads its share, the shares are exchanged);
* ``node``: ``fastckpt.save(sd, local, group=pg, placement="node")``: one complete copy per node
  on ``--local-dir`` (the node's own disk); load: ``fastckpt.load(local, group=pg)``;
* ``fastdcp``: ``dcp.save`` / ``dcp.load`` with fastckpt's ``FastWriter`` / ``FastReader``;
* ``dcp``: ``dcp.save`` / ``dcp.load`` with stock ``FileSystemWriter(sync_files=True)`` /
  ``FileSystemReader``. DCP's planner deduplicates replicated (plain, non-DTensor) tensors: each is
  written by one rank; the per-rank bytes written show how it spread them.

A mode (or one of its operations) that the installed fastckpt lacks (``group=`` on load,
``placement=`` on save) is reported as unavailable, with the reason, not run.

Per operation and rank: seconds from the opening barrier to the rank's return, bytes written and
read (``/proc/self/io`` write_bytes / read_bytes deltas: what reached the block layer, page-cache
hits excluded) and, with ``--blkio-stats FILE``, the bytes the rank's blkio cgroup saw. Aggregate
figures: checkpoint GB/s = checkpoint bytes / the slowest rank's seconds; aggregate GB/s = bytes
written (read) by all ranks / the same seconds. Rank 0 writes everything to ``--json`` and prints a
Markdown summary (benchmarks/cluster_report.py renders it; ``cluster_report.py RUN.json ...``
assembles several world sizes into one report with a scaling chart).

Command lines::

    # one node, 4 ranks, a directory on the node's disk:
    torchrun --standalone --nproc-per-node=4 benchmarks/bench_cluster.py --dir /nvme/ckpt --size 4G \\
        --json bench-cluster-w4.json

    # N nodes, one rank per node (or more), a shared filesystem mounted at the same path on every
    # node, and each node's own disk at the same local path (for the node-local copies); run on
    # every node:
    torchrun --nnodes=N --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        benchmarks/bench_cluster.py --dir /shared/ckpt --local-dir /local/nvme/ckpt --size 4G \\
        --link-mbps 1250 --json /shared/ckpt/bench-cluster-wN.json

    # then, on one machine, all world sizes into one report + chart:
    python benchmarks/cluster_report.py bench-cluster-w*.json --out build/bench-cluster

On one machine, ``benchmarks/cluster_emulate.py`` (``make bench-cluster``) emulates N nodes with
separate, bandwidth-limited loop-device filesystems and blkio cgroups and runs this script.
"""

import argparse
import datetime
import gc
import inspect
import json
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
try:
    import fastckpt  # noqa: F401
except ImportError:  # a checkout whose extension was built in place but not installed
    sys.path.insert(0, REPO_ROOT)
    import fastckpt  # noqa: F401
if REPO_ROOT not in sys.path:  # the checkout's `benchmarks` package
    sys.path.insert(1, REPO_ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import harness as fb  # noqa: E402
from benchmarks.workload import build_state_dict, compare, describe_sd, map_tensors  # noqa: E402

MODES = ("rank0", "collective", "node", "fastdcp", "dcp")
LABELS = {
    "rank0": "rank-0-only save / every rank loads the whole file",
    "collective": "collective save (group=) / collective load (group=), one shared file",
    "node": "node-local copies (placement=\"node\") / collective load from them",
    "fastdcp": "DCP FastWriter / FastReader",
    "dcp": "DCP stock FileSystemWriter / FileSystemReader",
}
JSON_KIND = "fastckpt-bench-cluster"
JSON_VERSION = 1


def log(msg: str) -> None:
    print(f"[bench_cluster rank {os.environ.get('RANK', '?')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- counters

def proc_io() -> Dict[str, Optional[int]]:
    """This process's read_bytes / write_bytes (all its threads) from /proc/self/io, or None each."""
    out: Dict[str, Optional[int]] = {"read_bytes": None, "write_bytes": None}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in out:
                    out[k] = int(v)
    except (OSError, ValueError):
        pass
    return out


def blkio_bytes(stats_file: Optional[str]) -> Dict[str, Optional[int]]:
    """Read / Write bytes summed over every device in a cgroup v1 blkio.throttle.io_service_bytes file."""
    out: Dict[str, Optional[int]] = {"read_bytes": None, "write_bytes": None}
    if not stats_file:
        return out
    try:
        with open(stats_file) as f:
            r = w = 0
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[1] == "Read":
                    r += int(parts[2])
                elif len(parts) == 3 and parts[1] == "Write":
                    w += int(parts[2])
        out.update(read_bytes=r, write_bytes=w)
    except (OSError, ValueError):
        pass
    return out


def _delta(a: Dict[str, Optional[int]], b: Dict[str, Optional[int]], k: str) -> Optional[int]:
    return None if a.get(k) is None or b.get(k) is None else b[k] - a[k]


# ----------------------------------------------------------------------------- availability

def _params(fn: Callable) -> set:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def unavailable(mode: str) -> Tuple[Optional[str], Optional[str]]:
    """(why the save cannot run, why the load cannot run): None where it can. Decided from the
    installed fastckpt's signatures, identically on every rank (so no rank enters a collective alone)."""
    save_p, load_p = _params(fastckpt.save), _params(fastckpt.load)
    no_group_load = ("unavailable: this fastckpt.load has no group= parameter (collective load not in "
                     "this installation)") if "group" not in load_p else None
    if mode == "collective":
        return (None if "group" in save_p else "unavailable: this fastckpt.save has no group= parameter"), no_group_load
    if mode == "node":
        why = None if "placement" in save_p else ("unavailable: this fastckpt.save has no placement= parameter "
                                                  "(node-local copies not in this installation)")
        return why, (why or no_group_load)
    if mode in ("fastdcp", "dcp"):
        try:
            import torch.distributed.checkpoint  # noqa: F401
            if mode == "fastdcp":
                from fastckpt.dcp import FastWriter, FastReader  # noqa: F401
        except Exception as e:  # noqa: BLE001
            why = f"unavailable: {type(e).__name__}: {e}"
            return why, why
    return None, None


# ----------------------------------------------------------------------------- the run

class Ctx:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.host = socket.gethostname()
        self.node = os.environ.get("FASTCKPT_NODE") or self.host
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        infos = [None] * self.world
        dist.all_gather_object(infos, (self.rank, self.host, self.node))
        self.hosts = [h for _, h, _ in infos]
        self.nodes = [n for _, _, n in infos]
        # one rank per node does the node's chores (its local directory), one per machine the machine's (page cache)
        self.node_leader = self.nodes.index(self.node) == self.rank
        self.host_leader = self.hosts.index(self.host) == self.rank
        run_id = [datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"]
        dist.broadcast_object_list(run_id, src=0)
        self.run_id = run_id[0]
        self.template: Any = None  # dcp.load's target, made before its timing
        self.shared = os.path.join(args.dir, f"fastckpt-bench-cluster-{self.run_id}")
        local = (args.local_dir or os.path.join(args.dir, "node-local", "{node}")).format(node=self.node)
        self.local = os.path.join(local, f"fastckpt-bench-cluster-{self.run_id}")
        if self.rank == 0:
            os.makedirs(self.shared)
        if self.node_leader:
            os.makedirs(self.local, exist_ok=True)
        dist.barrier()

    def gather(self, obj: Any) -> List[Any]:
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def timed(ctx: Ctx, op: Callable[[], Any]) -> Tuple[List[Dict[str, Any]], Any, float]:
    """Run op on every rank between two barriers: (every rank's record, this rank's result, barrier-to-barrier s)."""
    dist.barrier()
    io0, cg0, cpu0 = proc_io(), blkio_bytes(ctx.args.blkio_stats), fb.cpu_self()
    t0 = time.perf_counter()
    err, result = None, None
    try:
        result = op()
    except Exception as e:  # noqa: BLE001  (recorded; every rank learns of it below)
        err = f"{type(e).__name__}: {e}"
        log("".join(traceback.format_exception(e)).rstrip())
    t1 = time.perf_counter()
    io1, cg1, cpu1 = proc_io(), blkio_bytes(ctx.args.blkio_stats), fb.cpu_self()
    rec = {"rank": ctx.rank, "node": ctx.node, "host": ctx.host, "seconds": t1 - t0, "cpu_s": cpu1 - cpu0,
           "write_bytes": _delta(io0, io1, "write_bytes"), "read_bytes": _delta(io0, io1, "read_bytes"),
           "cgroup_write_bytes": _delta(cg0, cg1, "write_bytes"), "cgroup_read_bytes": _delta(cg0, cg1, "read_bytes"),
           "error": err}
    recs = ctx.gather(rec)  # also the closing barrier
    return recs, result, time.perf_counter() - t0


def summarize(recs: List[Dict[str, Any]], ckpt_bytes: Optional[int], b2b: float, key: str) -> Dict[str, Any]:
    slowest = max(r["seconds"] for r in recs)
    moved = [r[key] for r in recs]
    total = sum(moved) if all(m is not None for m in moved) else None
    return {"ranks": recs, "slowest_s": slowest, "barrier_to_barrier_s": b2b, "ckpt_bytes": ckpt_bytes,
            "ckpt_gbps": ckpt_bytes / slowest / 1e9 if ckpt_bytes and slowest > 0 else None,
            "all_ranks_bytes": total, "aggregate_gbps": total / slowest / 1e9 if total is not None and slowest > 0
            else None, "errors": [f"rank {r['rank']}: {r['error']}" for r in recs if r["error"]]}


def make_cold(ctx: Ctx, paths: List[str]) -> str:
    """Between a save and its load, on every rank: the checkpoint's pages evicted from the page cache
    (fdatasync + posix_fadvise(DONTNEED) of each file: precise, unprivileged, leaves the rest of the
    machine alone; on a shared filesystem it drops this client's cached pages), or with
    ``--drop-caches`` the whole page cache dropped by one rank per machine (root only; libraries are
    then paged in again during the timing and counted in read_bytes). Returns what was done."""
    dist.barrier()
    if ctx.args.warm:
        note = "warm: --warm given"
    else:
        note = "checkpoint files evicted (fdatasync + posix_fadvise DONTNEED) on every rank"
        if ctx.args.drop_caches and ctx.host_leader:
            err = fb.drop_caches()
            note = "dropped (/proc/sys/vm/drop_caches)" if err is None else \
                f"NOT dropped ({err}); checkpoint files evicted with posix_fadvise DONTNEED instead"
        for p in paths:
            if os.path.exists(p):
                fb.evict_file_cache(p)
    notes = ctx.gather(note if ctx.host_leader else None)
    dist.barrier()
    return "; ".join(sorted({n for n in notes if n}))


def ops(ctx: Ctx, mode: str, sd: Dict[str, Any]) -> Tuple[str, Callable[[], Any], Callable[[], Any]]:
    """(the path whose size is the checkpoint's, save op, load op) of a mode."""
    pg = dist.group.WORLD
    shared = os.path.join(ctx.shared, mode)
    if mode == "rank0":
        path = shared + ".pt"
        return path, (lambda: fastckpt.save(sd, path) if ctx.rank == 0 else None), (lambda: fastckpt.load(path))
    if mode == "collective":
        path = shared + ".pt"
        return path, (lambda: fastckpt.save(sd, path, group=pg)), (lambda: fastckpt.load(path, group=pg))
    if mode == "node":
        path = os.path.join(ctx.local, "node.pt")
        return (path, (lambda: fastckpt.save(sd, path, group=pg, placement="node")),
                (lambda: fastckpt.load(path, group=pg)))
    import torch.distributed.checkpoint as dcp
    if mode == "fastdcp":
        from fastckpt.dcp import FastReader, FastWriter
        writer, reader = (lambda: FastWriter(shared)), (lambda: FastReader(shared))
    else:
        writer = (lambda: dcp.FileSystemWriter(shared, sync_files=True))
        reader = (lambda: dcp.FileSystemReader(shared))

    def load():
        # dcp.load fills an existing state dict: allocated and touched before the timing starts
        # (an advantage to DCP); `ops` callers build it through `prepare`.
        dcp.load(ctx.template, storage_reader=reader())
        return ctx.template

    return shared, (lambda: dcp.save(sd, storage_writer=writer())), load


def run_mode(ctx: Ctx, mode: str, sd: Dict[str, Any]) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"mode": mode, "label": LABELS[mode]}
    save_why, load_why = unavailable(mode)
    if save_why:
        entry.update(available=False, reason=save_why)
        return entry
    entry["available"] = True
    path, save, load = ops(ctx, mode, sd)
    if ctx.rank == 0:
        log(f"{mode}: save")
    recs, _, b2b = timed(ctx, save)
    size_of = ctx.gather(fb.path_bytes(path) if os.path.exists(path) else None)
    ckpt = size_of[0] if mode != "node" else next((s for s in size_of if s), None)
    entry["save"] = summarize(recs, ckpt, b2b, "write_bytes")
    entry["node_copy_bytes"] = size_of if mode == "node" else None
    if entry["save"]["errors"]:
        entry["load"] = {"skipped": "the save failed"}
    elif load_why:
        entry["load"] = {"skipped": load_why}
    else:
        entry["cache"] = make_cold(ctx, [path, ctx.shared, ctx.local])
        ctx.template = map_tensors(sd, torch.zeros_like) if mode in ("fastdcp", "dcp") else None
        if ctx.rank == 0:
            log(f"{mode}: load ({entry['cache']})")
        recs, got, b2b = timed(ctx, load)
        check = "no result" if got is None else ("equal" if not compare(sd, got) else
                                                 "DIFFERS: " + "; ".join(compare(sd, got)))
        checks = ctx.gather(check)
        for r, c in zip(recs, checks):
            r["check"] = c
        entry["load"] = summarize(recs, ckpt, b2b, "read_bytes")
        entry["load"]["check"] = "equal on every rank" if all(c == "equal" for c in checks) else \
            "; ".join(f"rank {i}: {c}" for i, c in enumerate(checks) if c != "equal")
        del got
        ctx.template = None
    dist.barrier()
    if (ctx.node_leader if mode == "node" else ctx.rank == 0):
        fb.remove(path)
    gc.collect()
    dist.barrier()
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="the shared directory (same path on every node; on one node: "
                                                 "any directory on the disk to measure)")
    ap.add_argument("--local-dir", default=None,
                    help="each node's own directory for the node-local copies (same path on every node, its own "
                         "disk; '{node}' is replaced by the node's name). Default: DIR/node-local/{node}")
    ap.add_argument("--size", type=fb.parse_size, default=fb.parse_size("1G"), help="state dict bytes (default 1G)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)} (default all)")
    ap.add_argument("--json", default=None, help="rank 0 writes the results here (default: none, Markdown only)")
    ap.add_argument("--link-mbps", type=float, default=None,
                    help="each node's bandwidth to storage B in MB/s (1e6 B/s), for the x B and x N*B columns")
    ap.add_argument("--blkio-stats", default=None,
                    help="a cgroup v1 blkio.throttle.io_service_bytes file that counts this rank's I/O alone "
                         "(cluster_emulate.py passes each rank's)")
    ap.add_argument("--emulation", default=None, help="a JSON object describing the emulation (cluster_emulate.py)")
    ap.add_argument("--warm", action="store_true", help="leave the checkpoint in the page cache before loads")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the whole page cache before loads (root; one rank per machine) besides evicting "
                         "the checkpoint's files")
    ap.add_argument("--timeout", type=float, default=600, help="process group timeout, seconds (default 600)")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad} (known: {', '.join(MODES)})")
    args.dir = os.path.abspath(args.dir)
    if "RANK" not in os.environ:
        ap.error("run me under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT unset); see --help")
    backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        ctx = Ctx(args)
        t = time.perf_counter()
        sd = build_state_dict(args.size)
        info = describe_sd(sd)
        info["build_s"] = round(time.perf_counter() - t, 2)
        if ctx.rank == 0:
            log(f"world {ctx.world} on {len(set(ctx.nodes))} node(s): {info['bytes'] / 1e9:.3f} GB state dict, "
                f"modes {','.join(modes)}, shared dir {ctx.shared}")
        res: Dict[str, Any] = {
            "kind": JSON_KIND, "version": JSON_VERSION, "world": ctx.world, "nodes": sorted(set(ctx.nodes)),
            "rank_nodes": ctx.nodes, "rank_hosts": ctx.hosts, "backend": backend, "size": args.size,
            "state_dict": info, "link_mbps": args.link_mbps, "dir": args.dir,
            "local_dir": args.local_dir, "argv": sys.argv, "fastckpt": fb.fastckpt_version(),
            "torch": torch.__version__, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "emulation": json.loads(args.emulation) if args.emulation else None,
            "blkio_stats": bool(args.blkio_stats), "load_avg": [round(x, 2) for x in os.getloadavg()], "modes": []}
        for mode in modes:
            res["modes"].append(run_mode(ctx, mode, sd))
        dist.barrier()
        if ctx.rank == 0:
            fb.remove(ctx.shared)
        if ctx.node_leader:
            fb.remove(ctx.local)
            if args.local_dir is None:  # DIR/node-local/<node>/, made by us: gone when empty
                for d in (os.path.dirname(ctx.local), os.path.join(args.dir, "node-local")):
                    try:
                        os.rmdir(d)
                    except OSError:
                        pass
        if ctx.rank == 0:
            res["seconds"] = round(time.perf_counter() - t, 1)
            if args.json:
                os.makedirs(os.path.dirname(os.path.abspath(args.json)) or ".", exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
                    f.write("\n")
            from benchmarks import cluster_report
            print("\n".join(cluster_report.markdown([res])))
        failed = any(e.get(op, {}).get("errors") for e in res["modes"] for op in ("save", "load"))
        bad_check = any("DIFFERS" in (e.get("load") or {}).get("check", "") for e in res["modes"])
        dist.barrier()
        return 1 if failed or bad_check else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
