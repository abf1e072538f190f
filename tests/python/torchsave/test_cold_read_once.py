"""A cold load reads each byte of the file from the disk once: the metadata reads (zip directory,
data.pkl, safetensors header) start no readahead of tensor data, and the page-cache phase of the
engine's reads issues no read that misses (a miss would start the kernel's readahead of megabytes
that the O_DIRECT reads then read again). Measured with /proc/self/io's read_bytes (what this
process made the block layer read); the kernel's read_ahead_kb is whatever the machine has."""
import os

import pytest
import torch

import fastckpt
import fastckpt.safetensors as fst

from engines import drop_page_cache
from proc_io import io_counter

SIZE = 24 << 20
SLACK = 256 << 10  # metadata pages read twice at most (the first and the last few pages)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cold")
    g = torch.Generator().manual_seed(3)
    sd = {f"layer{i}.weight": torch.randn(SIZE // 4 // 24, generator=g) for i in range(24)}
    sd["scale"] = torch.ones(7)
    pt, st = d / "c.pt", d / "c.safetensors"
    fastckpt.save(sd, pt)
    fst.save_file(sd, st)
    if io_counter("read_bytes") == 0 and not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io: this kernel does not count a process's reads")
    # Every path once, warm: the modules they import and the code they run are read from the disk
    # now, not during a measured load (read_bytes counts those reads too).
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    for path in (pt, st):
        fastckpt.load(path) if path == pt else fst.load_file(path)
        fastckpt.load(pt, verify=False)
        fastckpt.load_into(target, path)
    return sd, pt, st


def _cold_read(path, fn):
    drop_page_cache(path)
    before = io_counter("read_bytes")
    out = fn()
    return out, io_counter("read_bytes") - before


def _check(path, got, read):
    size = os.path.getsize(path)
    if read == 0:
        pytest.skip(f"{path}: the filesystem counts no block reads here (tmpfs?)")
    assert size <= read <= size + SLACK, f"a cold load of {size} bytes read {read} bytes from the disk"


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_load(files, verify):
    sd, pt, _ = files
    got, read = _cold_read(pt, lambda: fastckpt.load(pt, verify=verify))
    assert torch.equal(got["layer5.weight"], sd["layer5.weight"])
    _check(pt, got, read)


def test_safetensors_load_file(files):
    sd, _, st = files
    got, read = _cold_read(st, lambda: fst.load_file(st))
    assert torch.equal(got["layer7.weight"], sd["layer7.weight"])
    _check(st, got, read)


@pytest.mark.parametrize("which", ["pt", "safetensors"])
def test_load_into(files, which):
    sd, pt, st = files
    path = pt if which == "pt" else st
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    _, read = _cold_read(path, lambda: fastckpt.load_into(target, path))
    assert torch.equal(target["layer9.weight"], sd["layer9.weight"])
    _check(path, target, read)


def test_a_warm_load_reads_nothing_from_the_disk(files):
    sd, pt, _ = files
    with open(pt, "rb") as f:  # into the page cache
        while f.read(8 << 20):
            pass
    before = io_counter("read_bytes")
    got = fastckpt.load(pt)
    assert io_counter("read_bytes") - before <= SLACK
    assert torch.equal(got["layer3.weight"], sd["layer3.weight"])
