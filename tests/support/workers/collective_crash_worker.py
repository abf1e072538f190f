"""One rank of a collective load killed at a random moment (tests/python/collective/test_collective_crash.py).

    python collective_crash_worker.py STORE RANK WORLD PATH READ_DELAY_MS TIMEOUT_S

Joins a gloo group (timeout TIMEOUT_S) through a FileStore, slows each of its
engine's reads by READ_DELAY_MS (the fault hook), prints "STARTED", loads PATH
with group= and prints, last, "OK" (equal to collective_worker.build("mixed"))
or "ERR <type>: <message>".
"""
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support
from workers import collective_load_worker  # noqa: E402
from workers import collective_worker  # noqa: E402



def _kind(e: BaseException) -> str:
    """The error's type as the tests read it: fastckpt.errors.RanksFailed (another
    rank failed) is the OSError (EIO) it is, so the ERR lines say OSError."""
    from fastckpt.errors import RanksFailed
    return "OSError" if type(e) is RanksFailed else type(e).__name__

def main() -> int:
    store, rank, world, path, delay, timeout = sys.argv[1:7]
    import torch.distributed as dist

    import fastckpt
    from fastckpt import _C

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world),
                            timeout=datetime.timedelta(seconds=float(timeout)))
    want = collective_worker.build("mixed")
    if int(delay):
        _C.fault_inject("read", delay_ms=int(delay), times=0)
    print("STARTED", flush=True)
    try:
        got = fastckpt.load(path, group=dist.group.WORLD)
        print("OK" if collective_load_worker.same(want, got) else "ERR mismatch: the loaded object differs",
              flush=True)
    except Exception as e:
        print(f"ERR {_kind(e)}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    collective_worker.run_main(main)
