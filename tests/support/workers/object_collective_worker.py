"""One rank of tests/python/core/test_object_collectives.py.

Usage: python object_collective_worker.py STORE RANK WORLD IMPL ROUNDS
IMPL: "fastckpt" (fastckpt._core.dist_exit's object collectives) or "torch"
(torch.distributed's own). Each round gathers and broadcasts a small object,
recording every tensor the implementation hands to gloo (through
torch.distributed's all_gather and broadcast, patched), and counts, the
moment the call returns, the recorded tensors that something besides their
Python object (a gloo worker that has not let go of the finished work) still
holds. Prints "held <count> of <tensors>" and "objects ok" when every rank
got the right objects.
"""
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def main(store_path: str, rank: int, world: int, impl: str, rounds: int) -> None:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    seen = []

    def recording(fn):
        def wrapper(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.Tensor):
                    seen.append(a)
                elif isinstance(a, (list, tuple)):
                    seen.extend(x for x in a if isinstance(x, torch.Tensor))
            return fn(*args, **kwargs)
        return wrapper

    for name in ("all_gather", "broadcast"):
        f = recording(getattr(c10d, name))
        setattr(c10d, name, f)
        setattr(dist, name, f)
    if impl == "fastckpt":
        from fastckpt._core import dist_exit
        gather, bcast = dist_exit.all_gather_object, dist_exit.broadcast_object_list
    else:
        gather, bcast = dist.all_gather_object, dist.broadcast_object_list
    held = total = 0
    ok = True
    for i in range(rounds):
        out = [None] * world
        seen.clear()
        gather(out, {"rank": rank, "round": i, "pad": "x" * (i % 7) * rank})
        held += sum(t._use_count() > 1 for t in seen)
        total += len(seen)
        ok &= out == [{"rank": r, "round": i, "pad": "x" * (i % 7) * r} for r in range(world)]
        box = [("from", 0, i), None] if rank == 0 else [None, None]
        seen.clear()
        bcast(box, src=0)
        held += sum(t._use_count() > 1 for t in seen)
        total += len(seen)
        ok &= box == [("from", 0, i), None]
        seen.clear()
    print(f"held {held} of {total}", flush=True)
    if ok:
        print("objects ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
