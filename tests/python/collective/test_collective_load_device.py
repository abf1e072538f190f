"""fastckpt.load(path, group=pg, map_location=<device>): the collective load
onto devices, through the staging pipeline (fastckpt/_collective_load.py,
fastckpt/_collective_exchange.py).

No GPU and no NCCL here: every rank (a subprocess,
tests/support/workers/collective_load_worker.py, on a gloo group) loads onto the
simulated device (tests/support/sim_device.py: copies land late and out of
order; a host buffer reused or freed before its copies finished is a
StagingViolation). Checked:

* staged through host memory (the gloo path): every rank gets what a plain
  load gives, on its device, with no staging violation; host memory per rank
  is the ring of pool chunks (_DEPTH x a round), not the state; no host
  storage is made; every storage byte is copied to the device once; the reads
  of round j+1 come before the wait for round j's broadcasts;
* device collectives (the NCCL path), driven by a test-only DeviceOps that
  carries sim tensors (a broadcast of a sim tensor is gloo's broadcast of its
  memory, once the copies issued to its device have landed: the order NCCL
  gets from torch's streams): the same checks; only holders use host memory;
* a device copy that fails on one rank fails every rank, naming the path;
* a backend that carries neither CPU tensors nor the device's (reported as
  "nccl") is a ValueError on every rank before the file is opened.

What only a machine with CUDA checks (the tests named cuda below, run by
benchmarks/gpu_check.sh): real NCCL broadcasts into CUDA storages and their
stream order, cudaHostRegister'ed ring buffers, CUDA copy streams.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.collective import exchange as _collective_exchange, load as _collective_load

from collective_ranks import last_line, storage_bytes
from collective_ranks import run_ranks as _run_ranks
from workers import collective_load_worker as worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

CHUNK = 4 << 20  # the pool's chunk in the workers (FASTCKPT_BUFFER_SIZE=1M: 4 x 1 MiB)


def run_ranks(tmp_path: Path, world: int, path: Path, case: str, mode: str):
    return _run_ranks(tmp_path, world, path, case, mode, worker_script="collective_load_worker.py",
                      rank_env=lambda r: {"FASTCKPT_BUFFER_SIZE": "1M"})


def line(text: str, key: str) -> str:
    return [x for x in text.splitlines() if x.startswith(key + " ")][-1][len(key) + 1:]


def stats(text: str) -> dict:
    return json.loads(line(text, "STATS"))



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    out = {}
    for case in ("mixed", "large"):
        out[case] = d / f"{case}.pt"
        fastckpt.save(worker.build(case), out[case])
    return out


def assert_all_ok(res):
    for r, (rc, text) in enumerate(res):
        assert rc == 0 and last_line(text) == "OK", f"rank {r} (exit {rc}): {text[-3000:]}"


@pytest.mark.parametrize("world,case,mode", [(1, "mixed", "sim"), (2, "large", "sim"), (3, "large", "sim"),
                                             (1, "mixed", "sim_nccl"), (2, "mixed", "sim_nccl"),
                                             (3, "large", "sim_nccl")])
def test_collective_load_onto_the_device_equals_a_plain_load(tmp_path, files, world, case, mode):
    path = files[case]
    res = run_ranks(tmp_path, world, path, case, mode)
    assert_all_ok(res)  # each rank: equal to a plain load and to the saved object, on sim:<rank % 2>, no violation
    total = storage_bytes(path)
    reads = [int(line(text, "READ")) for _, text in res]
    assert sum(reads) == total, reads  # the file read once in total
    st = [stats(text) for _, text in res]
    for r, s in enumerate(st):
        assert s["chunk"] == CHUNK and s["violations"] == [], s
        assert s["host_storage"] == 0, s  # no host storage made: the result went to the device
        # Host memory: the ring (_DEPTH rounds of one pool chunk here: world <= 4), not the state.
        assert 0 < s["peak_locked"] <= _collective_exchange._DEPTH * CHUNK, s
        if case == "large":
            assert s["peak_locked"] * 4 < total, (s, total)
        if mode == "sim":
            assert s["to_device"] == total, s  # every byte to the device once, from the ring
        else:  # device collectives: a holder copies its own share (and its small pieces again, packed)
            assert reads[r] <= s["to_device"] <= 2 * reads[r], (s, reads)
    if case == "large":
        # Round j + 1 is read before the wait for round j's broadcasts.
        for _, text in res:
            order = line(text, "ORDER") if line(text, "ORDER") else ""
            assert order.count("r") > 2 and order.index("w") > order.index("r", order.index("r") + 1), order


@pytest.mark.parametrize("mode", ["sim_missing1", "sim_nccl_missing1"])
def test_a_rank_without_the_file_gets_its_device_result_from_its_peers(tmp_path, files, mode):
    path = files["large"]
    res = run_ranks(tmp_path, 3, path, "large", mode)
    assert_all_ok(res)
    reads = [int(line(text, "READ")) for _, text in res]
    assert reads[1] == 0 and sum(reads) == storage_bytes(path), reads
    st = stats(res[1][1])
    assert st["host_storage"] == 0 and st["violations"] == [], st
    if mode == "sim_nccl_missing1":  # device collectives: a rank that reads nothing stages nothing
        assert st["peak_locked"] == 0 and st["to_device"] == 0, st


@pytest.mark.parametrize("mode", ["sim", "sim_nccl"])
def test_ranks_with_different_pool_chunks_cut_the_same_rounds(tmp_path, files, mode):
    """Rank 1's knob asks for 8 MiB chunks, the others' for 4 MiB: the ranks
    agree on the smallest, so every rank issues the same broadcasts."""
    path = files["large"]
    res = _run_ranks(tmp_path, 3, path, "large", mode, worker_script="collective_load_worker.py",
                     rank_env=lambda r: {"FASTCKPT_BUFFER_SIZE": "2M" if r == 1 else "1M"})
    assert_all_ok(res)
    for _, text in res:
        assert stats(text)["peak_locked"] <= _collective_exchange._DEPTH * CHUNK, text


def test_a_rank_whose_result_stays_on_the_host_joins_a_staged_load(tmp_path, files):
    path = files["mixed"]
    res = run_ranks(tmp_path, 3, path, "mixed", "sim_mixed")  # rank 1: map_location="cpu"
    assert_all_ok(res)
    st = [stats(text) for _, text in res]
    total = storage_bytes(path)
    assert st[1]["host_storage"] == total and st[1]["to_device"] == 0, st
    assert st[0]["host_storage"] == st[2]["host_storage"] == 0, st
    assert st[0]["to_device"] == st[2]["to_device"] == total, st


@pytest.mark.parametrize("mode,case", [("sim_fail", "mixed"), ("sim_nccl_fail", "large"), ("sim_sync_fail", "large")])
def test_a_failing_device_copy_on_one_rank_fails_every_rank(tmp_path, files, mode, case):
    path = files[case]
    res = run_ranks(tmp_path, 3, path, case, mode)  # rank 1's third copy to its device raises
    lines = [last_line(text) for _, text in res]
    assert all(rc == 0 for rc, _ in res), res
    assert lines[1].startswith("ERR RuntimeError: ") and str(path) in lines[1], lines
    assert "copying its bytes to sim:1 failed" in lines[1] and "the copy engine failed" in lines[1], lines
    for r in (0, 2):
        assert lines[r].startswith("ERR OSError: ") and str(path) in lines[r], lines
        assert "rank 1 of the group failed to read its share" in lines[r] and "nothing was loaded" in lines[r], lines
    for _, text in res:
        assert stats(text)["violations"] == [], text


@pytest.mark.parametrize("mode,what", [("nccl_cpu", "CPU tensors"), ("nccl_sim", "sim:")])
def test_a_backend_that_cannot_carry_the_result_fails_before_any_io(tmp_path, files, mode, what):
    path = files["mixed"]
    res = run_ranks(tmp_path, 2, path, "mixed", mode)
    for r, (rc, text) in enumerate(res):
        assert rc == 0 and last_line(text).startswith("ERR ValueError: "), text
        assert f"backend 'nccl' does not carry {what}" in text and str(path) in text and "gloo" in text, text
        assert line(text, "OPENED") == "0" and line(text, "READ") == "0", text  # the file never opened


# ---------------------------------------------------------------- pure parts

def test_staged_rounds_cover_the_shares_within_each_region():
    shares = [[("data/0", 0, 10_000_000), ("data/1", 0, 5), ("data/2", 0, 70_000), ("data/3", 0, 3)],
              [("data/3", 3, 100), ("data/4", 0, 3_000_000)], []]
    part = 1 << 20
    rounds = _collective_load._staged_rounds(shares, part)
    for k, share in enumerate(shares):
        got = [p for rnd in rounds for p in rnd[k]]
        # pieces in order, contiguous per record, covering the share exactly
        flat = {}
        for n, off, ln, at in got:
            assert flat.get(n, None) in (None, off), (n, off)
            flat[n] = off + ln
        assert flat == {n: off + ln for n, off, ln in share}
        for rnd in rounds:
            end = 0
            for n, off, ln, at in rnd[k]:
                assert at >= end and at % (4096 if ln >= _collective_load._BIG_PIECE else 64) == 0
                assert off % 4096 == 0 or off == 3  # cuts on 4 KiB (data/3 starts the 2nd share at 3)
                end = at + ln
            assert end <= part
    assert all(not rnd[2] for rnd in rounds)


def test_backends_of_a_group():
    assert "cpu" in _collective_exchange.backends_of("gloo")
    assert _collective_exchange.backends_of("nccl") == {"cuda": "nccl"}
    assert _collective_exchange.backends_of("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}


# ---------------------------------------------------------------- real CUDA (benchmarks/gpu_check.sh)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.skipif(not dist.is_nccl_available(), reason="needs NCCL")
def test_cuda_collective_load_over_nccl(tmp_path, files):
    """World size 1 (NCCL refuses two ranks on one GPU): device collectives into CUDA storages."""
    res = _run_ranks(tmp_path, 1, files["large"], "large", "gpu_nccl", worker_script="collective_load_worker.py")
    assert_all_ok(res)
    print(line(res[0][1], "STATS"))


@needs_cuda
def test_cuda_collective_load_over_gloo_staged(tmp_path, files):
    res = _run_ranks(tmp_path, 2, files["large"], "large", "gpu_gloo", worker_script="collective_load_worker.py")
    assert_all_ok(res)
    for _, text in res:  # host memory: the ring, not the state (RSS includes torch and CUDA's own)
        print(line(text, "STATS"))
