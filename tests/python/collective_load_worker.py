"""One rank of a collective load (tests/python/test_collective_load.py).

    python collective_load_worker.py STORE RANK WORLD PATH CASE MODE

Joins a gloo group through a FileStore, loads PATH with group= and compares
what it got with collective_worker.build(CASE); prints "READ <bytes>" (the
storage bytes this rank read from the file) and, last, "OK" or
"ERR <type>: <message>". MODE: ok; missing1 (rank 1's path does not exist: it
gets everything from its peers); missing_all (no rank's path exists); other1
(rank 1 loads PATH + ".other", a different file); fault (rank 1's share reads
fail with EIO); kill (rank 1 SIGKILLs itself after reading its share, before
the collective that reports it); kill_exchange (the same, after that
collective, while the shares are broadcast); cuda_map (map_location=
"cuda:0" on a machine without CUDA: every rank raises torch's error);
meta (map_location="meta"); unsafe (weights_only=False).
"""
import datetime
import errno
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import collective_worker  # noqa: E402


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and (b.device.type == "meta" or torch.equal(a, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def main() -> int:
    store, rank, world, path, case, mode = sys.argv[1:7]
    rank, world = int(rank), int(world)
    import torch.distributed as dist

    import fastckpt
    from fastckpt import _C, _collective, serialization

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    if (mode == "missing1" and rank == 1) or mode == "missing_all":
        path += ".absent"
    if mode == "other1" and rank == 1:
        path += ".other"
    read = [0]
    read_into = serialization._Records.read_into

    def counting(self, items, fd=None):
        shares = [it for it in items if it[0].startswith("data/")]
        read[0] += sum(it[2].numel() for it in shares)
        if shares and mode == "fault" and rank == 1:
            _C.fault_inject("read", errno=errno.EIO, times=0)
        return read_into(self, items, fd)

    serialization._Records.read_into = counting
    exchange = _collective._Group.exchange

    def dying(self, mine, err, what):
        if mode == "kill" and rank == 1 and what == "to read its share":
            os.kill(os.getpid(), signal.SIGKILL)
        out = exchange(self, mine, err, what)
        if mode == "kill_exchange" and rank == 1 and what == "to read its share":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    _collective._Group.exchange = dying
    kwargs = {}
    if mode == "cuda_map":
        kwargs["map_location"] = "cuda:0"
    if mode == "meta":
        kwargs["map_location"] = "meta"
    if mode == "unsafe":
        kwargs["weights_only"] = False
    try:
        got = fastckpt.load(path, group=dist.group.WORLD, **kwargs)
        print("READ", read[0], flush=True)
        want = collective_worker.build(case)
        if not same(want, got):
            print("ERR mismatch: the loaded object differs from the saved one", flush=True)
        elif case == "mixed" and mode != "meta" and \
                got["big_view"].untyped_storage().data_ptr() != got["big"].untyped_storage().data_ptr():
            print("ERR mismatch: a view lost its storage", flush=True)
        else:
            print("OK", flush=True)
    except Exception as e:
        print("READ", read[0], flush=True)
        print(f"ERR {type(e).__name__}: {e}", flush=True)
    finally:
        _C.fault_clear()
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    collective_worker.run_main(main)
