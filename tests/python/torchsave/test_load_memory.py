"""The memory a load returns (fastckpt.torchsave.reader.host_storage): storages of 2 MiB or more
on transparent huge pages (MADV_HUGEPAGE) with the knob load_huge_pages at 1, on small pages at 0,
and at 2 (the default) as the process's measurement of first-touch speed decides (_C.huge_pages_pay);
the tensors are the file's, bitwise, either way. The block that the storages read from one stretch of a file share
(host_block, fastckpt.safetensors' loads): a storage of each tensor's own, whose pages go back to
the kernel when it dies, the block unmapped with the last."""
import io
import sys

import pytest
import torch

import fastckpt
from fastckpt import knobs
import fastckpt.safetensors as fst
import fastckpt.torchsave.reader as reader
from crafted import status_bytes

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
    with knobs.override(load_huge_pages=1):
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


@pytest.fixture
def verdict():
    """The process's huge-page verdict, forgotten before and after the test."""
    fastckpt._C.reset_huge_pages_verdict()
    yield fastckpt._C
    fastckpt._C.reset_huge_pages_verdict()


def _asking(monkeypatch):
    """Records what each allocation of a load's memory asked for: ("own" or "block", huge)."""
    asked = []
    real_aligned, real_arena = reader._C.empty_aligned, reader._C.empty_arena

    def empty_aligned(n, alignment=4096, phase=0, huge=False):
        asked.append(("own", huge))
        return real_aligned(n, alignment, phase, huge)

    def empty_arena(n, phase, spans, huge=True):
        asked.append(("block", huge))
        return real_arena(n, phase, spans, huge)

    monkeypatch.setattr(reader._C, "empty_aligned", empty_aligned)
    monkeypatch.setattr(reader._C, "empty_arena", empty_arena)
    return asked


def _saved(tmp_path, fmt, sd):
    path = tmp_path / "c"
    fastckpt.save(sd, path) if fmt == "torch" else fst.save_file(sd, path)
    return {"torch": lambda: fastckpt.load(path), "safetensors": lambda: fst.load_file(path),
            "safetensors bytes": lambda: fst.load(path.read_bytes())}[fmt]


