"""The one snapshot component (fastckpt/staging/snapshot.py) that async_save
and FastWriter.stage take their copies with: one arena per snapshot, reused;
a release is once only; device copies follow the staging discipline (checked
by the simulated device, whose copies land late and out of order)."""


import pytest
import torch

from fastckpt import _C, knobs
from fastckpt.staging.snapshot import ARENA_ROUND, Snapshotter

from sim_device import SimDevice


def _sources(g):
    big = torch.randn(300, 70, generator=g)
    return [big, big.t(), torch.arange(7, dtype=torch.int16), torch.empty(0, 3),
            torch.tensor(True), torch.randn(5, generator=g).untyped_storage()]


def _same(a, b):
    if isinstance(a, torch.UntypedStorage):
        return bytes(a) == bytes(b)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_copies_are_exact_and_independent_of_the_sources():
    g = torch.Generator().manual_seed(0)
    src = _sources(g)
    want = [s.clone() for s in src]
    snap = Snapshotter().take(src)
    src[0].add_(1)  # after take(): not in the snapshot
    assert all(_same(v, w) for v, w in zip(snap.views, want))
    assert snap.nbytes == sum(s.nbytes() if isinstance(s, torch.UntypedStorage) else s.nbytes for s in want)
    assert snap.arena.buf.data_ptr() % 4096 == 0 and snap.arena.capacity == ARENA_ROUND


def test_large_sources_start_on_a_page_of_the_arena_and_small_ones_on_a_cache_line():
    """Sources of DIRECT_MIN bytes or more start on a 4 KiB page of the arena (the phase of their
    records in a fastckpt file, so that the writer sends them to the disk straight from it), the
    others on 64 bytes; copies never overlap and the arena holds them all."""
    from fastckpt.formats.zip import DIRECT_MIN
    sizes = [3, DIRECT_MIN - 8, DIRECT_MIN, 100, 1 << 20, 5000, DIRECT_MIN + 1, 0, 64]
    src = [torch.full((n,), i + 1, dtype=torch.uint8) for i, n in enumerate(sizes)]
    snap = Snapshotter().take(src)
    base = snap.arena.buf.data_ptr()
    spans = []
    for n, v in zip(sizes, snap.views):
        if n == 0:
            continue
        at = v.data_ptr() - base
        assert at % (4096 if n >= DIRECT_MIN else 64) == 0, (n, at)
        spans.append((at, at + n))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] <= snap.arena.capacity
    assert all(torch.equal(v, s) for v, s in zip(snap.views, src))
    snap.release()


def test_each_host_copy_comes_with_its_crc32_taken_in_the_same_pass():
    """Snapshot.crcs: for every host source whose bytes are contiguous (tensors and storages, any
    dtype), the zip CRC-32 of its copy, taken while copying; 0 for empty ones; None for a
    non-contiguous source (copied by torch's copy); deferred sources get theirs in complete()."""
    import zlib
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 70, generator=g)
    src = [big, big.t(), torch.arange(7, dtype=torch.int16), torch.empty(0, 3), torch.tensor(True),
           torch.randn(5, generator=g).untyped_storage(), torch.randn(1 << 20, generator=g).half()]
    snap = Snapshotter().take(src)
    want = [zlib.crc32(bytes(v)) if isinstance(v, torch.UntypedStorage) else zlib.crc32(v.numpy().tobytes())
            for v in snap.views]
    assert snap.crcs == [want[0], None, want[2], 0, want[4], want[5], want[6]]
    snap.release()
    later = Snapshotter().take(src, defer_over=1 << 10)  # the two large ones left for complete()
    assert later.crcs[0] is None and later.crcs[6] is None and later.crcs[2] == want[2]
    later.complete()
    assert later.crcs == snap.crcs
    later.release()


def test_the_crc_of_a_whole_view_is_found_from_the_view_and_no_other_tensor():
    """Snapshot.crc_of (what FastWriter writes staged tensors with): the view itself, or the same
    bytes seen as another dtype, gives its copy's CRC; a part of a view, a strided view, a tensor
    outside the snapshot, a view whose copy is deferred (until complete()) or a strided source's
    copy give None."""
    import zlib
    g = torch.Generator().manual_seed(4)
    big = torch.randn(1 << 16, generator=g)
    src = [big, torch.randn(40, 30, generator=g).t(), torch.arange(9)]
    snap = Snapshotter().take(src, defer_over=1 << 12)
    v0, v1, v2 = snap.views
    assert snap.crc_of(v0) is None  # deferred: not copied yet
    snap.complete()
    assert snap.crc_of(v0) == zlib.crc32(big.numpy().tobytes()) == snap.crc_of(v0.view(torch.uint8))
    assert snap.crc_of(v2) == zlib.crc32(torch.arange(9).numpy().tobytes())
    assert snap.crc_of(v0[1:]) is None and snap.crc_of(v0[:-1]) is None and snap.crc_of(v0[::2]) is None
    assert snap.crc_of(v1) is None  # its source was strided: copied by torch, no CRC taken
    assert snap.crc_of(big) is None and snap.crc_of(torch.arange(9)) is None
    snap.release()


