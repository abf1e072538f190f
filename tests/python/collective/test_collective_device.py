"""fastckpt.save(obj, path, group=pg) of state on a device
(fastckpt/_collective_stage.py), on the simulated device of
tests/support/sim_device.py: copies land late and out of order, and a host
buffer written, reused or freed before its copy landed is a violation. No GPU
runs here. Each rank is a subprocess (tests/support/workers/collective_device_worker.py)
of a gloo group.

Checked: the file is byte-identical to a single-process save of the same
state on the CPU; each rank copies to the host only the byte ranges it needs
(its share, the next rank's share, the sampled blocks and, on rank 0, the
small records and record tails), through the bounded staging pools (the
page-locked host memory never exceeds them, far less than the state); a
device copy that fails on one rank fails every rank, naming the user's path,
with the previous checkpoint intact and no temporary file left.
"""
import pickle

import pytest
import torch
import torch.distributed as dist

from fastckpt.collective import save as _collective, stage as _collective_stage
from fastckpt.formats import torch_rules as _torch_rules
import fastckpt.formats.pickler
from fastckpt import serialization

from collective_ranks import last_line, leftovers, reference_bytes, run_ranks
from states import assert_same
from workers import collective_worker as worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORKER = "collective_device_worker.py"


def expected_host_bytes(case: str, world: int):
    """What each rank needs on the host, from the plan of build(case):
    (per rank its share's bytes, the sampled bytes of all storages, the bytes
    rank 0 writes of the storages besides the shares, the storages' total)."""
    data_pkl, storages = fastckpt.formats.pickler.pickle_with_storages(worker.build(case), pickle, 2)
    plan, _entries, _cd, size = fastckpt.formats.archive.plan_archive(data_pkl, storages, _torch_rules.storage_alignment(),
                                                            True, serialization_id=worker.SID)
    bodies, shares = _collective._shares(plan, world, size)
    sizes = [s.nbytes() for s in storages]
    share_bytes = [sum(n for _i, _s, n, _o in share) for share in shares]
    samples = sum(n for s in sizes for _start, n in _collective_stage.sample_ranges(s))
    rest = sum(e.size - bodies.get(i, (0, 0))[1] for i, (p, _h, e) in enumerate(plan) if not isinstance(p, (bytes, bytearray)))
    return share_bytes, samples, rest, sum(sizes)


def parse(text: str):
    fields = {}
    for line in text.splitlines():
        head, _, tail = line.partition(" ")
        if head in ("HOST", "LENT", "VIOLATIONS"):
            fields[head] = [int(x) for x in tail.split()]
    return fields


_runs = {}


def saved(tmp_path_factory, world: int, case: str, mode: str):
    """One collective save of build(case) on the simulated device (cached per
    (world, case, mode)): (path, [(exit status, output) per rank])."""
    key = (world, case, mode)
    if key not in _runs:
        d = tmp_path_factory.mktemp(f"dev{world}{case}")
        out = d / "out"
        out.mkdir()
        path = out / "ckpt.pt"
        _runs[key] = path, run_ranks(d, world, path, case, mode, worker_script=WORKER)
    return _runs[key]


# cpu_some: every third storage stays on the CPU (as an optimizer's step counters do).
CASES = [(1, "mixed", "ok"), (2, "mixed", "ok"), (3, "mixed", "ok"), (3, "one_big", "ok"), (3, "few", "ok"),
         (3, "mixed", "cpu_some")]


@pytest.mark.parametrize("world,case,mode", CASES)
def test_device_state_gives_the_cpu_file(tmp_path_factory, tmp_path, world, case, mode):
    path, res = saved(tmp_path_factory, world, case, mode)
    for r, (rc, text) in enumerate(res):
        assert rc == 0 and last_line(text) == "OK", f"rank {r} (exit {rc}): {text}"
        f = parse(text)
        assert f["VIOLATIONS"] == [0], f"rank {r}: staging violations: {text}"
        assert f["LENT"] == [0], f"rank {r}: staging buffers not given back: {text}"
    assert path.read_bytes() == reference_bytes(tmp_path, case)
    assert leftovers(path.parent) == []
    assert_same(worker.build(case), torch.load(path, weights_only=True))