FORMATS = ["torch", "safetensors", "safetensors bytes"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_knob_at_0_or_1_asks_for_small_or_huge_pages_whatever_was_found(tmp_path, monkeypatch, verdict, fmt):
    """(Memory that glibc hands out again may still carry an earlier block's advice: the
    allocation's argument is what is checked, of both kinds: a storage's own memory and the
    block that storages close together in the file share.)"""
    sd = _state()
    load = _saved(tmp_path, fmt, sd)
    asked = _asking(monkeypatch)
    for slow in (True, False):  # either verdict: the knob decides
        verdict.reset_huge_pages_verdict()
        if slow:
            verdict.note_slow_huge_pages(16 * MIB, 0.1)
        for value in (0, 1):
            asked.clear()
            with knobs.override(load_huge_pages=value):
                got = load()
            assert all(torch.equal(got[k], sd[k]) for k in sd)
            assert asked and all(huge == bool(value) for _, huge in asked), (value, asked)


def _large_state():
    """A state of the size from which the default puts a load on huge pages (a read judges them)."""
    g = torch.Generator().manual_seed(6)
    n = fastckpt._C.HUGE_JUDGE_MIN // 4
    return {"big": torch.randn(n // 2 + 3, generator=g), "rest": torch.randn(n // 2, generator=g),
            "small": torch.randn(100, generator=g)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_default_asks_for_huge_pages_until_a_read_found_them_slow(tmp_path, monkeypatch, verdict, fmt):
    """Every storage of one load alike."""
    assert knobs.get("load_huge_pages") == 2
    sd = _large_state()
    load = _saved(tmp_path, fmt, sd)
    asked = _asking(monkeypatch)
    for slow in (False, True):
        if slow:
            verdict.note_slow_huge_pages(16 * MIB, 0.1)
        asked.clear()
        got = load()
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        assert asked and all(huge == (not slow) for _, huge in asked), (slow, asked)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_default_puts_a_load_too_small_to_judge_on_small_pages(tmp_path, monkeypatch, verdict, fmt):
    """Under HUGE_JUDGE_MIN bytes no read judges the huge pages, and one of them can fault in slower
    than the whole load takes on small pages: the default asks for small pages, with no verdict
    against huge ones; the knob at 1 still asks for huge pages."""
    sd = _state()  # 5 MiB
    assert sum(v.nbytes for v in sd.values()) < fastckpt._C.HUGE_JUDGE_MIN
    load = _saved(tmp_path, fmt, sd)
    asked = _asking(monkeypatch)
    assert verdict.huge_pages_pay(1 << 40) and not verdict.huge_pages_pay(fastckpt._C.HUGE_JUDGE_MIN - 1)
    for value in (2, 1):
        asked.clear()
        with knobs.override(load_huge_pages=value):
            got = load()
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        assert asked and all(huge == (value == 1) for _, huge in asked), (value, asked)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
@pytest.mark.parametrize("knob", [2, 1])
def test_a_load_that_finds_huge_pages_slow_reads_on_and_the_next_load_asks_for_small_ones(
        tmp_path, monkeypatch, verdict, fmt, knob):
    """With the default knob, the read into a load's fresh storages judges the huge pages it
    faults in (FASTCKPT_TEST_SLOW_HUGE_BPS=1e18: every window slow): the load returns the
    file's bytes, the verdict is recorded and the next load asks for small pages. At 1 the
    pages stay huge and nothing is judged."""
    monkeypatch.setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "1e18")
    # 160 MiB: past the first queue_depth reads (8 x 8 MiB), the helper faults in several windows
    sd = {f"w{i}": torch.full((8 * MIB // 4,), float(i)) for i in range(20)}
    load = _saved(tmp_path, fmt, sd)
    with knobs.override(load_huge_pages=knob):
        got = load()
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        assert verdict.huge_pages_verdict()["slow_seen"] == (knob == 2)
        asked = _asking(monkeypatch)
        load()
    assert asked and all(huge == (knob == 1) for _, huge in asked), (knob, asked)


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and maps")
def test_a_blocks_storages_give_their_pages_back_and_the_block_goes_with_the_last():
    spans = [(0, 40 * MIB + 5, 1), (40 * MIB + 5, 40 * MIB + 5, 4), (40 * MIB + 8, 64 * MIB, 4)]
    whole, parts = reader.host_block(64 * MIB, 12345, spans)
    addr = whole.data_ptr()
    assert addr % 4096 == 12345 % 4096 and whole.nbytes == 64 * MIB
    assert [p.untyped_storage().nbytes() for p in parts] == [40 * MIB + 5, 0, 24 * MIB - 8]
    assert [p.data_ptr() - addr for p in (parts[0], parts[2])] == [0, 40 * MIB + 8]
    whole.fill_(3)
    del whole
    big, empty, rest = parts
    del parts
    before = status_bytes("VmRSS")
    del big  # its whole pages go back; the block stays for `rest`
    assert status_bytes("VmRSS") < before - 38 * MIB
    assert _mapped(addr) and int(rest.sum()) == 3 * rest.numel()
    del rest  # the last storage over the block: unmapped; an empty tensor holds no part of it
    assert not _mapped(addr) and empty.numel() == 0


def test_a_blocks_storage_is_its_own_size_and_not_resizable():
    whole, (a, b) = reader.host_block(3 * 4096, 0, [(0, 4096, 4), (4096, 3 * 4096, 8)])
    whole.copy_(torch.arange(3 * 4096, dtype=torch.int64).to(torch.uint8))
    del whole
    buf = io.BytesIO()
    torch.save(a.view(torch.float32), buf)  # one storage of the block: its own bytes only
    assert buf.tell() < 2 * 4096
    back = torch.load(io.BytesIO(buf.getvalue()))
    assert torch.equal(back.view(torch.uint8), a)
    with pytest.raises(RuntimeError):
        b.untyped_storage().resize_(1 << 20)
    before = b.clone()
    b.share_memory_()  # moved into shared memory (torch swaps the storage's memory, ours given back)
    assert b.is_shared() and torch.equal(b, before)


@pytest.mark.parametrize("spans", [[(0, 10, 1), (5, 20, 1)], [(10, 20, 1), (0, 5, 1)], [(0, 4097, 1)],
                                   [(3, 2, 1)]])
def test_a_block_refuses_spans_out_of_order_overlapping_or_outside(spans):
    with pytest.raises(ValueError, match="spans"):
        reader.host_block(4096, 0, spans)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_block_is_on_huge_pages_unless_the_knob_says_not(tmp_path, verdict):
    verdict.note_slow_huge_pages(16 * MIB, 0.1)  # the knob at 1 wins over a verdict against huge pages
    for value in (1, 0):
        with knobs.override(load_huge_pages=value):
            whole, _ = reader.host_block(6 * MIB, 0, [])
        assert ("hg" in _vma_flags(whole.data_ptr()).split()) == bool(value)
        del whole


def test_records_close_together_share_a_block_the_others_get_their_own():
    far_off = 4096 + 5160 + 64 * 1024 + 8  # too far from the record before it
    recs = [(100, 4096), (5000, 4096 + 100 + 60), (0, 20000), (300, far_off),
            (64, 200000 + 3), (4096, 300000), (8, 300000 + 4096 + 8)]
    recs = [(n, off, off) for n, off in recs]
    runs, holes = reader.block_runs(recs)
    blocks = []
    got = reader.host_storages(recs, runs, blocks)
    assert [t.untyped_storage().nbytes() for t in got] == [n for n, _, _ in recs]
    a, b, empty, far, odd, c, d = got
    assert b.data_ptr() - a.data_ptr() == 160 and d.data_ptr() - c.data_ptr() == 4104  # laid out as the file
    assert far.data_ptr() - a.data_ptr() != far_off - 4096  # memory of its own
    assert odd.data_ptr() % 8 == 0  # a record that misaligns its elements: memory of its own
    assert holes == 60 + 8
    assert [(start, run) for start, _, run in blocks] == [(4096, [0, 1]), (300000, [5, 6])]


def test_a_block_starts_at_the_first_records_header_when_headers_are_read_with_the_data():
    """(size, data offset, start): a record whose local header is read with its data starts its
    stretch at the header; the block holds the header before the data, and the gap to the next
    record's header counts from the last record's end."""
    recs = [(100, 4096, 4000), (5000, 4096 + 100 + 60, 4096 + 100 + 16), (300, 4096 + 5160 + 70_000, 4096 + 5160 + 69_000)]
    runs, holes = reader.block_runs(recs)
    assert runs == [[0, 1], [2]]
    assert holes == 96 + 60
    blocks = []
    a, b, far = reader.host_storages(recs, runs, blocks)
    (start, whole, run), = blocks
    assert start == 4000 and run == [0, 1] and whole.numel() == 4096 + 5160 - 4000
    assert a.data_ptr() - whole.data_ptr() == 96 and b.data_ptr() - a.data_ptr() == 160


def test_a_load_of_many_small_storages_reads_them_in_few_requests_into_one_block(tmp_path, monkeypatch):
    from engines import drop_page_cache, record_reads
    g = torch.Generator().manual_seed(2)
    sd = {f"p{i}": torch.randn(100 + 37 * i, generator=g) for i in range(200)}
    sd["big"] = torch.randn(3 * MIB // 4, generator=g)
    fastckpt.save(sd, tmp_path / "many.pt")
    drop_page_cache(tmp_path / "many.pt")
    calls = record_reads(monkeypatch)
    for verify in (True, False):
        got = fastckpt.load(tmp_path / "many.pt", verify=verify)
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        ptrs = sorted(got[k].data_ptr() for k in sd)
        assert ptrs[-1] - ptrs[0] < (tmp_path / "many.pt").stat().st_size  # one block, as the file
    reads = [c for c in calls if c["bytes"] > MIB]  # the storages' (not the parse's header checks)
    assert len(reads) == 2, reads
    if reads[0]["direct"]:  # 6 MiB in 8 MiB requests, the records' headers read through
        assert all(c["requests"] <= 4 and c["vectored_requests"] >= 1 for c in reads), reads


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_a_load_that_fails_mid_read_names_the_file_and_leaves_no_block(tmp_path, monkeypatch, fmt):
    import errno
    import gc
    from engines import drop_page_cache
    from fastckpt import _C
    g = torch.Generator().manual_seed(8)
    sd = {f"t{i}": torch.randn(3000 + 500 * i, generator=g) for i in range(40)}
    path = tmp_path / ("c.pt" if fmt == "torch" else "c.safetensors")
    (fastckpt.save if fmt == "torch" else fst.save_file)(sd, path)
    blocks = []
    real = reader._C.empty_arena

    def empty_arena(*args, **kwargs):  # the reads into the block fail (the second of them)
        whole, parts = real(*args, **kwargs)
        blocks.append(whole.data_ptr())
        _C.fault_inject("read", nth=2, errno=errno.EIO)
        return whole, parts
    monkeypatch.setattr(reader._C, "empty_arena", empty_arena)
    load = fastckpt.load if fmt == "torch" else fst.load_file
    with fastckpt.knobs.override(buffer_size=64 << 10, buffer_count=4):
        drop_page_cache(path)
        try:
            with pytest.raises(OSError) as ei:
                load(path)
        finally:
            _C.fault_clear()
    assert ei.value.errno == errno.EIO and str(path) in str(ei.value)
    del ei
    gc.collect()
    assert blocks and not any(_mapped(b) for b in blocks)
