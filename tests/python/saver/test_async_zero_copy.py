"""async_save writes the bodies of its snapshot's large storages O_DIRECT straight from the
snapshot arena (Writer::append_borrowed: no copy into the staging buffers, whose memcpy was half
of the writer thread's CPU time), where the file is written O_DIRECT, with the CRC-32 each copy
took while the snapshot was made (no second pass over the bytes in the writer); the file is the
one fastckpt.save writes, bitwise, with every CRC. A write that fails or comes back short while the
engine holds the arena's memory behaves as every failed save: the future's error names the path,
the previous file stays, no temporary file is left, and the next save, which reuses the arena,
is whole."""
import errno
import zipfile

import pytest
import torch

import fastckpt
from fastckpt import _C
from fastckpt.formats.zip import DIRECT_MIN
from fastckpt.saver import AsyncSaver

from engines import record_commits
from leaks import temp_files
from states import assert_same


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(1 << 18, generator=g),            # 1 MiB
            "b": torch.randn(3, 70001, generator=g),           # 820 KiB, not a multiple of a block
            "bias": torch.randn(10, generator=g),              # small: packed with the headers
            "half": torch.randn(40000, generator=g).half(),    # DIRECT_MIN + some, odd tail
            "step": 7}


def _big(sd):
    return sum(t.nbytes for t in sd.values() if isinstance(t, torch.Tensor) and t.nbytes >= DIRECT_MIN)


def _records(path):
    """Each record's name, offset, size and CRC-32 (the serialization id, random, left out)."""
    with zipfile.ZipFile(path) as z:
        return [(i.filename, i.header_offset, i.file_size, i.CRC) for i in z.infolist()
                if not i.filename.endswith("serialization_id")]


@pytest.mark.parametrize("background", [False, True])
def test_the_snapshot_is_written_from_the_arena_and_is_fastckpt_saves_file(tmp_path, monkeypatch, background):
    sd = _state()
    fastckpt.save(sd, tmp_path / "s.pt")
    stats = record_commits(monkeypatch)
    saver = AsyncSaver()
    try:
        saver.save(sd, tmp_path / "a.pt", background_staging=background).result()
        saver.save(_state(1), tmp_path / "b.pt", background_staging=background).result()  # the arena reused
    finally:
        saver.close()
    a, b = stats[-2], stats[-1]
    if not a["direct"]:
        pytest.skip(f"this filesystem takes no O_DIRECT writes ({a['fallback']}): every byte is copied")
    # All of every large storage but a head and a tail under a block each; nothing else.
    for st in (a, b):
        assert _big(sd) - 3 * 2 * 4096 <= st["borrowed_bytes"] <= _big(sd), st
    assert _records(tmp_path / "a.pt") == _records(tmp_path / "s.pt")  # the layout and every CRC
    assert_same(fastckpt.load(tmp_path / "a.pt", verify=True), sd, bitwise=True)
    assert_same(torch.load(tmp_path / "b.pt", weights_only=True), _state(1), bitwise=True)
    assert_same(fastckpt.load(tmp_path / "b.pt", verify=True), _state(1), bitwise=True)


def test_the_writer_takes_the_snapshots_crcs_and_reads_no_large_storage_again(tmp_path, monkeypatch):
    """The large storages reach the engine through write() (no CRC), the small ones are packed with
    the headers; the records' CRCs are those the snapshot took, which fastckpt.load verifies."""
    from fastckpt._core.atomic import AtomicFile
    crc_calls, writes = [], []
    real_crc, real_write = AtomicFile.write_crc, AtomicFile.write
    monkeypatch.setattr(AtomicFile, "write_crc", lambda self, t, crc, borrow=False: (
        crc_calls.append(t.nbytes), real_crc(self, t, crc, borrow))[1])
    monkeypatch.setattr(AtomicFile, "write", lambda self, b, borrow=False: (
        writes.append((getattr(b, "nbytes", None), borrow)), real_write(self, b, borrow))[1])
    sd = _state()
    with AsyncSaver() as saver:
        saver.save(sd, tmp_path / "a.pt").result()
    assert crc_calls == []
    assert sorted(n for n, borrow in writes if borrow) == sorted(
        t.nbytes for t in sd.values() if isinstance(t, torch.Tensor) and t.nbytes >= 64 << 10)
    assert_same(fastckpt.load(tmp_path / "a.pt", verify=True), sd, bitwise=True)
    fastckpt.save(sd, tmp_path / "s.pt")
    assert _records(tmp_path / "a.pt") == _records(tmp_path / "s.pt")


def test_a_synchronous_save_copies(tmp_path, monkeypatch):
    """fastckpt.save of the caller's tensors never lends them to the engine (their memory is the
    caller's, of any kind): every byte goes through the staging buffers."""
    stats = record_commits(monkeypatch)
    fastckpt.save(_state(), tmp_path / "s.pt")
    assert stats[-1]["borrowed_bytes"] == 0


@pytest.mark.parametrize("fault", ["eio", "short"])
def test_a_fault_while_the_engine_writes_from_the_arena(tmp_path, monkeypatch, fault):
    p = tmp_path / "ckpt.pt"
    fastckpt.save({"gen": 1}, p)
    stats = record_commits(monkeypatch)
    saver = AsyncSaver()
    try:
        # The second write of the save: the first is the staged headers before tensor "a"
        # (made synchronously: it tells whether O_DIRECT writes work), the second the first
        # body written from the arena.
        if fault == "eio":
            _C.fault_inject("write", nth=2, errno=errno.EIO, path_contains="ckpt.pt")
        else:
            _C.fault_inject("write", nth=1, short=4096, times=0, path_contains="ckpt.pt")  # every write short
        try:
            e = saver.save(_state(), p).exception()
            fired = _C.fault_fired()
        finally:
            _C.fault_clear()
        assert fired >= 1
        if fault == "eio":
            assert isinstance(e, OSError) and e.errno == errno.EIO and e.filename == str(p), e
            assert fastckpt.load(p) == {"gen": 1}
        else:
            assert e is None and stats[-1]["requeued"] > 0
            assert_same(fastckpt.load(p, verify=True), _state(), bitwise=True)
        assert temp_files(tmp_path) == []
        saver.save(_state(2), p).result()  # the same arena, at once
    finally:
        saver.close()
    assert_same(fastckpt.load(p, verify=True), _state(2), bitwise=True)
    assert stats[-1]["direct"] is False or stats[-1]["borrowed_bytes"] > 0
