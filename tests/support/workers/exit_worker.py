"""One rank of test_manager_exit.py: a short job that uses CheckpointManager
and ends the way user scripts end: destroy_process_group(), then interpreter
exit, with no gc.collect(), close() or `with` to help it.

Usage (under torchrun --standalone --nproc_per_node 2):
    python exit_worker.py CKPT_DIR MODE
MODE: "replicated" (a DDP model; every rank writes its share, collective=True,
the default: the asynchronous saves on the writer thread, on the manager's group
for background saves), "rank0" (the same with collective=False: rank 0 writes)
or "sharded" (every rank writes through DCP): each saves synchronously and
asynchronously (two in a row), waits, loads;
"collective" (a DDP model, no manager): fastckpt.save and fastckpt.load with
group= on the default group, as examples/ddp_checkpoint.py does; "dcp" (a DDP
model, no manager): dcp.save with FastWriter, dcp.load with FastReader.

Rank 0 prints "ok" before exiting. At the very end of interpreter exit (an
atexit handler registered before fastckpt is imported runs after fastckpt's
own), the rank checks that no gloo worker thread is still alive: one that
lives on into interpreter finalization is what aborts a rank with
"terminate called without an active exception" when it releases a finished
collective's tensors there. If any is alive, the rank
says so and exits with status 3.
"""
import atexit
import os
import sys


def _gloo_threads() -> int:
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == "pt_gloo_runloop"
        except OSError:
            pass
    return n


@atexit.register  # registered first: runs last, after fastckpt's and torch's exit handlers
def _no_gloo_thread_left() -> None:
    n = _gloo_threads()
    if n:
        print(f"exit-worker: {n} gloo worker thread(s) still alive at interpreter finalization",
              file=sys.stderr, flush=True)
        os._exit(3)


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import fastckpt  # noqa: E402


def main(ckpt: str, mode: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    if mode in ("replicated", "rank0"):
        model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(8, 16)).sum().backward()
        opt.step()

        def state(step):
            return {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}
        blank = None
    elif mode == "sharded":
        def state(step):
            return {"w": torch.full((256,), float(step + rank)), "step": step}
        blank = {"w": torch.zeros(256), "step": 0}
    elif mode == "collective":
        model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
        model(torch.randn(8, 16)).sum().backward()
        path = os.path.join(ckpt, "c.pt")
        os.makedirs(ckpt, exist_ok=True)
        fastckpt.save({"model": model.module.state_dict(), "step": 1}, path, group=dist.group.WORLD)
        got = fastckpt.load(path, group=dist.group.WORLD)
        assert got["step"] == 1 and torch.equal(got["model"]["weight"], model.module.weight.detach()), got
        dist.destroy_process_group()
        if rank == 0:
            print("ok", flush=True)
        return
    elif mode == "dcp":
        import torch.distributed.checkpoint as dcp
        from fastckpt.dcp import FastReader, FastWriter
        model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
        model(torch.randn(8, 16)).sum().backward()
        sd = {"model": model.module.state_dict()}
        dcp.save(sd, storage_writer=FastWriter(os.path.join(ckpt, "d")))
        got = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
        dcp.load(got, storage_reader=FastReader(os.path.join(ckpt, "d")))
        assert torch.equal(got["model"]["weight"], model.module.weight.detach()), got
        dist.destroy_process_group()
        if rank == 0:
            print("ok", flush=True)
        return
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    mgr = fastckpt.CheckpointManager(ckpt, keep_last=2, sharded=(mode == "sharded"), collective=(mode != "rank0"))
    assert mgr.collective == (mode == "replicated"), mgr.collective
    mgr.save(1, state(1))
    mgr.async_save(2, state(2))
    mgr.async_save(3, state(3))
    mgr.wait()
    r = mgr.load_latest(state=blank)
    assert r is not None and r.step == 3, r
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.destroy_process_group()
    if rank == 0:
        print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