def test_arenas_are_reused_and_a_release_is_once_only():
    st = Snapshotter()
    src = _sources(torch.Generator().manual_seed(1))
    a = st.take(src)
    arena = a.arena
    assert st.owner_of(a.views[2]) is a and st.owner_of(torch.ones(3)) is None
    assert a.release() and not a.release()  # the second release of the same snapshot is a no-op
    b = st.take(src)
    assert b.arena is arena and st.allocations == 1
    assert not a.release() and b.arena is arena  # a late release of the old one leaves the newer alone
    c = st.take(src)  # b still holds its arena: c gets another
    assert c.arena is not arena and st.allocations == 2
    b.release(keep=None)
    c.release(keep=None)
    assert st.free_bytes == 2 * ARENA_ROUND
    st.clear()
    assert st.free_bytes == 0


def test_a_grown_state_gets_a_larger_arena_and_the_small_one_goes():
    st = Snapshotter()
    st.take([torch.zeros(1000)]).release()
    st.take([torch.zeros(ARENA_ROUND)]).release()  # 4 MiB: does not fit the first arena
    assert st.allocations == 2 and st.free_bytes == 4 * ARENA_ROUND


@pytest.mark.parametrize("spontaneous", [True, False])
def test_device_sources_through_the_simulated_device(spontaneous):
    g = torch.Generator().manual_seed(2)
    src = _sources(g)
    with SimDevice(seed=2, spontaneous=spontaneous) as sim:
        dev = [sim.tensor(s, 0) if isinstance(s, torch.Tensor) else s for s in src[:-1]]
        dev.append(sim.tensor(torch.empty(0, dtype=torch.uint8).set_(src[-1]), 1).untyped_storage())
        st = Snapshotter()
        snap = st.take(dev)
        assert sim.violations == []
        assert all(_same(v, w) for v, w in zip(snap.views, src))
        assert snap.arena.pinned and sim.locked_bytes == snap.arena.capacity  # page-locked once
        snap.release()
        again = st.take(dev)
        assert again.arena is not None and st.allocations == 1 and sim.locked_bytes == again.arena.capacity
        again.release()
        st.clear()
    assert sim.violations == []


def _vm_flags(addr):
    """The VmFlags of the mapping of this process that holds `addr` (/proc/self/smaps)."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    return flags


def test_a_large_arena_is_on_transparent_huge_pages():
    """An arena of HUGE_JUDGE_MIN (32 MiB) or more starts on a 2 MiB boundary and is advised
    MADV_HUGEPAGE ("hg"): the engine's O_DIRECT writes from it then carry 2 MiB segments (one per
    4 KiB page otherwise: a virtio disk's 254 segments a request cut each 8 MiB write into 1 MiB
    requests, and a 1.5 GB write from the arena took 1.3 s against 1.0 s). A smaller one stays on
    small pages (the next test: its first touch would pay for whole huge pages to save a few ms)."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are disabled on this machine")
    snap = Snapshotter().take([torch.ones(_C.HUGE_JUDGE_MIN, dtype=torch.uint8)])
    ptr = snap.arena.buf.data_ptr()
    assert ptr % (2 << 20) == 0
    assert "hg" in _vm_flags(ptr)
    snap.release()



def test_the_huge_pages_knob_reaches_the_arena(monkeypatch):
    """snapshot_huge_pages=0 allocates arenas on small pages, and 1 (the default) those of
    HUGE_JUDGE_MIN bytes or more on huge pages (memory that glibc reuses may still
    carry an earlier block's advice, so the allocation's argument is what is checked)."""
    import fastckpt.staging.snapshot as snapshot
    asked = []
    real = snapshot._C.empty_aligned

    def empty_aligned(n, alignment=4096, phase=0, huge=False):
        asked.append(huge)
        return real(n, alignment, phase, huge)

    monkeypatch.setattr(snapshot._C, "empty_aligned", empty_aligned)
    for value in (0, 1):
        with knobs.override(snapshot_huge_pages=value):
            Snapshotter().take([torch.ones(_C.HUGE_JUDGE_MIN, dtype=torch.uint8)]).release()
            Snapshotter().take([torch.ones(3 << 20, dtype=torch.uint8)]).release()
    assert asked == [False, False, True, False]
