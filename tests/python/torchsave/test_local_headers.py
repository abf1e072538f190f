"""A load reads each record's local header with its data (fastckpt.torchsave.reader.Records,
fastckpt.formats.zip.Archive.guess/settle): no batch of header reads before the storages, the same
checks of every header, and a file laid out otherwise than torch.save and fastckpt lay it out
(no data descriptors, gaps between records, a hostile header) still loads bitwise or is refused
with a FormatError naming the file. (A file up to _zip._WHOLE_FILE is parsed from one read of the
whole file, headers included: the files here are larger.)"""
import io
import struct
import zipfile

import pytest
import torch

import fastckpt
from fastckpt.formats import zip as _zip

import crafted
from engines import drop_page_cache, record_reads

MIB = 1 << 20


def _state(n=120):
    g = torch.Generator().manual_seed(11)
    sd = {f"p{i}": torch.randn(50 + 97 * i, generator=g) for i in range(n)}
    sd["big"] = torch.randn(MIB // 2 + 5, generator=g)
    sd["half"] = torch.randn(333, generator=g).half()
    return sd


def _same(got, sd):
    assert sorted(got) == sorted(sd)
    for k in sd:
        assert got[k].dtype == sd[k].dtype and torch.equal(got[k], sd[k]), k


def _rewritten(src: bytes, gap: int = 0, comment: bytes = b"") -> bytes:
    """`src`'s records written again by Python's zipfile (stored, no data descriptors, no padding),
    `gap` bytes of junk after each record's data."""
    zin = zipfile.ZipFile(io.BytesIO(src))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in zin.infolist():
            z.writestr(info.filename, zin.read(info.filename))
            if gap:
                z.fp.write(b"\xee" * gap)  # zipfile writes the next header where the file ends
                z.start_dir = z.fp.tell()
        z.comment = comment
    return out.getvalue()


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
def test_the_storages_and_their_headers_are_read_in_one_batch(tmp_path, monkeypatch, writer):
    sd = _state()
    path = tmp_path / "c.pt"
    (fastckpt.save if writer == "fastckpt" else torch.save)(sd, path)
    assert path.stat().st_size > _zip._WHOLE_FILE
    calls = record_reads(monkeypatch)
    for verify in (True, False):
        calls.clear()
        drop_page_cache(path)
        _same(fastckpt.load(path, verify=verify), sd)
        # the small records (data.pkl, ...) with their headers, then the storages with theirs
        assert len(calls) == 2, calls
        assert calls[1]["bytes"] <= path.stat().st_size


@pytest.mark.parametrize("gap", [0, 3, 4096 + 5])
def test_a_file_laid_out_otherwise_loads_bitwise(tmp_path, gap):
    """zipfile writes no data descriptors and no padding (every guess of a data offset misses
    until the first headers read say so); junk between records misses every guess."""
    sd = _state()
    buf = io.BytesIO()
    torch.save(sd, buf)
    path = tmp_path / "z.pt"
    path.write_bytes(_rewritten(buf.getvalue(), gap))
    assert path.stat().st_size > _zip._WHOLE_FILE
    for verify in (True, False):
        drop_page_cache(path)
        _same(fastckpt.load(path, verify=verify), sd)
    _same(torch.load(path), sd)


@pytest.mark.parametrize("gap", [0, 4096 + 5])
def test_a_file_laid_out_otherwise_loads_bitwise_while_unpickling(tmp_path, gap):
    """Storages of READ_BEHIND_MIN or more are read on a thread while data.pkl is unpickled; the
    records whose headers say otherwise are read again when the load waits for that thread, from
    the file opened again and checked to be the same one."""
    from fastckpt.torchsave.reader import READ_BEHIND_MIN
    g = torch.Generator().manual_seed(12)
    sd = {f"w{i}": torch.randn(READ_BEHIND_MIN // 4 // 6 + i, generator=g) for i in range(8)}
    sd.update(_state(30))
    buf = io.BytesIO()
    torch.save(sd, buf)
    path = tmp_path / "zb.pt"
    path.write_bytes(_rewritten(buf.getvalue(), gap))
    for verify in (True, False):
        drop_page_cache(path)
        _same(fastckpt.load(path, verify=verify), sd)


def test_an_unreferenced_records_header_is_checked_too(tmp_path):
    """A record data.pkl does not refer to is not read, but its local header is checked, as every
    record's is."""
    data, name = crafted.unreferenced_archive(2 * MIB, 3000)
    path = tmp_path / "u.pt"
    path.write_bytes(data)
    got = fastckpt.load(path, verify=True)
    assert torch.equal(got["t0"], torch.zeros(2 * MIB, dtype=torch.uint8))
    bad = bytearray(data)
    bad[_records(data)[name].header_offset] ^= 0xFF
    path.write_bytes(bytes(bad))
    with pytest.raises(fastckpt.FormatError, match="no local header") as ei:
        fastckpt.load(path)
    assert str(path) in str(ei.value) and name in str(ei.value)


def _large_archive() -> bytes:
    return crafted.stock_archive([b"\x01" * 4096, b"\x02" * 5000, b"\x03" * (2 * MIB)])


def _records(data: bytes):
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename.split("/", 1)[1]: i for i in z.infolist()}


@pytest.mark.parametrize("record", ["data.pkl", "data/1", "data/2"])
@pytest.mark.parametrize("damage", ["signature", "name", "extra_onto_next", "extra_past_end"])
def test_a_damaged_local_header_is_refused_naming_the_file(tmp_path, record, damage):
    data = bytearray(_large_archive())
    info = _records(bytes(data))
    h = info[record].header_offset
    name_len, extra_len = struct.unpack_from("<HH", data, h + 26)
    if damage == "signature":
        data[h] ^= 0xFF
        match = "no local header" if h else "not a zip-format"  # the file's first bytes are data.pkl's header
    elif damage == "name":
        data[h + 30 + name_len - 1] ^= 0x01
        match = "names another record"
    elif damage == "extra_onto_next":  # the data moves forward by 100 bytes: onto the descriptor and next record
        struct.pack_into("<H", data, h + 28, extra_len + 100)
        match = "overlap|truncated"
    else:
        struct.pack_into("<H", data, h + 28, 0xFFFF)
        match = "overlap|truncated"
    path = tmp_path / "bad.pt"
    path.write_bytes(bytes(data))
    assert path.stat().st_size > _zip._WHOLE_FILE
    for verify in (True, False):
        drop_page_cache(path)
        with pytest.raises(fastckpt.FormatError, match=match) as ei:
            fastckpt.load(path, verify=verify)
        assert str(path) in str(ei.value)


def test_an_undamaged_large_archive_loads(tmp_path):
    path = tmp_path / "good.pt"
    path.write_bytes(_large_archive())
    got = fastckpt.load(path, verify=True)
    assert torch.equal(got["t2"], torch.full((2 * MIB,), 3, dtype=torch.uint8))


def test_the_guess_and_what_the_headers_teach():
    """Archive.guess places a record's data before its descriptor and the next record; a header
    that says otherwise teaches the descriptors' form for the guesses that follow."""
    sd = _state(8)
    buf = io.BytesIO()
    torch.save(sd, buf)
    for data, descriptors in ((buf.getvalue(), True), (_rewritten(buf.getvalue()), False)):
        a = _zip.Archive.parse(io.BytesIO(data), "x.pt", use_fd=False, local_headers=False)
        truth = _zip.Archive.parse(io.BytesIO(data), "x.pt", use_fd=False)
        entries = list(a.records.values())
        assert all(e.data_offset == 0 for e in entries)
        hits = []
        for e in entries:
            guess = a.guesses()[e.header_offset]
            h = e.header_offset
            rest = e.name.split("/", 1)[1]
            hits.append(not a.settle([(data[h:h + 200], h, [rest])], {rest: guess}))
            assert e.data_offset == truth.records[e.name.split("/", 1)[1]].data_offset
            assert hits[-1] == (guess == e.data_offset)
        assert all(hits) if descriptors else (not hits[0] and all(hits[1:])), hits
