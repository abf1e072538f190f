"""The DDP checkpoint rules with fastckpt: model.module's and the optimizer's
state saved to one file that every rank writes a share of (group=: the file
is the one a single-process save writes; the collectives are the barriers
around the save), and loaded by every rank onto its own device, each reading
a share. Run it twice; the second run resumes where the first stopped:

    torchrun --nproc_per_node 2 examples/ddp_checkpoint.py /tmp/ckpt [STEPS]
"""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import fastckpt


def main(ckpt_dir: str, steps: int = 10) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(64, 8).to(device), device_ids=[device] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = os.path.join(ckpt_dir, "ckpt.pt")
    # Checkpoint collectives on a gloo group: they exchange host memory.
    io_group = dist.new_group(backend="gloo") if cuda else dist.group.WORLD

    start = 0
    if os.path.exists(path):  # every rank reads its share; the shares are exchanged over io_group
        state = fastckpt.load(path, map_location=device, group=io_group)  # weights_only: runs no code from the file
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"] + 1

    for step in range(start, start + steps):
        torch.manual_seed(step * 100 + rank)  # each rank its own data
        loss = model(torch.randn(32, 64, device=device)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    os.makedirs(ckpt_dir, exist_ok=True)
    # Every rank calls it with the same (replicated) state and writes its share
    # of one temporary file; rank 0 renames it once every share is durable, and
    # no rank returns before that (nor if any rank failed: every rank raises).
    fastckpt.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}, path,
                  group=io_group)

    w = model.module.weight.detach().double().sum().item()
    sys.stdout.write(f"rank {rank}: trained steps {start}..{step}, weight sum {w:.6f}\n")  # one write per line
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
