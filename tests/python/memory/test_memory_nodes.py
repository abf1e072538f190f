"""The memory tier across emulated nodes: one torchrun agent per node on this machine (a static
rendezvous on 127.0.0.1), each node with its own FASTCKPT_MEMORY_DIR on /dev/shm, training a DDP
model over gloo with a snapshot every step and a disk checkpoint every 4 (tests/support/workers/
memory_job.py). Every rank is SIGKILLed after a snapshot; the restarted job must end bitwise equal
to an uninterrupted run, restoring from its own memory, from a peer's replica when a node lost its
memory, and from the disk when the replica it needs is damaged."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dist_launch import report, torchrun_nodes
from paths import WORKERS
from states import assert_same

JOB = WORKERS / "memory_job.py"
STEPS, KILL = 11, 6


@pytest.fixture
def nodes(tmp_path):
    """Two (or more) nodes' memory directories, removed after the test."""
    made = []

    def make(n):
        dirs = [Path("/dev/shm") / f"fastckpt-test-{os.getpid()}-{tmp_path.name}-node{i}" for i in range(n)]  # unique per xdist worker
        made.extend(dirs)
        return dirs
    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def run(mem, ckpt, *extra, nproc=1):
    return torchrun_nodes(JOB, "--dir", ckpt, "--steps", STEPS, *extra, nproc=nproc,
                          node_env=[{"FASTCKPT_MEMORY_DIR": str(d)} for d in mem], timeout=240)


def restored(results):
    lines = [ln for r in results for ln in r.stdout.splitlines() if ln.startswith(("RESTORED", "FRESH"))]
    return lines


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final state of an uninterrupted run (2 nodes x 1 rank; 2 x 2 for nproc=2)."""
    out = {}

    def get(nproc, width=64):
        if (nproc, width) not in out:
            t = tmp_path_factory.mktemp(f"ref{nproc}")
            mem = [t / f"mem{i}" for i in range(2)]
            res = run(mem, t / "ckpt", "--out", t / "final.pt", "--width", width, nproc=nproc)
            assert all(r.returncode == 0 for r in res), report(res)
            out[(nproc, width)] = torch.load(t / "final.pt")
        return out[(nproc, width)]
    return get


def killed_run(mem, ckpt, nproc=1, *extra):
    res = run(mem, ckpt, "--kill-after", KILL, *extra, nproc=nproc)
    assert all(r.returncode != 0 for r in res), report(res)  # every rank died by SIGKILL
    assert all("OK" not in r.stdout for r in res)


@pytest.fixture(scope="module")
def after_a_kill(tmp_path_factory):
    """The state after one killed run of 2 nodes x 1 rank (killed_run), which three scenarios start
    from: the run happens once, and each test gets its memory directories and checkpoint directory
    back as the kill left them, at the same paths (the memory tier's namespace is the checkpoint
    directory's), whatever the test before changed or added there."""
    base = tmp_path_factory.mktemp("killed")
    mem = [Path("/dev/shm") / f"fastckpt-test-{os.getpid()}-{base.name}-node{i}" for i in range(2)]
    ckpt, kept = base / "ckpt", base / "kept"
    live = [*mem, ckpt]
    saved = [kept / f"mem{i}" for i in range(2)] + [kept / "ckpt"]

    def get():
        if not kept.exists():
            killed_run(mem, ckpt)
            for src, dst in zip(live, saved):
                shutil.copytree(src, dst, symlinks=True)
        else:
            for src, dst in zip(saved, live):
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(src, dst, symlinks=True)
        return mem, ckpt
    yield get
    for d in mem:
        shutil.rmtree(d, ignore_errors=True)


def finish(mem, ckpt, tmp_path, nproc=1, *extra):
    res = run(mem, ckpt, "--out", tmp_path / "final.pt", *extra, nproc=nproc)
    assert all(r.returncode == 0 for r in res), report(res)
    return res, torch.load(tmp_path / "final.pt")


def test_a_job_killed_on_every_rank_resumes_from_its_own_memory(tmp_path, after_a_kill, reference):
    mem, ckpt = after_a_kill()
    res, final = finish(mem, ckpt, tmp_path)
    lines = restored(res)
    assert len(lines) == 2 and all(ln.startswith(f"RESTORED {KILL} ") for ln in lines), lines
    for i, ln in enumerate(sorted(lines, key=lambda s: "node1" in s)):
        assert ln.split()[2].startswith(str(mem[i])) and f"/rank{i}/" in ln  # each rank from its node's memory
    assert_same(final, reference(1), bitwise=True)


# 2 ranks per node: the long tier (test_replicas.py checks every placement's plan in make test)
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.long)])
def test_a_lost_node_restores_from_its_peers_replicas(tmp_path, nodes, after_a_kill, reference, nproc):
    if nproc == 1:
        mem, ckpt = after_a_kill()
    else:
        mem, ckpt = nodes(2), tmp_path / "ckpt"
        killed_run(mem, ckpt, nproc=nproc)
    shutil.rmtree(mem[1])  # node 1 replaced: its memory is empty
    res, final = finish(mem, ckpt, tmp_path, nproc=nproc)
    lines = restored(res)
    assert len(lines) == 2 * nproc and all(ln.startswith(f"RESTORED {KILL} ") for ln in lines), lines
    assert_same(final, reference(nproc), bitwise=True)
    assert not any("WARNING" in r.stdout for r in res)


def test_a_damaged_replica_is_not_used(tmp_path, after_a_kill, reference):
    mem, ckpt = after_a_kill()
    shutil.rmtree(mem[1])
    flipped = 0
    for commit in mem[0].glob("*/replica1/slot*.commit"):  # every replica of rank 1: one flipped byte each
        rec = json.loads(commit.read_text())
        p = commit.with_suffix(".pt")
        b = bytearray(p.read_bytes())
        b[rec["storages"][0][0] + 1] ^= 0x01
        p.write_bytes(b)
        flipped += 1
    assert flipped == 2
    res, final = finish(mem, ckpt, tmp_path)
    lines = restored(res)
    assert len(lines) == 2 and all(ln.startswith("RESTORED 4 ") and str(ckpt) in ln for ln in lines), lines
    out = "".join(r.stdout + r.stderr for r in res)
    assert "damaged" in out and "WARNING" in out  # said, on the ranks and in the log
    assert_same(final, reference(1), bitwise=True)


# Without a lost node (each rank restores from its own memory after the kill): the long tier
@pytest.mark.parametrize("lose_node", [pytest.param(False, marks=pytest.mark.long), True])
def test_a_kill_during_the_background_commit_and_replication(tmp_path, nodes, reference, lose_node):
    """Every rank killed as soon as its snapshot returns (CRC-32, commit record and replication
    still running): the restart takes the newest step every rank can restore (this one or the
    previous), from memory or the peers' replicas, and ends bitwise equal."""
    mem = nodes(2)
    killed_run(mem, tmp_path / "ckpt", 1, "--kill-now", "--width", 512)
    if lose_node:
        shutil.rmtree(mem[1])
    res, final = finish(mem, tmp_path / "ckpt", tmp_path, 1, "--width", 512)
    steps = {int(ln.split()[1]) for ln in restored(res)}
    assert len(steps) == 1 and steps <= {KILL, KILL - 1}, restored(res)  # one step for every rank
    assert_same(final, reference(1, 512), bitwise=True)
