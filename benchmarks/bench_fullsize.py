#!/usr/bin/env python3
"""Full-size files from sharded jobs, and loads into the state a job already has.

Single process, a model + AdamW state of ``--size`` bytes (benchmarks/workload.py):

* ``fastckpt.load_into(state, path)`` into the state's own tensors against ``torch.load`` +
  a copy into the state (what ``load_state_dict`` does), ``fastckpt.load`` + the copy, and
  safetensors' ``load_file`` + the copy (the model part), cold (page cache dropped, as root)
  and warm; CPU seconds per GB of this process; fio's O_DIRECT read of a file of the same size.

Every rank writes (W = 1, 2, 4 processes on this machine, gloo, the model's tensors as
``Shard(0)`` DTensors, FSDP2's layout, ``--size`` in all):

* ``fastckpt.save(state, path, group=pg)`` (a full-size file, every rank its shards) against
  gathering to rank 0 (``full_tensor()``) + ``torch.save``, against ``dcp.save`` (FileSystemWriter)
  then ``fastckpt convert DCP out.pt`` (one process);
* ``fastckpt.safetensors.save_file(..., group=pg)`` against gather + ``safetensors.torch.save_file``;
* ``fastckpt.load_into`` of the full-size file into the sharded state against ``dcp.load`` of the
  DCP checkpoint; per rank, the bytes it wrote and read (``/proc/self/io``).

All ranks share this machine's 2 CPUs and one disk: W ranks cannot have W times a rank's
bandwidth here; the table shows what the every-rank save costs against the alternatives on the
same machine, and the bytes each rank moved.

Writes ``--json`` (the report's standalone format) and prints Markdown.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from benchmarks.harness import emit_standalone, cpu_self, drop_caches, fmt_size, free_port, median, parse_size  # noqa: E402
from benchmarks.workload import build_state_dict, payload_bytes  # noqa: E402

GB = 1e9


def _io() -> dict:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


def _timed(fn, cold_path=None):
    """(seconds, CPU seconds) of fn(); the page cache dropped first when cold_path is given."""
    if cold_path is not None:
        drop_caches()
    c0, t0 = cpu_self(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_self() - c0


def _copy_into(dst, src) -> None:
    """What load_state_dict does with a loaded state: each tensor copied into the job's, by key."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k, v in dst.items():
            _copy_into(v, src[k])
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


# ----------------------------------------------------------------------------- single process

def single(args, size: int, work: str, rows, notes, targets) -> None:
    import fastckpt
    import fastckpt.safetensors
    sd = build_state_dict(size)
    nbytes = payload_bytes(sd)
    path = os.path.join(work, "state.pt")
    fastckpt.save(sd, path)
    st_path = os.path.join(work, "model.safetensors")
    fastckpt.safetensors.save_file(sd["model"], st_path)
    target = build_state_dict(size, seed=1)  # the job's own state, other values
    can_drop = drop_caches() is None
    if not can_drop:
        notes.append("the page cache could not be dropped (not root): the cold rows are warm")

    def ld_into():
        fastckpt.load_into(target, path)

    def torch_copy():
        _copy_into(target, torch.load(path, weights_only=True))

    def fast_copy():
        _copy_into(target, fastckpt.load(path))

    cases = [("load_into (in place)", ld_into), ("torch.load + copy into the state", torch_copy),
             ("fastckpt.load + copy into the state", fast_copy)]
    try:
        import safetensors.torch as st

        def st_copy():
            _copy_into(target["model"], st.load_file(st_path))

        def st_into():
            fastckpt.load_into(target["model"], st_path)
        st_bytes = payload_bytes(sd["model"])
        st_cases = [("load_into safetensors (model)", st_into), ("safetensors.load_file + copy (model)", st_copy)]
    except ImportError:
        st_cases, st_bytes = [], 0
        notes.append("safetensors is not installed: its rows are not measured")
    res = {}
    for temp in ("cold", "warm"):
        for name, fn, n in [(c, f, nbytes) for c, f in cases] + [(c, f, st_bytes) for c, f in st_cases]:
            times = []
            for _ in range(args.reps):
                if temp == "warm":
                    fn()  # the file in the page cache
                times.append(_timed(fn, path if temp == "cold" else None))
            t = median([x[0] for x in times])
            cpu = median([x[1] for x in times])
            res[(temp, name)] = (t, cpu, n)
            rows.append([f"{name}, {temp}", f"{t:.3f}", f"{n / GB / t:.2f}", f"{cpu / (n / GB):.2f}"])
    fio = _fio_read(args, work, nbytes)
    if fio:
        rows.append(["(ref) fio O_DIRECT read, same size", f"{nbytes / GB / fio:.3f}", f"{fio:.2f}", ""])
        t, cpu, n = res[("cold", "load_into (in place)")]
        targets.append({"target": "single-process load_into >= 0.95x fio read (cold)", "measured": n / GB / t / fio,
                        "unit": "x", "met": n / GB / t / fio >= 0.95})
    t, cpu, n = res[("cold", "load_into (in place)")]
    targets.append({"target": "single-process load_into <= 0.15 CPU-s/GB (cold)", "measured": cpu / (n / GB),
                    "unit": " CPU-s/GB", "met": cpu / (n / GB) <= 0.15})
    notes.append(f"single process: {fmt_size(nbytes)} model + AdamW state (workload.py), median of {args.reps}")


