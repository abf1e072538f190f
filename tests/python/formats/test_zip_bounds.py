"""Bounded memory on any archive (docs/FORMAT.md 1.5).

A reader that trusts the central directory allocates what it claims: records
that overlap (many entries over one blob) made a 2 MiB file allocate hundreds
of MiB. fastckpt.load refuses records that are out of order, overlap, or run
past the file or into the central directory, before allocating anything; reads
only the storages data.pkl refers to; and never allocates more than the file's
size in all (a check that stays on, tested here with the layout check off).
Peak memory is measured in a separate process per load (crafted.MemoryProbe).
"""
import pickle
import struct
import zipfile

import pytest
import torch

import fastckpt
from fastckpt import _C
from fastckpt.formats import zip as _zip
from fastckpt import serialization as ser

import crafted

BLOB = 2 << 20  # the reported case: 150 records over one 2 MiB blob
N_OVERLAP = 150


class _NoProbe:
    """Where a process cannot reset its peak RSS: the checks that need no
    measurement have run when a test gets here, then it skips with the reason."""

    def __init__(self, why: str):
        self.why = why

    def load(self, *a, **k):
        pytest.skip(self.why)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    why = crafted.hwm_resettable()
    if why:
        yield _NoProbe(why)
        return
    warm = tmp_path_factory.mktemp("probe") / "warm.pt"
    fastckpt.save({"w": torch.ones(1000), "n": {"a": [1, 2]}}, warm)
    p = crafted.MemoryProbe(str(warm))
    yield p
    p.close()


