"""The memory a load returns (fastckpt.torchsave.reader.host_storage): storages of 2 MiB or more
on transparent huge pages (MADV_HUGEPAGE) unless the knob load_huge_pages is 0; the tensors are
the file's, bitwise, either way."""
import sys

import pytest
import torch

import fastckpt
from fastckpt import knobs
import fastckpt.safetensors as fst
import fastckpt.torchsave.reader as reader

MIB = 1 << 20


def _vma_flags(addr: int) -> str:
    """The VmFlags of the mapping of this process that holds `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split(":", 1)[1]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _state():
    g = torch.Generator().manual_seed(5)
    return {"big": torch.randn(5 * MIB // 4 + 3, generator=g), "small": torch.randn(100, generator=g)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_large_storages_come_on_huge_pages(tmp_path, fmt):
    sd = _state()
    if fmt == "torch":
        fastckpt.save(sd, tmp_path / "c.pt")
        got = fastckpt.load(tmp_path / "c.pt")
    else:
        fst.save_file(sd, tmp_path / "c.safetensors")
        got = fst.load_file(tmp_path / "c.safetensors")
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    start = got["big"].untyped_storage().data_ptr()
    # the advice covers the whole 2 MiB pages of the block: its first one holds the data's start
    assert "hg" in _vma_flags(start).split(), _vma_flags(start)


def test_the_knob_at_0_asks_for_small_pages(tmp_path, monkeypatch):
    """(Memory that glibc hands out again may still carry an earlier block's advice: the
    allocation's argument is what is checked.)"""
    asked = []
    real = reader._C.empty_aligned

    def empty_aligned(n, alignment=4096, phase=0, huge=False):
        asked.append(huge)
        return real(n, alignment, phase, huge)

    sd = _state()
    fastckpt.save(sd, tmp_path / "c.pt")
    monkeypatch.setattr(reader._C, "empty_aligned", empty_aligned)
    for value in (0, 1):
        with knobs.override(load_huge_pages=value):
            got = fastckpt.load(tmp_path / "c.pt")
        assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert asked == [False, True]