def _fio_read(args, work: str, nbytes: int):
    fio = shutil.which("fio")
    if not fio:
        return None
    from benchmarks.harness import run_fio
    f = os.path.join(work, "fio.dat")
    try:
        run_fio(fio, f, nbytes, "write", 1 << 20, 16)
        drop_caches()
        return run_fio(fio, f, nbytes, "read", 1 << 20, 16)["gbps"]
    except Exception:  # noqa: BLE001 - the reference row is then left out
        return None
    finally:
        if os.path.exists(f):
            os.unlink(f)


# ----------------------------------------------------------------------------- every rank writes

def worker(args) -> None:
    """One rank: the sharded state, every save and load of the table, its timings to --out-dir."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import fastckpt
    import fastckpt.safetensors
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    full = build_state_dict(args.size_bytes)["model"]
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    del full
    out = args.out_dir
    pg = dist.group.WORLD
    res = {}

    def step(name, fn, cold=False):
        dist.barrier()
        if cold and rank == 0:
            drop_caches()
        dist.barrier()
        io0, t0 = _io(), time.perf_counter()
        fn()
        dist.barrier()
        t = time.perf_counter() - t0
        io1 = _io()
        res[name] = {"s": t, "write_bytes": io1["write_bytes"] - io0["write_bytes"],
                     "read_bytes": io1["read_bytes"] - io0["read_bytes"], "rchar": io1["rchar"] - io0["rchar"]}

    step("save_every_rank", lambda: fastckpt.save(sd, os.path.join(out, "full.pt"), group=pg))

    def gather_torch():
        g = {k: v.full_tensor() for k, v in sd.items()}
        if rank == 0:
            torch.save(g, os.path.join(out, "gathered.pt"))
            with open(os.path.join(out, "gathered.pt"), "rb") as f:  # torch.save does not fsync: made durable
                os.fsync(f.fileno())
    step("gather_torch_save", gather_torch)
    step("st_every_rank", lambda: fastckpt.safetensors.save_file(sd, os.path.join(out, "full.safetensors"), group=pg))
    try:
        import safetensors.torch as st

        def gather_st():
            g = {k: v.full_tensor() for k, v in sd.items()}
            if rank == 0:
                st.save_file(g, os.path.join(out, "gathered.safetensors"))
                with open(os.path.join(out, "gathered.safetensors"), "rb") as f:
                    os.fsync(f.fileno())
        step("gather_st_save", gather_st)
    except ImportError:
        pass
    step("dcp_save", lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(out, "dcp"))))

    def convert():
        if rank == 0:  # the command in a process of its own (not one rank of this job)
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                      "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
            subprocess.run([sys.executable, "-m", "fastckpt", "convert", os.path.join(out, "dcp"),
                            os.path.join(out, "converted.pt"), "--to", "fastckpt"], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    step("convert", convert)

    def convert_every_rank():  # what `torchrun -m fastckpt convert` does on each rank
        from fastckpt.cli.convert_ranks import convert_ranks
        from fastckpt.sources.kinds import open_source
        with open_source(os.path.join(out, "dcp")) as src:
            convert_ranks(src, os.path.join(out, "converted_ranks.pt"), "fastckpt", group=pg)
    step("convert_ranks", convert_every_rank)
    step("load_into_sharded", lambda: fastckpt.load_into(sd, os.path.join(out, "full.pt")), cold=True)
    step("dcp_load", lambda: dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(out, "dcp"))), cold=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def ranks(args, size: int, work: str, rows, notes, targets) -> None:
    nbytes = None
    for world in args.worlds:
        outd = tempfile.mkdtemp(prefix=f"w{world}-", dir=work)
        port = str(free_port())
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                       PYTHONPATH=os.path.dirname(HERE))
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--size", str(size), "--out-dir", outd],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"W={world}: a rank failed: {outs[0][-2000:]}")
        per = [json.load(open(os.path.join(outd, f"rank{r}.json"))) for r in range(world)]
        fsize = os.path.getsize(os.path.join(outd, "full.pt"))
        nbytes = fsize
        for key, label in (("save_every_rank", "fastckpt.save(group=) full-size, every rank"),
                           ("gather_torch_save", "gather to rank 0 + torch.save (+fsync)"),
                           ("st_every_rank", "fastckpt.safetensors.save_file(group=), every rank"),
                           ("gather_st_save", "gather to rank 0 + safetensors save_file (+fsync)"),
                           ("dcp_save", "dcp.save (FileSystemWriter)"),
                           ("convert", "  then fastckpt convert DCP -> .pt (one process)"),
                           ("convert_ranks", "  or fastckpt convert under torchrun (every rank its share)"),
                           ("load_into_sharded", "fastckpt.load_into full-size file -> shards (cold)"),
                           ("dcp_load", "dcp.load (FileSystemReader, cold)")):
            if key not in per[0]:
                continue
            t = max(p[key]["s"] for p in per)
            wrote = max(p[key]["write_bytes"] for p in per)
            read = max(p[key]["read_bytes"] for p in per)
            rows.append([f"W={world}: {label}", f"{t:.3f}", f"{fsize / GB / t:.2f}",
                         f"max/rank wrote {wrote / fsize:.2f}, read {read / fsize:.2f} of the file"])
        sv = max(p["save_every_rank"]["s"] for p in per)
        gt = max(p["gather_torch_save"]["s"] for p in per)
        notes.append(f"W={world}: the every-rank full-size save took {sv / gt:.2f}x the time of gather + torch.save")
        read = max(p["load_into_sharded"]["read_bytes"] for p in per)
        targets.append({"target": f"W={world}: sharded load_into reads <= 1.1/W of the file per rank",
                        "measured": read / fsize * world, "unit": "/W", "met": read / fsize <= 1.1 / world})
        shutil.rmtree(outd, ignore_errors=True)
    notes.append(f"every-rank part: the model's tensors ({fmt_size(nbytes or 0)} file) as Shard(0) DTensors on a "
                 "CPU gloo mesh; seconds are the slowest rank's, between barriers; 'wrote' and 'read' are /proc/self/io write_bytes and read_bytes (what reached the disk; loads after a drop of the page cache); the convert row includes starting its process")
    notes.append("the ranks share this machine's 2 CPUs and one disk, so the save cannot scale with W here; "
                 "the target '>= 0.9 x W x B' needs one disk (or bandwidth share) per rank")
    if drop_caches() is not None:
        notes.append("not root: the page cache was not dropped, so read_bytes undercounts the loads' reads")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=".", help="a directory on the disk to measure")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="64 MiB, one repetition, W = 1, 2: a check that it runs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.reps, args.worlds = "64M", 1, "1,2"
    size = parse_size(args.size)
    args.worlds = [int(w) for w in args.worlds.split(",") if w]
    if args.worker:
        args.size_bytes = size
        worker(args)
        return 0
    rows, notes, targets, errors = [], [], [], []
    work = tempfile.mkdtemp(prefix="fastckpt-bench-fullsize-", dir=os.path.abspath(args.dir))
    try:
        single(args, size, work, rows, notes, targets)
        try:
            ranks(args, size, work, rows, notes, targets)
        except Exception as e:  # noqa: BLE001 - reported in the table's errors
            errors.append(f"every-rank part: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"title": f"Full-size files from sharded jobs, and load_into ({fmt_size(size)})",
           "columns": ["operation", "seconds", "GB/s", "CPU-s/GB or bytes"], "rows": rows, "targets": targets,
           "notes": notes, "errors": errors}
    return emit_standalone(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