def _write(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_the_crafted_builder_makes_loadable_archives(tmp_path):
    """Control: the byte-by-byte builder's well-formed archive loads with torch
    and fastckpt (so the refusals below are about the hostile layout)."""
    path = _write(tmp_path, "ok.pt", crafted.stock_archive([bytes(range(200)), b"\x07" * 5000]))
    ours, theirs = fastckpt.load(path, verify=True), torch.load(path, weights_only=True)
    assert ours.keys() == theirs.keys() == {"t0", "t1"}
    assert torch.equal(ours["t0"], torch.arange(200, dtype=torch.uint8)) and torch.equal(ours["t1"], theirs["t1"])


@pytest.mark.parametrize("local_extra", [True, False], ids=["extra-field-over-headers", "data-over-headers"])
def test_overlapping_records_are_refused_in_bounded_memory(tmp_path, probe, local_extra):
    data = crafted.overlapping_archive(N_OVERLAP, BLOB, local_extra=local_extra)
    path = _write(tmp_path, "overlap.pt", data)
    with pytest.raises(fastckpt.FormatError) as ei:
        fastckpt.load(path)
    msg = str(ei.value)
    assert str(path) in msg and "overlap" in msg, msg
    growth, error = probe.load(path, verify=False)
    assert error is None, error
    assert 0 <= growth <= 2 * len(data), f"peak RSS grew by {growth >> 20} MiB loading a {len(data) >> 20} MiB file"


@pytest.mark.parametrize("how", ["open_file", "bytesio", "mmap"])
def test_overlapping_records_are_refused_for_loads_torch_does(tmp_path, probe, how):
    """File objects and mmap=True are read by torch.load, whose reader allocates
    every record: fastckpt.load checks the layout first."""
    import io
    data = crafted.overlapping_archive(N_OVERLAP, BLOB)
    path = _write(tmp_path, "overlap.pt", data)
    with pytest.raises(fastckpt.FormatError, match="overlap") as ei:
        if how == "mmap":
            fastckpt.load(path, mmap=True)
        elif how == "bytesio":
            fastckpt.load(io.BytesIO(data))
        else:
            with open(path, "rb") as f:
                fastckpt.load(f)
    assert (str(path) if how != "bytesio" else "<BytesIO object>") in str(ei.value)
    if how == "open_file":
        growth, error = probe.load(path, verify=False, as_file=True)
        assert error is None, error
        assert 0 <= growth <= 2 * len(data), f"peak RSS grew by {growth >> 20} MiB"
    good = crafted.stock_archive([b"\x03" * 100])  # and the check lets good files through
    buf = io.BytesIO(good)
    assert torch.equal(fastckpt.load(buf)["t0"], torch.full((100,), 3, dtype=torch.uint8))


def test_file_object_check_reads_the_stream_not_its_descriptor(tmp_path):
    """A gzip.GzipFile's fileno() is the compressed file's: the layout check
    reads the stream itself, as torch.load does, and the load works."""
    import gzip
    sd = {"w": torch.arange(10.0)}
    with gzip.open(tmp_path / "a.pt.gz", "wb") as g:
        torch.save(sd, g)
    with gzip.open(tmp_path / "a.pt.gz", "rb") as g:
        assert torch.equal(fastckpt.load(g)["w"], sd["w"])
    with gzip.open(tmp_path / "b.pt.gz", "wb") as g:
        g.write(crafted.overlapping_archive(4, 4096))
    with gzip.open(tmp_path / "b.pt.gz", "rb") as g, pytest.raises(fastckpt.FormatError, match="overlap"):
        fastckpt.load(g)


def test_overlap_seen_only_in_local_headers_is_refused(tmp_path):
    """The central directory looks right; data/0's local header declares an
    extra field that moves its data onto data/1's."""
    data = bytearray(crafted.stock_archive([b"\x01" * 4096, b"\x02" * 4096]))
    layout = {i.filename.split("/", 1)[1]: i for i in zipfile.ZipFile(_write(tmp_path, "t.pt", bytes(data))).infolist()}
    h0, h1 = layout["data/0"].header_offset, layout["data/1"].header_offset
    name_len, extra_len = struct.unpack_from("<HH", data, h0 + 26)
    d1 = h1 + 30 + sum(struct.unpack_from("<HH", data, h1 + 26))
    struct.pack_into("<H", data, h0 + 28, d1 - (h0 + 30 + name_len))  # data/0's data := data/1's
    path = _write(tmp_path, "pushed.pt", bytes(data))
    with pytest.raises(fastckpt.FormatError, match="overlap") as ei:
        fastckpt.load(path)
    assert str(path) in str(ei.value)


def test_records_out_of_order_are_refused(tmp_path):
    path = _write(tmp_path, "order.pt", crafted.out_of_order_archive([b"\x01" * 100, b"\x02" * 300]))
    with zipfile.ZipFile(path) as z:  # a readable zip archive otherwise
        assert z.testzip() is None
    with pytest.raises(fastckpt.FormatError, match="out of order|overlap") as ei:
        fastckpt.load(path)
    assert str(path) in str(ei.value)


@pytest.mark.parametrize("case", ["count_1e9_zip64", "count_65534", "size_1TiB_storage", "size_4GiB_pickle",
                                  "size_file_storage"])
def test_declared_sizes_and_counts_beyond_the_file_are_refused(tmp_path, probe, case):
    if case == "count_1e9_zip64":
        data = crafted.huge_count_archive(10 ** 9)
    elif case == "count_65534":
        data = crafted.huge_count_archive(0xFFFE, zip64=False)
    elif case == "size_1TiB_storage":
        data = crafted.huge_size_archive(1 << 40)
    elif case == "size_4GiB_pickle":
        data = crafted.huge_size_archive(1 << 32, which=0)
    else:  # as big as the whole file: only the layout says it cannot be
        data = crafted.huge_size_archive(len(crafted.huge_size_archive(1 << 20)))
    path = _write(tmp_path, "huge.pt", data)
    with pytest.raises(fastckpt.FormatError) as ei:
        fastckpt.load(path)
    assert str(path) in str(ei.value)
    growth, error = probe.load(path, verify=True)
    assert error is None, error
    assert 0 <= growth <= crafted.memory_bound(len(data), crafted.pickle_size(data)), growth


def test_many_records_cost_a_small_multiple_of_the_file(tmp_path, probe):
    """50,000 empty records, packed as tightly as the layout allows: the
    directory's Python objects stay within the fuzzers' memory bound."""
    b = crafted.Builder()
    b.standard(crafted.tensor_pickle([]))
    for i in range(50_000):
        b.record(f"x{i}", b"", align=1)
    b.tail()
    data = b.finish()
    path = _write(tmp_path, "many.pt", data)
    assert fastckpt.load(path) == {}
    growth, error = probe.load(path, verify=True)
    assert error is None, error
    assert 0 <= growth <= crafted.memory_bound(len(data), crafted.pickle_size(data)), (growth, len(data))


def test_real_checkpoints_stay_within_the_memory_bound(tmp_path, probe):
    """Control for the fuzzers' oracle: a checkpoint of 5,000 small tensors (a
    large pickle) and one of a 16 MiB tensor load within crafted.memory_bound,
    and the probe sees the data read (most of its 16 MiB)."""
    fastckpt.save({f"layer{i}.w": torch.full((8,), float(i)) for i in range(5000)}, tmp_path / "many.pt")
    fastckpt.save({"big": torch.ones(4 << 20)}, tmp_path / "big.pt")
    for name in ("many.pt", "big.pt"):
        data = (tmp_path / name).read_bytes()
        growth, error = probe.load(tmp_path / name, verify=True)
        assert error is None, error
        assert growth <= crafted.memory_bound(len(data), crafted.pickle_size(data)), (name, growth)
        if name == "big.pt":
            assert growth >= 12 << 20, f"the probe saw {growth} bytes for a 16 MiB tensor: it measures nothing"


def test_unreferenced_records_are_not_read(tmp_path, monkeypatch):
    """data/1 (4 MiB) is in the archive but no tensor uses it: load reads
    data.pkl, the small records and data/0, never data/1."""
    data, unused = crafted.unreferenced_archive(4096, 4 << 20)
    path = _write(tmp_path, "unref.pt", data)
    arch = _zip.Archive.open(str(path))
    span = (arch.records[unused].data_offset, arch.records[unused].data_offset + arch.records[unused].size)
    reads = []
    real = _C.read_ranges

    def counting(engine, p, ranges, *rest, **kw):
        for buf, off, *_ in list(ranges) + list(kw.get("fill", ())):  # (destination, offset[, crc])
            n = buf.numel() if isinstance(buf, torch.Tensor) else len(buf)
            reads.append((off, off + n))
        return real(engine, p, ranges, *rest, **kw)

    monkeypatch.setattr(_C, "read_ranges", counting)
    out = fastckpt.load(path, verify=True)
    assert list(out) == ["t0"] and torch.equal(out["t0"], torch.zeros(4096, dtype=torch.uint8))
    assert reads, "the counting hook saw no read: it does not measure anything"
    touched = [r for r in reads if r[0] < span[1] and span[0] < r[1]]
    assert not touched, f"unreferenced record {unused} ({span}) was read: {touched}"
    assert sum(b - a for a, b in reads) < 64 << 10


def test_unreferenced_records_cost_no_memory(tmp_path, probe):
    data, _ = crafted.unreferenced_archive(4096, 32 << 20)
    path = _write(tmp_path, "unref.pt", data)
    growth, error = probe.load(path, verify=True)
    assert error is None, error
    assert 0 <= growth < 16 << 20, f"peak RSS grew by {growth >> 20} MiB: the unreferenced 32 MiB were read"


def test_allocation_bound_holds_without_the_layout_check(tmp_path, monkeypatch):
    """The total allocated is checked against the file's size where records are
    read, also if the parser's layout check were broken."""
    data = crafted.overlapping_archive(N_OVERLAP, BLOB)
    path = _write(tmp_path, "overlap.pt", data)
    monkeypatch.setattr(_zip, "check_layout", lambda entries, cd_off, bad: 0)
    allocated = []
    real = torch.empty
    monkeypatch.setattr(fastckpt.torchsave.reader.torch, "empty", lambda *a, **k: allocated.append(a) or real(*a, **k))
    with pytest.raises(fastckpt.FormatError, match=r"would allocate \d+ bytes for a \d+-byte file") as ei:
        fastckpt.load(path)
    assert str(path) in str(ei.value)
    assert not allocated, "storages were allocated before the bound was checked"


class _Key:
    """A storage key the pickle builds with a call (str(0)) instead of writing
    it as a string: load cannot see it up front and reads the record on demand."""

    def __reduce__(self):
        return (str, (0,))


def _computed_key_archive(payload: bytes) -> bytes:
    import io
    import collections

    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, crafted._StorageRef):
                return ("storage", torch.ByteStorage, _Key(), "cpu", o.nbytes)
            return None

    buf = io.BytesIO()
    t = crafted._TensorRef("unused", len(payload))
    P(buf, protocol=2).dump({"t": t, "od": collections.OrderedDict()})
    pkl = buf.getvalue()
    assert b"X\x01\x00\x00\x000" not in pkl
    b = crafted.Builder()
    b.standard(pkl, [payload])
    b.tail()
    return b.finish()


