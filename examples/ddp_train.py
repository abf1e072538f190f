"""DistributedDataParallel training with fastckpt checkpoints, resumable bit for bit.

A small MLP classifier on synthetic data, trained with DDP (gloo on CPU, nccl
with CUDA). Every --ckpt-every steps the checkpoint manager saves the model
(``model.module.state_dict()``), optimizer, LR scheduler, every rank's RNG
states (torch, CUDA, Python ``random``, NumPy), the step and the data
position; every rank writes a share of each checkpoint file and reads a
share of it on resume, the shares exchanged over a gloo group of the
manager's own (--rank0-writes: rank 0 writes it whole, all ranks wait for it,
and every rank reads it whole). With --async every rank snapshots the state into
host memory and goes on training while its writer thread writes its share (with
--rank0-writes: rank 0 writes in the background, the ranks wait only for its snapshot). Started again with the same arguments, it resumes from
the newest complete checkpoint and ends in exactly the state an uninterrupted
run ends in.

    torchrun --nproc_per_node 2 examples/ddp_train.py --ckpt-dir /tmp/ckpt --steps 200 --ckpt-every 20
    # kill it (Ctrl-C, SIGKILL, a node failure), run the same command again: it resumes
    torchrun --nproc_per_node 2 examples/ddp_train.py --ckpt-dir /tmp/ckpt --steps 200 --ckpt-every 20 --async

--dump PATH writes the final model/optimizer/scheduler state (torch.save) and
prints its SHA-256, for comparing runs. Rank 0 prints one line per step and
per checkpoint (``step N loss L``, ``ckpt-begin N``, ``ckpt-end N``,
``resumed-from N``); the test suite reads them.
"""

import argparse
import gc
import hashlib
import os
import random
import socket
import sys
import time

# cuBLAS needs this before its first use to be deterministic (CUDA only).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import fastckpt  # noqa: E402

try:
    import numpy as np
except ImportError:  # NumPy is optional: its RNG is saved when it is there
    np = None

IN, CLASSES = 32, 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--ckpt-every", type=int, default=20, help="checkpoint every K steps (and at the end)")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--async", dest="async_", action="store_true", help="fastckpt async saves")
    p.add_argument("--rank0-writes", action="store_true",
                   help="rank 0 writes each checkpoint whole (CheckpointManager(collective=False))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32, help="global batch size (split across ranks)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (demos, tests)")
    p.add_argument("--dump", help="rank 0 writes the final state here (torch.save) and prints its digest")
    return p.parse_args(argv)


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, hidden), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, CLASSES))

    def forward(self, x):
        return self.net(x)


