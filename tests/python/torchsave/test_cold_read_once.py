"""A cold load reads each byte of the file from the disk once: the metadata reads (zip directory,
data.pkl, safetensors header) start no readahead of tensor data, and the page-cache phase of the
engine's reads issues no read that misses (a miss would start the kernel's readahead of megabytes
that the O_DIRECT reads then read again). Measured as the bytes read by the block device of a
filesystem of the module's own (ext4 on a loop device, tests/support/loopfs.py): /proc/self/io's
read_bytes would also count the code pages this process faults in again after another test drops
the whole page cache. The kernel's read_ahead_kb is whatever the machine has."""
import contextlib
import os
from pathlib import Path

import pytest
import torch

import fastckpt
import fastckpt.safetensors as fst

from engines import drop_page_cache, held_in_page_cache
from loopfs import LoopFsUnavailable, cached_bytes, loop_ext4

SIZE = 24 << 20
SLACK = 256 << 10  # metadata pages read twice at most (the first and the last few pages)


@pytest.fixture(scope="module")
def fs(tmp_path_factory):
    try:
        with loop_ext4(str(tmp_path_factory.mktemp("loop"))) as lfs:
            yield lfs
    except LoopFsUnavailable as e:
        pytest.skip(f"no filesystem of the test's own to count its reads: {e}")


@pytest.fixture(scope="module")
def files(fs):
    d = Path(fs.mount)
    g = torch.Generator().manual_seed(3)
    sd = {f"layer{i}.weight": torch.randn(SIZE // 4 // 24, generator=g) for i in range(24)}
    sd["scale"] = torch.ones(7)
    pt, st = d / "c.pt", d / "c.safetensors"
    fastckpt.save(sd, pt)
    fst.save_file(sd, st)
    # Every path once, warm (imports and first-call set-up out of the way).
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    for path in (pt, st):
        fastckpt.load(path) if path == pt else fst.load_file(path)
        fastckpt.load(pt, verify=False)
        fastckpt.load_into(target, path)
    return sd, pt, st, fs


def _cold_read(fs, path, fn):
    drop_page_cache(path)
    before = fs.read_bytes()
    out = fn()
    return out, fs.read_bytes() - before


def _check(path, read):
    size = os.path.getsize(path)
    assert size <= read <= size + SLACK, f"a cold load of {size} bytes read {read} bytes from the disk"


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_load(files, verify):
    sd, pt, _, fs = files
    got, read = _cold_read(fs, pt, lambda: fastckpt.load(pt, verify=verify))
    assert torch.equal(got["layer5.weight"], sd["layer5.weight"])
    _check(pt, read)


def test_safetensors_load_file(files):
    sd, _, st, fs = files
    got, read = _cold_read(fs, st, lambda: fst.load_file(st))
    assert torch.equal(got["layer7.weight"], sd["layer7.weight"])
    _check(st, read)


@pytest.mark.parametrize("which", ["pt", "safetensors"])
def test_load_into(files, which):
    sd, pt, st, fs = files
    path = pt if which == "pt" else st
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    _, read = _cold_read(fs, path, lambda: fastckpt.load_into(target, path))
    assert torch.equal(target["layer9.weight"], sd["layer9.weight"])
    _check(path, read)


@pytest.mark.parametrize("which", ["load", "safetensors", "load_into"])
def test_a_warm_load_reads_nothing_from_the_disk(files, which):
    """A load of a file wholly in the page cache reads nothing from the disk. The file is held in
    the page cache (mapped and locked) while the loads run: unmapped page-cache pages can be evicted
    at any moment (another test's drop_caches, the host's proactive reclaim: this VM pages out
    unmapped file pages with DAMON), and a load that finds pages gone rightly reads them. Against
    the kernel's own miscounts (cachestat can count a cached step short, RangeReader::cached_pages) the
    engine asks again: before that, 1 load in 60 read megabytes of such a file here under load."""
    sd, pt, st, fs = files
    path = st if which == "safetensors" else pt
    size = os.path.getsize(path)
    whole = size + (-size) % 4096
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    load = {"load": lambda: fastckpt.load(path), "safetensors": lambda: fst.load_file(path),
            "load_into": lambda: fastckpt.load_into(target, path)}[which]
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(held_in_page_cache(path))
        except OSError as e:
            pytest.skip(f"cannot keep the file in the page cache: {e}")
        for i in range(5):
            assert cached_bytes(path) in (None, whole), "the file held in the page cache is not all there"
            before = fs.read_bytes()
            got = load()
            read = fs.read_bytes() - before
            got = target if which == "load_into" else got
            assert torch.equal(got["layer3.weight"], sd["layer3.weight"])
            assert read <= SLACK, f"load {i} of {size} bytes in the page cache read {read} bytes from the disk"


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
def test_a_load_of_many_small_records_reads_each_byte_once(fs, writer):
    """Hundreds of small storages, each with its local header: the headers are read with the
    storages, not in a batch of their own before them (which read about a page per record again)."""
    g = torch.Generator().manual_seed(4)
    sd = {f"p{i}": torch.randn(200 + 29 * i, generator=g) for i in range(600)}
    path = Path(fs.mount) / f"many-{writer}.pt"
    (fastckpt.save if writer == "fastckpt" else torch.save)(sd, path)
    fastckpt.load(path)  # warm: imports and first-call set-up
    for verify in (True, False):
        got, read = _cold_read(fs, path, lambda: fastckpt.load(path, verify=verify))
        assert torch.equal(got["p599"], sd["p599"])
        _check(path, read)
