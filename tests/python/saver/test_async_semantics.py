"""fastckpt.async_save takes what torch.save takes and honours torch's
settings as fastckpt.save does: the keyword
arguments ``_use_new_zipfile_serialization`` and ``_disable_byteorder_record``,
``torch.serialization.skip_data()`` (a per-thread setting, read in the
caller's thread) and ``torch.utils.serialization.config.save`` (read when
async_save is called). Every file is compared with fastckpt.save's."""

import errno
import inspect
import io
import pickle
import struct
import zipfile

import pytest
import torch
import torch.serialization as ts
from torch.utils.serialization import config as torch_config

import fastckpt
from fastckpt import _C
from fastckpt.saver import AsyncSaver
from fastckpt.formats.pickle_scan import LEGACY_MAGIC

from leaks import temp_files
from states import assert_same


def _state():
    return {"w": torch.arange(1, 2001, dtype=torch.float32), "b": torch.full((7,), 5, dtype=torch.int16),
            "n": 3, "s": "text"}


def _raw(path, info):
    """A record's bytes as stored (zipfile.read would check CRCs, which are 0 for skip_data)."""
    with open(path, "rb") as f:
        f.seek(_data_offset(path, info))
        return f.read(info.file_size)


def _data_offset(path, info):
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        n, m = struct.unpack("<HH", f.read(30)[26:30])
    return info.header_offset + 30 + n + m


def _layout(path):
    """Every record: name, offset, size, CRC and bytes (the per-file random
    serialization id excepted)."""
    out = []
    for i in zipfile.ZipFile(path).infolist():
        name = i.filename.split("/", 1)[1]
        if name == ".data/serialization_id":
            out.append((name, i.header_offset, i.file_size))
        else:
            out.append((name, _data_offset(path, i), i.file_size, i.CRC, _raw(path, i)))
    return out



def test_async_save_signature_covers_torch_save():
    """Every parameter of torch.save is accepted by async_save, with torch's default."""
    mine = inspect.signature(fastckpt.async_save).parameters
    for name, p in inspect.signature(torch.save).parameters.items():
        assert name in mine, f"async_save lacks torch.save's argument {name}"
        assert mine[name].default == p.default or name == "pickle_module", (name, mine[name].default, p.default)


@pytest.mark.parametrize("kw", [{"_use_new_zipfile_serialization": True},
                                {"_use_new_zipfile_serialization": True, "_disable_byteorder_record": False},
                                {"_disable_byteorder_record": True}], ids=["zip", "zip-byteorder", "no-byteorder"])
def test_async_save_writes_what_save_writes(tmp_path, kw):
    sd = _state()
    fastckpt.save(sd, tmp_path / "s.pt", **kw)
    fastckpt.async_save(sd, tmp_path / "a.pt", **kw).result()
    assert _layout(tmp_path / "a.pt") == _layout(tmp_path / "s.pt")
    names = zipfile.ZipFile(tmp_path / "a.pt").namelist()
    assert any(n.endswith("/byteorder") for n in names) == (not kw.get("_disable_byteorder_record", False))
    for load in (torch.load, fastckpt.load):
        assert_same(load(tmp_path / "a.pt"), sd)
    # positionally, as torch.save's
    fastckpt.async_save(sd, tmp_path / "p.pt", pickle, 2, True, True).result()
    assert _layout(tmp_path / "p.pt") == _layout(tmp_path / "a.pt" if kw.get("_disable_byteorder_record") else
                                                  tmp_path / "p.pt")
    assert not any(n.endswith("/byteorder") for n in zipfile.ZipFile(tmp_path / "p.pt").namelist())
    assert temp_files(tmp_path) == []


def test_async_save_legacy_format(tmp_path):
    """_use_new_zipfile_serialization=False: torch's legacy format, the same
    file fastckpt.save writes; stock torch.load reads it."""
    sd = _state()
    fastckpt.save(sd, tmp_path / "s.pt", _use_new_zipfile_serialization=False)
    fut = fastckpt.async_save(sd, tmp_path / "a.pt", _use_new_zipfile_serialization=False)
    sd["w"].add_(1)  # the snapshot was taken when async_save returned
    fut.result()
    data = (tmp_path / "a.pt").read_bytes()
    assert data.startswith(LEGACY_MAGIC) and not zipfile.is_zipfile(io.BytesIO(data))
    assert len(data) == (tmp_path / "s.pt").stat().st_size
    for load in (torch.load, fastckpt.load):
        got = load(tmp_path / "a.pt")
        ref = load(tmp_path / "s.pt")
        assert_same(got, ref)
    assert temp_files(tmp_path) == []