def synthetic_data(seed: int, samples: int):
    """The same data on every rank: inputs and the labels of a random teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, IN, generator=g)
    teacher = torch.randn(IN, CLASSES, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(samples, CLASSES, generator=g)).argmax(dim=1)
    return x, y


class Sampler:
    """Seeded, epoch-wise shuffled global batches, each split across ranks.
    Its position (epoch, batch) is part of the checkpoint."""

    def __init__(self, seed, samples, batch_size, rank, world):
        if batch_size % world:
            raise SystemExit(f"--batch-size {batch_size} must be a multiple of the world size {world}")
        self.seed, self.samples, self.batch_size, self.rank, self.world = seed, samples, batch_size, rank, world
        self.per_epoch = samples // batch_size
        self.epoch, self.batch = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, sd):
        self.epoch, self.batch = int(sd["epoch"]), int(sd["batch"])

    def next_indices(self) -> torch.Tensor:
        perm = torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))
        idx = perm[self.batch * self.batch_size:(self.batch + 1) * self.batch_size][self.rank::self.world]
        self.batch += 1
        if self.batch == self.per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        return idx


# ---------------------------------------------------------------- RNG states (per rank)

def rng_state(device) -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    if np is not None:
        name, key, pos, has_gauss, gauss = np.random.get_state()
        # as a tensor and plain numbers, so that weights_only loading accepts it
        st["numpy"] = (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    return st


def set_rng_state(st: dict, device) -> None:
    # .cpu(): map_location may have put these tensors on the GPU; RNG states live on the host
    torch.set_rng_state(st["torch"].cpu())
    random.setstate(st["python"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"].cpu(), device)
    if np is not None and "numpy" in st:
        name, key, pos, has_gauss, gauss = st["numpy"]
        np.random.set_state((name, key.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


# ---------------------------------------------------------------- test hooks

def arm_test_fault() -> None:
    """FASTCKPT_TEST_FAULT="op:nth:delay_ms:times:path_contains[:errno]" arms the engine's
    test-only fault injection in this process (the test suite uses it to stall a save
    so that it can kill the job in the middle of one). Never set it in real runs."""
    spec = os.environ.get("FASTCKPT_TEST_FAULT")
    if not spec:
        return
    op, nth, delay_ms, times, path_contains, *err = spec.split(":")
    fastckpt._C.fault_inject(op, nth=int(nth), delay_ms=int(delay_ms), times=int(times),
                             path_contains=path_contains, errno=int(err[0]) if err else 0)
    print(f"test fault armed: {spec}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- main

def init_distributed():
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def digest(state: dict) -> str:
    h = hashlib.sha256()

    def walk(o):
        if isinstance(o, torch.Tensor):
            h.update(str((o.dtype, tuple(o.shape))).encode())
            h.update(o.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(repr(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        else:
            h.update(repr(o).encode())

    walk(state)
    return h.hexdigest()


def train(args, device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    arm_test_fault()

    def say(*a):
        if rank == 0:
            print(*a, flush=True)

    x, y = synthetic_data(args.seed, args.samples)
    x, y = x.to(device), y.to(device)
    seed_everything(args.seed)                 # the same initial weights on every rank
    model = MLP(args.hidden).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    sampler = Sampler(args.seed, args.samples, args.batch_size, rank, world)
    seed_everything(args.seed + 1000 * (rank + 1))  # dropout and input noise differ per rank

    mgr = fastckpt.CheckpointManager(args.ckpt_dir, keep_last=args.keep_last, collective=not args.rank0_writes)
    restored = mgr.load_latest(map_location=device)
    start = 0
    if restored is not None:
        ck = restored.state
        if ck["world_size"] != world:
            raise SystemExit(f"checkpoint {restored.path} was written by {ck['world_size']} ranks, not {world}")
        model.load_state_dict(ck["model"])   # before wrapping: DDP then broadcasts identical weights
        opt.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        sampler.load_state_dict(ck["data"])
        set_rng_state(ck["rng"][rank], device)
        start = ck["step"]
        say(f"resumed-from {start} ({restored.path})")
    else:
        say("fresh-start")
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def checkpoint_state(step: int) -> dict:
        rngs = [None] * world
        dist.all_gather_object(rngs, rng_state(device))  # every rank's RNG, indexed by rank
        return {"model": ddp.module.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                "rng": rngs, "data": sampler.state_dict(), "step": step, "world_size": world}

    for step in range(start, args.steps):
        idx = sampler.next_indices().to(device)
        xb, yb = x[idx], y[idx]
        if np is not None:
            xb = xb + 0.01 * torch.from_numpy(np.random.standard_normal(tuple(xb.shape)).astype("float32")).to(device)
        loss = F.cross_entropy(ddp(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        done = step + 1
        say(f"step {done} loss {loss.item():.6f}")
        if done % args.ckpt_every == 0 or done == args.steps:
            say(f"ckpt-begin {done}")
            if args.async_:
                mgr.async_save(done, checkpoint_state(done))
                say(f"ckpt-snapshotted {done}")
            else:
                mgr.save(done, checkpoint_state(done))
                say(f"ckpt-end {done}")
        if args.step_sleep:
            time.sleep(args.step_sleep)

    mgr.wait()  # async saves durable, failures reported on every rank
    if rank == 0 and args.dump:
        final = {"model": ddp.module.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                 "step": args.steps}
        torch.save(final, args.dump)
        say(f"final-digest {digest(final)}")
    say("done")
    dist.barrier()  # no rank tears the group down while another still uses it


def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_distributed()
    train(args, device)
    # DDP (and whatever else holds the process group) must be gone before the
    # interpreter shuts down: gloo's worker threads may still be releasing the
    # last collectives' tensors, which needs a live interpreter (otherwise:
    # "terminate called without an active exception" at exit, pytorch PR 179291).
    # Destroying the group here joins those threads while Python is alive.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
