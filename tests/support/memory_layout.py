"""Memory tier directories made by hand, as the tier lays them out (fastckpt/memory/slots.py,
fastckpt/memory/tier.py): for the tests of finding and removing stale snapshots."""

import io
import json
import os
import socket
import subprocess
import sys
import time

import torch

from fastckpt.memory.slots import RECORD_VERSION, SlotDir
from fastckpt.memory.tier import OWNER_FILE, namespace_of


def dead_pid() -> int:
    """The pid of a process of this host that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_slot(d: SlotDir, k: int, step: int, rank: int = 0, numel: int = 1000) -> int:
    """A complete slot k of `step` in `d` (a torch.save archive and its commit record); returns its length."""
    os.makedirs(d.path, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"w": torch.full((numel,), float(step))}, buf)
    data = buf.getvalue()
    with open(d.archive(k), "wb") as f:
        f.write(data)
    d.write_record({"version": RECORD_VERSION, "step": step, "rank": rank, "nbytes": len(data), "crc": 0,
                    "slot": k, "pkl": [0, 1], "storages": [], "opts": {}, "time": time.time()})
    return len(data)


def make_namespace(root, ckpt_dir, pid, ranks=(0,), replicas=(), steps=(10, 20), host=None, since=None):
    """The namespace of `ckpt_dir` under `root` as a job of process `pid` leaves it: per rank its
    slots of `steps` and owner.json, per replica rank the replicas of `steps`. Returns its path."""
    ns = os.path.join(str(root), namespace_of(str(ckpt_dir)))
    for r in ranks:
        d = SlotDir(os.path.join(ns, f"rank{r}"), keep=len(steps))
        for k, s in enumerate(steps):
            write_slot(d, k, s, rank=r)
        owner = {"pid": pid, "host": host or socket.gethostname(), "directory": os.path.realpath(str(ckpt_dir)),
                 "rank": r, "since": time.time() if since is None else since}
        with open(os.path.join(d.path, OWNER_FILE), "w") as f:
            json.dump(owner, f)
    for r in replicas:
        d = SlotDir(os.path.join(ns, f"replica{r}"), keep=len(steps))
        for k, s in enumerate(steps):
            write_slot(d, k, s, rank=r)
    return ns


def age(path, seconds: float) -> None:
    """Make every file and directory under `path` (and `path`) look `seconds` old."""
    t = time.time() - seconds
    for dirpath, dirs, files in os.walk(path):
        for n in files + dirs:
            os.utime(os.path.join(dirpath, n), (t, t), follow_symlinks=False)
    os.utime(path, (t, t))


def tree(path):
    """Every path under `path`, relative, sorted (links not followed)."""
    out = []
    for dirpath, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(dirpath, n), path) for n in dirs + files]
    return sorted(out)