def test_async_save_legacy_format_is_atomic_and_durable(tmp_path):
    """A failed fdatasync of a legacy-format async save fails its future with
    an error naming the path, and leaves the old file and no temporary file."""
    p = tmp_path / "old.pt"
    fastckpt.save({"gen": 1}, p, _use_new_zipfile_serialization=False)
    _C.fault_inject("fsync", nth=1, errno=errno.EIO, path_contains="old.pt")
    try:
        fut = fastckpt.async_save({"gen": 2, "w": torch.ones(100)}, p, _use_new_zipfile_serialization=False)
        e = fut.exception()
        assert _C.fault_fired() >= 1
    finally:
        _C.fault_clear()
    assert isinstance(e, OSError) and e.errno == errno.EIO and e.filename == str(p)
    assert fastckpt.load(p) == {"gen": 1} and temp_files(tmp_path) == []


def test_async_save_skip_data_writes_no_storage_bytes(tmp_path):
    """Under skip_data() (entered in the calling thread; the writer thread is
    another one) no storage's bytes are copied or written: the file is
    fastckpt.save's under skip_data (zero-filled records, CRC 0)."""
    sd = _state()
    saver = AsyncSaver()
    with ts.skip_data():
        fastckpt.save(sd, tmp_path / "s.pt")
        fut = saver.save(sd, tmp_path / "a.pt")
    r = fut.result()
    assert _layout(tmp_path / "a.pt") == _layout(tmp_path / "s.pt")
    data = [i for i in zipfile.ZipFile(tmp_path / "a.pt").infolist() if "/data/" in i.filename
            and "serialization_id" not in i.filename]
    assert len(data) == 2 and [i.CRC for i in data] == [0, 0]
    assert all(not any(_raw(tmp_path / "a.pt", i)) for i in data)
    assert saver.stager.allocations == 0 and r.nbytes == 0  # nothing was snapshotted
    for load in (torch.load, fastckpt.load):
        got = load(tmp_path / "a.pt")
        assert got["w"].shape == sd["w"].shape and not got["w"].any() and got["s"] == "text"
    assert temp_files(tmp_path) == []


def test_async_save_skip_data_saves_meta_and_fake_tensors(tmp_path):
    """skip_data lets tensors without data be saved, as fastckpt.save does."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    meta = {"w": torch.empty(64, 32, device="meta")}
    with FakeTensorMode():
        fake = {"w": torch.empty(64, 32), "b": torch.empty(32, dtype=torch.float16)}
    with ts.skip_data():
        fastckpt.save(meta, tmp_path / "ms.pt")
        fut = fastckpt.async_save(meta, tmp_path / "ma.pt")
    fut.result()
    with ts.skip_data(materialize_fake_tensors=True):
        fastckpt.save(fake, tmp_path / "fs.pt")
        fut = fastckpt.async_save(fake, tmp_path / "fa.pt")
    fut.result()
    assert _layout(tmp_path / "ma.pt") == _layout(tmp_path / "ms.pt")
    assert _layout(tmp_path / "fa.pt") == _layout(tmp_path / "fs.pt")
    got = torch.load(tmp_path / "fa.pt")
    assert got["w"].shape == (64, 32) and got["b"].dtype == torch.float16 and not got["w"].any()


def test_async_save_skip_data_refuses_legacy_format(tmp_path):
    """As torch.save and fastckpt.save: raised by async_save itself, nothing written."""
    with ts.skip_data():
        with pytest.raises(RuntimeError, match="skip_data"):
            fastckpt.async_save({"w": torch.ones(2)}, tmp_path / "a.pt", _use_new_zipfile_serialization=False)
    assert not (tmp_path / "a.pt").exists() and temp_files(tmp_path) == []
    assert fastckpt.wait_for_saves(timeout=60)


def test_async_save_reads_torch_settings_when_called(tmp_path):
    """config.save (compute_crc32, storage_alignment) as it is when
    async_save is called, not when the writer thread gets to the save: a save
    queued behind a slow one, with settings changed back meanwhile, is the
    file fastckpt.save wrote under them."""
    sd = _state()
    saver = AsyncSaver(max_in_flight=2)
    settings = {"save.compute_crc32": False, "save.storage_alignment": 8192}
    with torch_config.patch(settings):
        fastckpt.save(sd, tmp_path / "s.pt")
    _C.fault_inject("write", nth=1, delay_ms=200, times=0, path_contains="slow.pt")
    try:
        slow = saver.save({"w": torch.ones(1 << 20, dtype=torch.uint8)}, tmp_path / "slow.pt")
        with torch_config.patch(settings):
            fut = saver.save(sd, tmp_path / "a.pt")
        assert not slow.done(), "the first save ended too soon for this test to mean anything"
        fut.result()
        slow.result()
    finally:
        _C.fault_clear()
    lay = _layout(tmp_path / "a.pt")
    assert lay == _layout(tmp_path / "s.pt")
    assert all(e[3] == 0 for e in lay if len(e) > 3)
    assert all(e[1] % 8192 == 0 for e in lay if e[0].startswith("data/"))
