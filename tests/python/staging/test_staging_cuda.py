"""The staging component on real CUDA devices (skipped without one).

The same checks as test_staging_sim.py, on hardware: files written from
cuda:k equal the CPU save's; copies are ordered after the producing kernels
of the tensor's own device (a long kernel on cuda:k's current stream precedes
the data); loads onto cuda:k go through the bounded pool; async_save's
snapshot is page-locked with cudaHostRegister, exactly sized, not taken from
torch's caching host allocator. benchmarks/gpu_check.sh runs this file.
"""

import os
import uuid

import pytest
import torch

import fastckpt
from fastckpt.staging import device as _staging
from fastckpt import serialization

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (the CUDA path is tested on the simulated device: test_staging_sim.py)",
                allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

CHUNK_KNOB = 256 << 10
DEVICES = sorted({0, torch.cuda.device_count() - 1})  # cuda:0 and, where there is one, another device


@pytest.fixture(autouse=True)
def setup(monkeypatch):
    monkeypatch.setattr(fastckpt.formats.archive.uuid, "uuid4", lambda: uuid.UUID(int=12))
    with fastckpt.knobs.override(buffer_size=CHUNK_KNOB):
        yield
    torch.cuda.synchronize()


def make_state(seed=0, big=1 << 22):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(big, generator=g), "w": torch.randn(300, 7, generator=g).t(),
            "b": torch.randn(33, generator=g, dtype=torch.float64), "i": torch.arange(5),
            **{f"p{j}": torch.randn(10, generator=g) for j in range(50)}, "step": 3}


def to_device_late(sd, k):
    """`sd` on cuda:k, each tensor written by a kernel queued behind a long
    sleep on cuda:k's current stream (with cuda:0 current): a copy not ordered
    after that stream, or waited for on another device's event, reads or
    writes stale bytes."""
    out = {}
    with torch.cuda.device(k):
        for key, v in sd.items():
            if isinstance(v, torch.Tensor):
                d = torch.zeros(v.shape, dtype=v.dtype, device=f"cuda:{k}")
                torch.cuda._sleep(50_000_000)
                d.copy_(v.to(f"cuda:{k}"))
                out[key] = d
            else:
                out[key] = v
    return out


@pytest.mark.parametrize("k", DEVICES)
def test_cuda_save_equals_cpu_file(tmp_path, k):
    sd = make_state(1)
    fastckpt.save(sd, tmp_path / "cpu.pt")
    dev = to_device_late(sd, k)
    fastckpt.save(dev, tmp_path / "gpu.pt")
    # the location tags differ (cuda:k vs cpu): compare the loaded data and the records' bytes
    got = fastckpt.load(tmp_path / "gpu.pt", map_location="cpu", verify=True)
    for key, v in sd.items():
        assert (torch.equal(got[key], v) if isinstance(v, torch.Tensor) else got[key] == v), key
    pool = _staging.pool_for(_staging._cuda, 4 * CHUNK_KNOB)
    assert pool.held_bytes <= pool.chunk * pool.count


@pytest.mark.parametrize("k", DEVICES)
def test_cuda_fastwriter_on_device_k(tmp_path, k):
    import torch.distributed.checkpoint as dcp
    from dcp_calls import dcp_unwrapped
    from fastckpt.dcp import FastReader, FastWriter
    sd = make_state(2)
    dev = to_device_late(sd, k)
    dcp_unwrapped(dcp.save, dev, storage_writer=FastWriter(tmp_path / "ck"), no_dist=True)
    tgt = {key: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for key, v in sd.items()}
    dcp.load(tgt, storage_reader=FastReader(tmp_path / "ck"), no_dist=True)
    for key, v in sd.items():
        assert (torch.equal(tgt[key], v) if isinstance(v, torch.Tensor) else tgt[key] == v), key
    w = FastWriter(tmp_path / "st")
    staged = w.stage(to_device_late(sd, k))
    for key, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert staged[key].is_pinned() and torch.equal(staged[key], v), key


@pytest.mark.parametrize("how", ["str", "dict", "callable"])
def test_cuda_load_through_the_pool(tmp_path, how):
    k = DEVICES[-1]
    sd = make_state(3)
    path = tmp_path / "c.pt"
    fastckpt.save(sd, path)
    ml = {"str": f"cuda:{k}", "dict": {"cpu": f"cuda:{k}"}, "callable": lambda s, loc: s.cuda(k)}[how]
    got = fastckpt.load(path, map_location=ml, verify=True)
    for key, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert got[key].device == torch.device("cuda", k) and torch.equal(got[key].cpu(), v), key
    pool = _staging.pool_for(_staging._cuda, 4 * CHUNK_KNOB)
    assert pool.held_bytes <= pool.chunk * pool.count < os.path.getsize(path)


def test_cuda_async_save_snapshot_is_registered_and_exact(tmp_path):
    from fastckpt.saver import AsyncSaver
    sd = make_state(4)
    dev = to_device_late(sd, DEVICES[-1])
    before = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
    saver = AsyncSaver()
    saver.save(dev, tmp_path / "a.pt").result(timeout=120)
    arena = saver.stager._free[0]
    need = sum((v.nbytes + 63) // 64 * 64 for v in sd.values() if isinstance(v, torch.Tensor))
    assert arena.pinned and arena.buf.is_pinned()
    assert arena.capacity == (need + (1 << 20) - 1) // (1 << 20) * (1 << 20)
    # not from torch's caching host allocator (which rounds up to a power of two and keeps it)
    assert torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0) == before
    got = fastckpt.load(tmp_path / "a.pt", map_location="cpu")
    for key, v in sd.items():
        assert (torch.equal(got[key], v) if isinstance(v, torch.Tensor) else got[key] == v), key
