"""One rank of ``fastckpt convert SRC DST --to TO`` under torchrun's environment (tests/python/cli/
test_convert_ranks.py): at WORLD_SIZE > 1 the command line itself (fastckpt.cli.command.main); at 1,
fastckpt.cli.convert_ranks.convert_ranks over a gloo group of one. The serialization id is fixed so
that the file can be compared with the single-process conversion's.

Usage: python convert_ranks_worker.py SRC DST TO MODE
MODE: "ok"; "kill" (rank 1 is SIGKILLed when it starts reading its first tensor).
Prints "REPORT {json}": the exit status, the tensor bytes this rank read from SRC (counted at
DcpSource.load_tensor), its /proc/self/io write_bytes over the conversion and its peak RSS growth
(VmHWM after resetting it; null where the kernel cannot reset it).
"""
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support
from crafted import hwm_resettable, status_bytes  # noqa: E402
from proc_io import io_counter  # noqa: E402

import torch  # noqa: E402
import torch.distributed.checkpoint  # noqa: E402,F401  (imported before the memory baseline)

import fastckpt.formats.archive  # noqa: E402
from fastckpt.sources.dcp import DcpSource  # noqa: E402

SID = b"1234567890123456789012345678901234567890"


def main(src: str, dst: str, to: str, mode: str) -> None:
    torch.set_num_threads(1)
    fastckpt.formats.archive.new_serialization_id = lambda: SID
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    read = {"bytes": 0, "tensors": 0}
    orig = DcpSource.load_tensor

    def counted(self, fqn):
        if mode == "kill" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t = orig(self, fqn)
        read["bytes"] += t.numel() * t.element_size()
        read["tensors"] += 1
        return t
    DcpSource.load_tensor = counted
    resettable = hwm_resettable() is None  # resets the peak RSS to the current RSS when it can
    base = status_bytes("VmRSS")
    before = io_counter("write_bytes")
    if world > 1:
        from fastckpt.cli.command import main as cli
        rc = cli(["convert", src, dst, "--to", to, "--force", "--drop-non-tensors"])
    else:
        import torch.distributed as dist
        from fastckpt.cli.convert_ranks import convert_ranks
        from fastckpt.sources.kinds import open_source
        dist.init_process_group("gloo")
        with open_source(src) as s:
            convert_ranks(s, dst, to, drop_non_tensors=True)
        dist.destroy_process_group()
        rc = 0
    print("REPORT " + json.dumps({"rank": rank, "rc": rc, "read": read["bytes"], "tensors": read["tensors"],
                                  "write_bytes": io_counter("write_bytes") - before,
                                  "grown": status_bytes("VmHWM") - base if resettable else None}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
