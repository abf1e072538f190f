"""A deterministic data-parallel training job (gloo, CPU; each gradient all-reduced on its own, in
parameter order: DDP's buckets are rebuilt after a job's first step, which changes the summation
order of more than two ranks, so that a resumed DDP job is not bitwise an uninterrupted one) with the memory tier: a snapshot every step, a
checkpoint on disk every --save-every steps. Run under torchrun (one agent per emulated node,
each with its own FASTCKPT_MEMORY_DIR).

    --kill-after K   SIGKILL this rank once the snapshot of step K is committed and replicated
                     (--kill-now: as soon as snapshot() returns, its background work in flight)
    --out FILE       rank 0 writes the final model and optimizer states there
Prints "RESTORED <step> <path>" (or "FRESH") after load_latest, and "OK" at the end.
"""
import argparse
import os
import signal
import warnings

import torch
import torch.distributed as dist

import fastckpt

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--save-every", type=int, default=4)
p.add_argument("--kill-after", type=int, default=-1)
p.add_argument("--kill-now", action="store_true", help="with --kill-after: at once after snapshot() returns "
               "(its CRC, commit and replication still in flight)")
p.add_argument("--replicas", type=int, default=1)
p.add_argument("--width", type=int, default=64)
p.add_argument("--out")
a = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)

class Replicated(torch.nn.Module):  # model.module, as with DDP
    def __init__(self):
        super().__init__()
        self.module = torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.ReLU(),
                                          torch.nn.Linear(a.width, 4))

    def forward(self, x):
        return self.module(x)


model = Replicated()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

mgr = fastckpt.CheckpointManager(a.dir, keep_last=2, memory=fastckpt.MemoryTier(keep=2, replicas=a.replicas))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r = mgr.load_latest()
for w in caught:
    print("WARNING", str(w.message).replace("\n", " "), flush=True)
start = 0
if r is None:
    print("FRESH", flush=True)
else:
    print("RESTORED", r.step, r.path, flush=True)
    model.module.load_state_dict(r.state["model"])
    opt.load_state_dict(r.state["optim"])
    start = r.step + 1
for step in range(start, a.steps):
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randn(8, a.width, generator=g)
    y = torch.randn(8, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for prm in model.parameters():
        dist.all_reduce(prm.grad)
        prm.grad /= dist.get_world_size()
    opt.step()
    state = {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}
    mgr.snapshot(step, state)
    if step % a.save_every == 0:
        mgr.save(step, state)
    if step == a.kill_after:
        if not a.kill_now:
            mgr._memory.wait()
            dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
if rank == 0 and a.out:
    torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, a.out)
mgr.close()
dist.destroy_process_group()
print("OK", flush=True)