@pytest.mark.parametrize("world,case,mode", CASES)
def test_each_rank_stages_only_what_it_needs(tmp_path_factory, world, case, mode):
    """Bytes copied device -> host per rank: at least its own share and the
    next rank's (they go through the staging copier, not read in place), at
    most those plus the sampled blocks plus, on rank 0, what it writes besides
    the shares; page-locked host memory at its peak: at most the staging
    pools, less than the state (none of it a host copy of the state)."""
    _path, res = saved(tmp_path_factory, world, case, mode)
    shares, samples, rest, total = expected_host_bytes(case, world)
    for r, (rc, text) in enumerate(res):
        assert rc == 0 and last_line(text) == "OK", f"rank {r} (exit {rc}): {text}"
        copied, peak_locked, pools = parse(text)["HOST"]
        own = shares[r]
        nxt = shares[(r + 1) % world] if world > 1 else 0
        bound = own + nxt + samples + (rest if r == 0 else 0)
        least = own + nxt if mode == "ok" else 1  # (with CPU storages: those are not copied)
        assert least <= copied <= bound, (
            f"rank {r} copied {copied} bytes to the host; it needs {own} (own share) + {nxt} (next share) "
            f"+ at most {samples} (samples) + {rest if r == 0 else 0} (rank 0's rest); the state is {total}")
        assert peak_locked <= pools, f"rank {r}: {peak_locked} bytes page-locked, more than the pools' {pools}"
        if total > pools:
            assert peak_locked < total
    if world == 3 and case == "mixed" and mode == "ok":  # shares smaller than the state: staging is per range, not per storage
        assert all(parse(text)["HOST"][0] < total for _rc, text in res[1:])


@pytest.mark.parametrize("stage,rank", [("sample", 2), ("share", 1), ("rest", 0)])
def test_failed_device_copy_on_one_rank_fails_every_rank(tmp_path, stage, rank):
    out = tmp_path / "out"
    out.mkdir()
    path = out / "ckpt.pt"
    path.write_bytes(b"previous")
    res = run_ranks(tmp_path, 3, path, "mixed", f"fail_{stage}_{rank}", worker_script=WORKER)
    lines = [last_line(text) for _rc, text in res]
    for r, (rc, text) in enumerate(res):
        assert rc == 0, f"rank {r} exited with {rc}:\n{text}"
        f = parse(text)
        assert f["VIOLATIONS"] == [0] and f["LENT"] == [0], f"rank {r}: {text}"
        assert lines[r].startswith("ERR ") and str(path) in lines[r], f"rank {r}: {lines[r]}"
    # The failing rank: its own error, naming the path, the storage's range and the device's error.
    assert lines[rank].startswith(f"ERR RuntimeError: cannot save to {str(path)!r}: copying bytes "), lines
    assert "of storage data/" in lines[rank] and "(on sim:" in lines[rank], lines
    assert "to host memory failed: RuntimeError: sim: injected device copy failure" in lines[rank], lines
    for r in set(range(3)) - {rank}:
        assert lines[r].startswith("ERR OSError: ") and f"rank {rank} of the group failed" in lines[r], lines
    assert path.read_bytes() == b"previous"
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt"]


def test_engine_fault_with_device_state_fails_every_rank(tmp_path):
    """A write that fails while device bytes are staged: every rank raises,
    every staging buffer is given back, nothing committed."""
    out = tmp_path / "out"
    out.mkdir()
    path = out / "ckpt.pt"
    path.write_bytes(b"previous")
    res = run_ranks(tmp_path, 3, path, "mixed", "fault", worker_script=WORKER)
    lines = [last_line(text) for _rc, text in res]
    for r, (rc, text) in enumerate(res):
        assert rc == 0, f"rank {r} exited with {rc}:\n{text}"
        f = parse(text)
        assert f["VIOLATIONS"] == [0] and f["LENT"] == [0], f"rank {r}: {text}"
        assert lines[r].startswith("ERR OSError: ") and str(path) in lines[r], lines
    assert "Input/output error" in lines[1], lines
    assert "rank 1 of the group failed to write its share" in lines[0], lines
    assert path.read_bytes() == b"previous"
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt"]
