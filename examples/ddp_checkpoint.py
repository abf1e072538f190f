"""The DDP checkpoint rules with fastckpt: rank 0 writes model.module's and the
optimizer's state, every rank reads it onto its own device, barriers around
the save. Run it twice; the second run resumes where the first stopped:

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

    start = 0
    if os.path.exists(path):  # every rank reads, onto its own device
        state = fastckpt.load(path, map_location=device)  # weights_only=True: runs no code from the file
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"] + 1

    for step in range(start, start + steps):
        torch.manual_seed(step * 100 + rank)  # each rank its own data
        loss = model(torch.randn(32, 64, device=device)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    dist.barrier()  # every rank has finished the step being saved
    if rank == 0:   # temporary file, fdatasync, rename, directory fsync
        os.makedirs(ckpt_dir, exist_ok=True)
        fastckpt.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}, path)
    dist.barrier()  # nobody reads or exits before the checkpoint is complete

    w = model.module.weight.detach().double().sum().item()
    sys.stdout.write(f"rank {rank}: trained steps {start}..{step}, weight sum {w:.6f}\n")  # one write per line
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