def test_storage_named_without_a_literal_is_read_on_demand(tmp_path):
    payload = bytes(range(256)) * 8
    path = _write(tmp_path, "late.pt", _computed_key_archive(payload))
    out = fastckpt.load(path, weights_only=False, verify=True)
    assert torch.equal(out["t"], torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert torch.equal(out["t"], torch.load(path, weights_only=False)["t"])


def test_storage_read_on_demand_is_checked_and_from_the_same_file(tmp_path, monkeypatch):
    payload = bytes(range(256)) * 8
    data = bytearray(_computed_key_archive(payload))
    path = _write(tmp_path, "late.pt", bytes(data))
    off = _zip.Archive.open(str(path)).records["data/0"].data_offset
    data[off + 5] ^= 0xFF
    bad = _write(tmp_path, "late_bad.pt", bytes(data))
    with pytest.raises(fastckpt.FormatError, match="checksum mismatch"):
        fastckpt.load(bad, weights_only=False, verify=True)
    with pytest.raises(fastckpt.FormatError, match="checksum mismatch"):  # verified by default too
        fastckpt.load(bad, weights_only=False)
    assert fastckpt.load(bad, weights_only=False, verify=False)["t"][5] == (5 ^ 0xFF)  # as stored

    real = fastckpt.torchsave.reader.read_archive

    def then_replace(p, fh, verify, behind=None):  # another save renames a new file over it mid-load
        out = real(p, fh, verify, behind)
        fastckpt.save({"t": torch.zeros(3)}, p)
        return out

    monkeypatch.setattr(fastckpt.torchsave.load, "read_archive", then_replace)
    with pytest.raises(fastckpt.FormatError, match="replaced or changed") as ei:
        fastckpt.load(path, weights_only=False)
    assert str(path) in str(ei.value)


def test_deeply_nested_object_with_a_bad_checksum_names_the_record(tmp_path):
    """verify=True on a damaged storage names the tensors holding it by walking
    the loaded object: a loop, not recursion, for an object 990 levels deep (as
    deep as Python's default recursion limit lets pickle write; deeper pickles
    are refused before unpickling: test_hostile.py)."""
    inner = crafted.tensor_pickle([("0", 4096)])
    pkl = crafted.wrap_pickle(crafted.nested_pickle(990), inner)
    b = crafted.Builder()
    b.standard(pkl, [b"\x05" * 4096])
    b.tail()
    data = bytearray(b.finish())
    off = b.entries[4].data_offset
    data[off] ^= 1
    path = _write(tmp_path, "deep.pt", bytes(data))
    with pytest.raises(fastckpt.FormatError, match=r"checksum mismatch .*tensor \[0\](\[0\])*\.t0 \(record 'data/0'\)"):
        fastckpt.load(path, verify=True)


def test_torch_and_fastckpt_files_keep_loading(tmp_path):
    """Stock torch.save (64-byte alignment, the file's base name as top folder)
    and fastckpt files pass the layout checks."""
    sd = {"w": torch.randn(100, 10), "b": torch.zeros(3, dtype=torch.bfloat16), "e": torch.empty(0), "n": 7}
    sd["v"] = sd["w"][2:4]
    torch.save(sd, tmp_path / "stock.pt")
    fastckpt.save(sd, tmp_path / "ours.pt")
    for name in ("stock.pt", "ours.pt"):
        out = fastckpt.load(tmp_path / name, verify=True)
        assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in ("w", "b", "e", "v"))
        assert out["v"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
