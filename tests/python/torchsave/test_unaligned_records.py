"""A file whose storages are not 4 KiB-aligned (torch.save's records are 64-byte aligned) is read
straight into the loaded storages: each storage of at least DIRECT_MIN bytes gets memory at its
record's phase within a page (host_storage), so the engine reads the aligned body of every record
with O_DIRECT into it and only the heads and tails (under a block each) go through staging."""
import os

import pytest
import torch

import fastckpt
from fastckpt.formats import zip as _zip
from fastckpt.torchsave.reader import host_storage

from engines import drop_page_cache, record_reads


@pytest.mark.parametrize("offset", [0, 64, 4096 + 136, 8 * 511, 4096 - 8])
def test_host_storage_starts_at_the_offsets_phase(offset):
    t = host_storage(_zip.DIRECT_MIN, offset)
    assert t.data_ptr() % _zip.ALIGNMENT == offset % _zip.ALIGNMENT
    assert t.numel() == _zip.DIRECT_MIN and t.untyped_storage().nbytes() == _zip.DIRECT_MIN
    t.fill_(7)  # all of it is ours
    assert int(t.sum()) == 7 * _zip.DIRECT_MIN


@pytest.mark.parametrize("offset", [3, 4096 + 2, 100])
def test_a_phase_that_is_not_a_multiple_of_8_gets_aligned_memory(offset):
    """A tensor of any dtype must stay aligned to its element size: such offsets are read through
    staging into page-aligned memory, as before."""
    assert host_storage(_zip.DIRECT_MIN, offset).data_ptr() % _zip.ALIGNMENT == 0


@pytest.mark.parametrize("offset,item,phase", [(4100, 4, 4), (4098, 4, 0), (4098, 2, 2), (4097, 1, 1),
                                               (4100, 8, 0), (4104, 16, 8)])
def test_the_phase_keeps_elements_of_the_given_size_aligned(offset, item, phase):
    """safetensors knows each tensor's dtype: an offset that is a multiple of its element size
    (at most 8) keeps its phase."""
    assert host_storage(_zip.DIRECT_MIN, offset, item).data_ptr() % _zip.ALIGNMENT == phase


def test_small_storages_take_torchs_allocator():
    t = host_storage(_zip.DIRECT_MIN - 1, 64)
    assert t.numel() == _zip.DIRECT_MIN - 1


def test_a_torch_save_file_is_read_straight_into_its_storages(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate([70000, 123457, 300001, 17, 65536])}
    sd["b"] = torch.randn(1000, generator=g).to(torch.bfloat16)
    path = tmp_path / "stock.pt"
    torch.save(sd, path)
    drop_page_cache(path)
    calls = record_reads(monkeypatch)
    got = fastckpt.load(path)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k
    big = [k for k, v in sd.items() if v.numel() * v.element_size() >= _zip.DIRECT_MIN]
    assert {got[k].data_ptr() % 64 for k in big} == {0}  # torch.save's record alignment, kept
    st = [c for c in calls if c.get("bytes_read")]
    if not st or not any(c.get("direct") for c in st):
        pytest.skip(f"no O_DIRECT reads on this filesystem ({os.fspath(tmp_path)})")
    assert sum(c["direct_requests"] for c in st) >= len(big)
    # the bodies came straight from the disk: staging read at most the heads and tails
    assert sum(c["bytes_read"] for c in st) <= os.path.getsize(path) + 2 * 4096 * len(sd)
