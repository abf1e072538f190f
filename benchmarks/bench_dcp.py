#!/usr/bin/env python3
"""Benchmark torch.distributed.checkpoint storage: stock FileSystemWriter/Reader vs fastckpt's FastWriter/FastReader.

What is measured
----------------
One state dict of ``--size`` bytes (float32 weights of 32 MiB, each with a 16 KiB bias, and a few
non-tensor values; random bits, so nothing compresses) is saved and loaded with ``dcp.save`` /
``dcp.load``, every configuration interleaved with the others and with fio in each repetition:

* writes (durable): stock ``FileSystemWriter(thread_count=1, 2, 4, sync_files=True)``;
  ``FastWriter`` at world size 1 (``thread_count`` 1 and 2) and at world size 2 (two processes on
  this machine, gloo, every weight a DTensor ``Shard(0)``: each rank writes half). Time: from the
  call to the return of ``dcp.save`` (planning, writing, fsyncs, ``.metadata``); at world size 2
  from a barrier to the last rank's return.
* reads (world size 1, page cache dropped before each): the stock ``FileSystemReader`` and
  ``FastReader`` (with and without CRC verification) of the stock and the fastckpt checkpoints,
  into an existing state dict (how ``dcp.load`` is used), data compared with the source afterwards
  (untimed).
* fio on the same directory (``benchmarks/bench_engine.py``'s runner: O_DIRECT, io_uring, write
  with ``--end_fsync=1``, read after dropping the cache): the best fio point is "the disk's limit".

Columns: ``x stock`` = median / median of the best stock configuration (writes) or of the stock
reader on the stock checkpoint (reads); ``x fio`` = median / best fio median; ``paired`` = median
over repetitions of (figure / best fio of that repetition). ``CPU-s/GB``: user+sys of the
process(es) doing the work (for world size 2 both ranks) per 1e9 bytes; ``machine``: busy time of
all CPUs over the same window.

Examples::

    .venv/bin/python benchmarks/bench_dcp.py --size 512M --reps 1     # a quick check
    .venv/bin/python benchmarks/bench_dcp.py                           # 2 GiB, 3 repetitions
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
import bench_engine as be  # noqa: E402  (fio runner, page-cache drop, CPU counters, context)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

try:
    import fastckpt  # noqa: E402
except ImportError:
    sys.path.insert(0, REPO_ROOT)
    import fastckpt  # noqa: E402,F401
from fastckpt.dcp import FastReader, FastWriter  # noqa: E402

warnings.filterwarnings("ignore")

MiB = 1 << 20
ROWS, COLS = 2048, 4096  # one weight: 32 MiB of float32
TARGET = 0.95


# ----------------------------------------------------------------------------- the state dict

def n_weights(size: int) -> int:
    return max(1, size // (ROWS * COLS * 4))


def weight(i: int, rows: slice = slice(None)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    w = torch.empty(ROWS * COLS // 2, dtype=torch.int64).random_(-2**63, None, generator=g)
    return w.view(torch.float32).view(ROWS, COLS)[rows].clone() if rows != slice(None) else w.view(torch.float32).view(ROWS, COLS)


def bias(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + i)
    return torch.randn(COLS, generator=g)


def state_dict(size: int) -> Dict[str, object]:
    sd: Dict[str, object] = {}
    for i in range(n_weights(size)):
        sd[f"layers.{i}.weight"] = weight(i)
        sd[f"layers.{i}.bias"] = bias(i)
    sd["step"] = 1000
    sd["config"] = {"lr": 3e-4, "name": "bench"}
    return sd


def tensor_bytes(sd) -> int:
    return sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))


def same(a, b) -> bool:
    for k, v in b.items():
        if isinstance(v, torch.Tensor):
            if not torch.equal(a[k].view(torch.int32), v.view(torch.int32)):
                return False
        elif a[k] != v:
            return False
    return True


# ----------------------------------------------------------------------------- world size 2

def warm_up(mesh=None) -> None:
    """Untimed: create the engine (staging pool, io_uring rings) and run dcp once, as a training
    job would have long before its first checkpoint."""
    fastckpt.get_engine()
    with tempfile.TemporaryDirectory(prefix=".bench-warmup-", dir=REPO_ROOT) as d:
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard
            x = DTensor.from_local(torch.zeros(4), mesh, [Shard(0)], run_check=False)
            d = [d]
            dist.broadcast_object_list(d, src=0)
            d = d[0]
        else:
            x = torch.zeros(4)
        dcp.save({"x": x}, storage_writer=FastWriter(os.path.join(d, "w")))
        if mesh is not None:
            dist.barrier()


def worker(args) -> int:
    """A rank of the world-size-2 saves: holds its shards, saves on command (JSON lines on stdin)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (ws,))
    h = ROWS // ws
    sd: Dict[str, object] = {}
    for i in range(n_weights(args.size)):
        local = weight(i, slice(rank * h, (rank + 1) * h))
        sd[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                      shape=torch.Size((ROWS, COLS)), stride=(COLS, 1))
        sd[f"layers.{i}.bias"] = bias(i)
    sd["step"] = 1000
    sd["config"] = {"lr": 3e-4, "name": "bench"}
    warm_up(mesh)
    print(json.dumps({"ready": rank}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        w = FastWriter(cmd["path"])
        dist.barrier()
        c0, t0 = be.cpu_self(), time.perf_counter()
        dcp.save(sd, storage_writer=w)
        t1, c1 = time.perf_counter(), be.cpu_self()
        print(json.dumps({"rank": rank, "seconds": t1 - t0, "cpu": c1 - c0, "t0": t0, "t1": t1,
                          "stats": w.last_write_stats}), flush=True)
    dist.destroy_process_group()
    return 0


class Ranks:
    def __init__(self, size: int):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(be.free_port()), WORLD_SIZE="2",
                   OMP_NUM_THREADS="1")
        self.procs = []
        for r in range(2):
            env["RANK"] = str(r)
            self.procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                                "--size", str(size)], env=dict(env), stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, text=True))
        for p in self.procs:
            self._line(p)

    def _line(self, p) -> dict:
        while True:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a world-size-2 rank exited (code {p.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def save(self, path: str) -> List[dict]:
        for p in self.procs:
            p.stdin.write(json.dumps({"op": "save", "path": path}) + "\n")
            p.stdin.flush()
        return [self._line(p) for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.close()
                p.wait(timeout=60)
            except Exception:
                p.kill()


# ----------------------------------------------------------------------------- the benchmark

@dataclass
class Rec:
    label: str
    op: str
    rep: int
    bytes: int
    seconds: float
    cpu_s: float
    machine_cpu_s: float
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


class DcpBench:
    def __init__(self, args, workdir: str):
        self.args = args
        self.dir = workdir
        self.records: List[Rec] = []
        self.notes: List[str] = []
        ns = argparse.Namespace(size=args.size, no_fio=args.no_fio, reps=args.reps, mode="quick", dir=workdir)
        self.fio = be.Bench(ns, workdir)  # bench_engine's fio runner and page-cache drop
        self.ranks: Optional[Ranks] = None

    def prepare(self) -> None:
        be.log(f"generating the state dict ({self.args.size / 1e9:.2f} GB) and a load target (untimed) ...")
        t = time.perf_counter()
        self.sd = state_dict(self.args.size)
        self.nbytes = tensor_bytes(self.sd)
        self.target = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for k, v in self.sd.items()}
        self.target["config"] = {"lr": 0.0, "name": ""}
        be.log(f"  {n_weights(self.args.size)} weights + biases, {self.nbytes / 1e9:.3f} GB of tensors, "
               f"in {time.perf_counter() - t:.1f} s")
        warm_up()
        if not self.args.no_ws2:
            be.log("starting the two world-size-2 ranks ...")
            self.ranks = Ranks(self.args.size)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def clear(self) -> None:
        for n in os.listdir(self.dir):
            p = os.path.join(self.dir, n)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif n.endswith(".bin") or ".fastckpt-tmp." in n:
                os.unlink(p)

    def timed(self, fn):
        gc.collect()
        gc.disable()
        try:
            d0, m0, c0, t0 = be.dev_stat(self.fio.dev), be.cpu_machine(), be.cpu_self(), time.perf_counter()
            fn()
            t1, c1, m1, d1 = time.perf_counter(), be.cpu_self(), be.cpu_machine(), be.dev_stat(self.fio.dev)
        finally:
            gc.enable()
        return t1 - t0, c1 - c0, m1 - m0, (d0, d1)

    def write(self, label: str, name: str, rep: int, make_writer=None) -> None:
        path = self.path(name)
        os.sync()
        self.fio.drop()
        if make_writer is None:  # world size 2
            m0 = be.cpu_machine()
            res = self.ranks.save(path)
            m1 = be.cpu_machine()
            sec = max(r["t1"] for r in res) - min(r["t0"] for r in res)
            rec = Rec(label, "write", rep, self.nbytes, sec, sum(r["cpu"] for r in res), m1 - m0,
                      extra={"per_rank_s": [r["seconds"] for r in res]})
            stats = [s for r in res for s in r["stats"]]
        else:
            w = make_writer(path)
            sec, cpu, mach, dev = self.timed(lambda: dcp.save(self.sd, storage_writer=w))
            rec = Rec(label, "write", rep, self.nbytes, sec, cpu, mach, extra={"dev": be.dev_delta(*dev, "write")})
            stats = getattr(w, "last_write_stats", [])
        if stats and not all(s["direct"] for s in stats):
            self.notes.append(f"{label}: some files were NOT written with O_DIRECT: "
                              f"{sorted({s['fallback'] for s in stats if not s['direct']})}")
        self.add(rec)

    def read(self, label: str, name: str, rep: int, make_reader) -> None:
        for k, v in self.target.items():
            if isinstance(v, torch.Tensor):
                v.view(torch.int32).fill_(0x5A5A5A5A)  # a load that does nothing cannot pass the check
        r = make_reader(self.path(name))
        self.fio.drop()
        sec, cpu, mach, dev = self.timed(lambda: dcp.load(self.target, storage_reader=r))
        ok = same(self.target, self.sd)
        if not ok:
            self.notes.append(f"{label} rep {rep + 1}: DATA MISMATCH after the load")
        self.add(Rec(label, "read", rep, self.nbytes, sec, cpu, mach,
                     extra={"verified_data": ok, "dev": be.dev_delta(*dev, "read"),
                            "stats": dict(getattr(r, "last_read_stats", {}))}))

    def fio_point(self, bs: int, qd: int, rep: int) -> None:
        if not self.fio.fio:
            return
        item = be.Item("fio", "io_uring", bs, qd)
        path = self.path("fio.bin")
        for op in ("write", "read"):
            r = self.fio.fio_run(item, path, op, rep)
            self.add(Rec(r.label, op, rep, r.bytes, r.seconds, r.cpu_s, r.machine_cpu_s, extra={"fio": True}))
        os.unlink(path)

    def add(self, rec: Rec) -> None:
        self.records.append(rec)
        be.log(f"  rep {rec.rep + 1}  {rec.label:<44} {rec.op:<5} {rec.gbps:6.2f} GB/s  {rec.seconds:6.2f} s  "
               f"cpu {rec.cpu_s / (rec.bytes / 1e9):.3f} s/GB")

    def steps(self, rep: int):
        """One repetition: (name, callable) in the order they run."""
        fast_reads = [("FastReader", lambda p: FastReader(p)),
                      ("FastReader verify=False", lambda p: FastReader(p, verify=False)),
                      ("stock FileSystemReader", lambda p: dcp.FileSystemReader(p))]
        steps = [("fio 8M qd8", lambda: self.fio_point(8 * MiB, 8, rep))]
        for t in (1, 2, 4):
            def stock(t=t):
                self.write(f"stock FileSystemWriter threads={t}", f"stock{t}", rep,
                           lambda p: dcp.FileSystemWriter(p, thread_count=t, sync_files=True))
                if t == 1:
                    self.read("stock FileSystemReader <- stock ckpt", "stock1", rep, dcp.FileSystemReader)
                    self.read("FastReader <- stock ckpt", "stock1", rep, FastReader)
                self.clear()
            steps.append((f"stock t={t}", stock))
        steps.append(("fio 1M qd16", lambda: self.fio_point(1 * MiB, 16, rep)))

        def fast1():
            self.write("FastWriter ws=1", "fast1", rep, lambda p: FastWriter(p))
            for label, mk in fast_reads:
                self.read(f"{label} <- fast ckpt", "fast1", rep, mk)
            self.clear()
        steps.append(("fast ws=1", fast1))

        def fast1t2():
            self.write("FastWriter ws=1 threads=2", "fast1t2", rep, lambda p: FastWriter(p, thread_count=2))
            self.clear()
        steps.append(("fast ws=1 t=2", fast1t2))
        if self.ranks is not None:
            def fast2():
                self.write("FastWriter ws=2", "fast2", rep)
                self.read("FastReader <- fast ws=2 ckpt", "fast2", rep, FastReader)
                self.clear()
            steps.append(("fast ws=2", fast2))
        return steps

    def run(self) -> None:
        for rep in range(self.args.reps):
            seq = self.steps(rep)
            if rep % 2:
                seq = list(reversed(seq))
            be.log(f"repetition {rep + 1}/{self.args.reps}")
            for _, fn in seq:
                fn()

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()


# ----------------------------------------------------------------------------- report

def report(b: DcpBench, ctx: Dict[str, object]) -> Dict[str, object]:
    a = b.args
    print("## torch.distributed.checkpoint: stock FileSystemWriter/Reader vs fastckpt FastWriter/FastReader\n")
    print(f"- kernel {ctx['kernel']}, {ctx['nproc']} CPUs, {ctx.get('cpu', '?')}, {ctx.get('mem_total_gb', '?')} GB "
          f"RAM; torch {ctx['torch']}, fastckpt {ctx['git']}")
    print(f"- dir {ctx['dir']}: {ctx['fstype']} on {ctx['mount']['source']}; io_uring: {ctx['auto_backend']}"
          + (f" (refused: {ctx['uring_refusal']})" if ctx["uring_refusal"] else ""))
    print(f"- fio: {ctx['fio']}")
    print(f"- state dict: {n_weights(a.size)} float32 weights {ROWS}x{COLS} + as many biases ({COLS}) + 2 "
          f"non-tensor values = {b.nbytes} tensor bytes ({b.nbytes / 1e9:.3f} GB); {a.reps} repetitions, "
          "configurations interleaved (reversed on odd repetitions), medians reported")
    if b.fio.drop_error:
        print(f"- page cache: NOT dropped ({b.fio.drop_error}): the stock reader's figures are warm-cache figures")
    else:
        print(f"- page cache: dropped before every write and read ({b.fio.drop_ok} times)")
    summary: Dict[str, object] = {}
    for op in ("write", "read"):
        recs = [r for r in b.records if r.op == op]
        if not recs:
            continue
        labels = list(dict.fromkeys(r.label for r in recs))
        med = {l: be.median([r.gbps for r in recs if r.label == l]) for l in labels}
        fio_labels = [l for l in labels if l.startswith("fio")]
        fio_ref = max((med[l] for l in fio_labels), default=float("nan"))
        fio_by_rep: Dict[int, float] = {}
        for r in recs:
            if r.extra.get("fio"):
                fio_by_rep[r.rep] = max(fio_by_rep.get(r.rep, 0.0), r.gbps)
        if op == "write":
            stock_labels = [l for l in labels if l.startswith("stock")]
            stock_ref_label = max(stock_labels, key=med.get) if stock_labels else None
        else:
            stock_ref_label = "stock FileSystemReader <- stock ckpt"
        stock_ref = med.get(stock_ref_label, float("nan"))
        print(f"\n### {op}\n")
        hdr = ["configuration", "n", "GB/s (median)", "min", "max", "x stock", "x fio", "paired", "CPU-s/GB",
               "machine CPU-s/GB"]
        rows = []
        for l in labels:
            rs = [r for r in recs if r.label == l]
            g = [r.gbps for r in rs]
            paired = be.median([r.gbps / fio_by_rep[r.rep] for r in rs if r.rep in fio_by_rep])
            cpu = be.median([r.cpu_s / (r.bytes / 1e9) for r in rs])
            mach = be.median([r.machine_cpu_s / (r.bytes / 1e9) for r in rs])
            row = dict(label=l, n=len(rs), gbps=med[l], lo=min(g), hi=max(g),
                       x_stock=med[l] / stock_ref if stock_ref == stock_ref else float("nan"),
                       x_fio=med[l] / fio_ref if fio_ref == fio_ref else float("nan"), paired=paired,
                       cpu_per_gb=cpu, machine_per_gb=mach)
            rows.append(row)
            f = lambda x: "-" if x != x else f"{x:.2f}"
            rows[-1]["cells"] = [l, str(len(rs)), f"{med[l]:.3f}", f"{min(g):.3f}", f"{max(g):.3f}",
                                 f(row["x_stock"]), f(row["x_fio"]), f(paired), f"{cpu:.3f}", f"{mach:.3f}"]
        widths = [max(len(h), *(len(r["cells"][i]) for r in rows)) for i, h in enumerate(hdr)]
        print("| " + " | ".join(h.ljust(w) for h, w in zip(hdr, widths)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for r in rows:
            print("| " + " | ".join(c.ljust(w) for c, w in zip(r.pop("cells"), widths)) + " |")
        summary[op] = {"rows": rows, "fio": fio_ref, "stock_ref": stock_ref_label}
    print("\n## summary\n")
    for op, fast_label in (("write", "FastWriter ws=1"), ("read", "FastReader <- fast ckpt")):
        s = summary.get(op)
        if not s:
            continue
        row = next((r for r in s["rows"] if r["label"] == fast_label), None)
        if row is None:
            continue
        fio_txt = (f" = {row['x_fio']:.2f} x fio {s['fio']:.3f} GB/s (paired {row['paired']:.2f}; target >= {TARGET}: "
                   f"{'MET' if row['paired'] >= TARGET else 'NOT MET'})") if s["fio"] == s["fio"] else ""
        print(f"{op}: {fast_label} {row['gbps']:.3f} GB/s = {row['x_stock']:.2f} x {s['stock_ref']}{fio_txt}; "
              f"{row['cpu_per_gb']:.3f} CPU-s/GB")
    bad = [n for n in b.notes if "MISMATCH" in n]
    nread = len([r for r in b.records if r.op == "read"])
    print(f"data check: {nread} loads compared with the source: " + ("all equal" if not bad else f"{len(bad)} MISMATCHES"))
    for n in dict.fromkeys(b.notes):
        print(f"note: {n}")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to test (a private .bench-tmp-* inside it, removed at the "
                                  "end; default: the repository root)")
    ap.add_argument("--size", type=be.parse_size, default=2 << 30, help="state dict size (default 2G; min 32M)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--no-fio", action="store_true", help="do not run fio")
    ap.add_argument("--no-ws2", action="store_true", help="skip the world-size-2 save")
    ap.add_argument("--json", metavar="PATH", help="write every measurement and the summary here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    parent = os.path.abspath(args.dir) if args.dir else REPO_ROOT
    os.makedirs(parent, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix=".bench-tmp-", dir=parent)
    b = DcpBench(args, workdir)
    try:
        ctx = be.context(b.fio, workdir)
        free = shutil.disk_usage(workdir).free
        if free < 3 * args.size + (1 << 30):
            raise SystemExit(f"not enough free space in {workdir}: {free / 1e9:.1f} GB")
        need = 4 * args.size + (1 << 30)  # source + target here, a half each in two ranks, pools
        if ctx.get("mem_available_gb") and need > 0.8 * ctx["mem_available_gb"] * 1e9:
            raise SystemExit(f"not enough memory: about {need / 1e9:.1f} GB needed; use a smaller --size")
        b.prepare()
        t = time.perf_counter()
        b.run()
        be.log(f"measured in {time.perf_counter() - t:.0f} s")
        summary = report(b, ctx)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(args).items()}, "context": ctx, "summary": summary,
                           "notes": b.notes, "records": [r.__dict__ for r in b.records]}, f, indent=1, default=str)
    finally:
        b.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
