"""fastckpt.load unpickles while the storages are read, when that is safe:
weights-only, map_location leaving storages on the CPU, and a pickle whose
every global is data-blind (fastckpt.formats.pickle_scan.unpickling_reads_no_data). Any
other pickle is unpickled after its storages are in. Whatever happens (a read
error, an unpickling error, a damaged storage), the background read is joined
before load returns or raises, and the errors are the same as without it."""

import io
import pickle
import sys
import threading
import zipfile

import pytest
import torch

import fastckpt
from fastckpt import _C
from fastckpt.formats import zip as _zip
from fastckpt import serialization as ser

from engines import drop_page_cache
from states import same_state


class _Point:  # a class allowed with torch.serialization.add_safe_globals in one test
    def __init__(self, x=0):
        self.x = x


def _plain_state():
    m = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 64))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    return {"model": m.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "step": 7,
            "big": torch.randn(1 << 18), "half": torch.ones(1000, dtype=torch.bfloat16), "tags": {"a", "b"},
            "blob": b"bytes", "param": torch.nn.Parameter(torch.ones(3))}



@pytest.fixture
def behind_calls(monkeypatch):
    calls = []
    real = fastckpt.torchsave.reader.Records.read_behind

    def spy(self, storages):
        calls.append(list(storages))
        return real(self, storages)
    monkeypatch.setattr(fastckpt.torchsave.reader.Records, "read_behind", spy)
    monkeypatch.setattr(fastckpt.torchsave.reader, "READ_BEHIND_MIN", 0)  # these states are small
    return calls


def test_a_small_state_is_read_before_it_is_unpickled(tmp_path, monkeypatch):
    """Below READ_BEHIND_MIN bytes of storages no thread is started (its start and the GIL's hand-offs
    would cost more than the reads); above, the storages are read behind the unpickling."""
    calls = []
    real = fastckpt.torchsave.reader.Records.read_behind
    monkeypatch.setattr(fastckpt.torchsave.reader.Records, "read_behind",
                        lambda self, s: (calls.append(list(s)), real(self, s))[1])
    monkeypatch.setattr(fastckpt.torchsave.reader, "READ_BEHIND_MIN", 1 << 20)
    small, large = {"w": torch.randn(1000)}, {"w": torch.randn(1 << 18)}  # 4 KB, 1 MiB
    fastckpt.save(small, tmp_path / "s.pt")
    fastckpt.save(large, tmp_path / "l.pt")
    assert same_state(small, fastckpt.load(tmp_path / "s.pt")) and calls == []
    assert same_state(large, fastckpt.load(tmp_path / "l.pt")) and len(calls) == 1


def _no_reader_thread():
    return not any(t.name == "fastckpt-load" and t.is_alive() for t in threading.enumerate())


def test_plain_state_dict_is_unpickled_while_its_storages_are_read(tmp_path, behind_calls):
    sd = _plain_state()
    p = tmp_path / "c.pt"
    fastckpt.save(sd, p)
    for ml in (None, "cpu", torch.device("cpu")):
        drop_page_cache(p)
        got = fastckpt.load(p, map_location=ml)
        assert same_state(sd, got)
        assert type(got["param"]) is torch.nn.Parameter
    assert len(behind_calls) == 3 and all(behind_calls)
    # torch.save's files too
    q = tmp_path / "t.pt"
    torch.save(sd, q)
    assert same_state(sd, fastckpt.load(q))
    assert len(behind_calls) == 4
    assert _no_reader_thread()


def test_a_damaged_storage_is_still_found_and_named(tmp_path, behind_calls):
    p = tmp_path / "c.pt"
    fastckpt.save({"a": torch.zeros(1 << 16), "b": torch.ones(1 << 16)}, p)
    with open(p, "rb") as fh:
        rec = _zip.Archive.parse(fh, str(p)).records["data/1"]
    raw = bytearray(p.read_bytes())
    raw[rec.data_offset + 777] ^= 4
    p.write_bytes(bytes(raw))
    with pytest.raises(fastckpt.FormatError, match=r"checksum mismatch.*tensor b"):
        fastckpt.load(p)
    assert behind_calls
    got = fastckpt.load(p, verify=False)
    assert got["b"].view(torch.uint8)[777] == (torch.ones(1).view(torch.uint8)[1] ^ 4)
    assert _no_reader_thread()


def test_a_failing_background_read_raises_the_read_error(tmp_path, monkeypatch):
    p = tmp_path / "c.pt"
    fastckpt.save({"w": torch.randn(1 << 20)}, p)
    drop_page_cache(p)
    calls = []
    real = fastckpt.torchsave.reader.Records.read_behind

    def failing(self, storages):  # every read from here on fails: the storages', in the background
        calls.append(storages)
        _C.fault_inject("read", nth=1, errno=5, times=0)
        return real(self, storages)
    monkeypatch.setattr(fastckpt.torchsave.reader.Records, "read_behind", failing)
    monkeypatch.setattr(fastckpt.torchsave.reader, "READ_BEHIND_MIN", 0)  # 4 MiB: read behind
    try:
        with pytest.raises(OSError) as ei:
            fastckpt.load(p)
    finally:
        _C.fault_clear()
    assert ei.value.errno == 5 and str(p) in str(ei.value)
    assert calls
    monkeypatch.setattr(fastckpt.torchsave.reader.Records, "read_behind", real)
    assert _no_reader_thread()
    assert torch.equal(fastckpt.load(p)["w"].view(torch.uint8)[:8], torch.load(p)["w"].view(torch.uint8)[:8])


def test_an_unpickling_error_joins_the_read_first(tmp_path, behind_calls, monkeypatch):
    p = tmp_path / "c.pt"
    fastckpt.save({"w": torch.randn(1 << 20)}, p)
    seen = {}

    def broken_load(*a, **k):
        seen["reading"] = any(t.name == "fastckpt-load" for t in threading.enumerate())
        raise RuntimeError("boom")
    monkeypatch.setattr(ser.ts, "_load", broken_load)
    # the plain state dict's own unpickler fails too (then torch's, the broken one, is run)
    monkeypatch.setattr("fastckpt.torchsave.load.load_plain", broken_load)
    with pytest.raises(fastckpt.FormatError, match="data.pkl is damaged.*boom"):
        fastckpt.load(p)
    assert behind_calls and "reading" in seen
    assert _no_reader_thread()


def _sparse():
    i = torch.tensor([[0, 1, 2], [2, 0, 1]])
    return torch.sparse_coo_tensor(i, torch.tensor([3.0, 4.0, 5.0]), (3, 3))


@pytest.mark.parametrize("case", ["sparse", "safe_global", "weights_only_false", "callable", "dict"])
def test_pickles_that_may_read_data_wait_for_their_storages(tmp_path, behind_calls, case):
    """Anything whose unpickling may read storage bytes (a sparse tensor's
    validation, a class the user allowed, code with weights_only=False, a
    map_location callable or dict) is unpickled after the reads, and loads
    right. (Protocol 4 and later, with STACK_GLOBAL: test_the_scan_is_conservative;
    torch's weights-only unpickler refuses them anyway.)"""
    sd = {"w": torch.randn(1 << 16)}
    kw = {}
    if case == "sparse":
        sd["s"] = _sparse()
    elif case == "safe_global":
        sd["pt"] = _Point(5)
    elif case == "weights_only_false":
        kw["weights_only"] = False
    elif case == "callable":
        kw["map_location"] = lambda storage, loc: storage
    elif case == "dict":
        kw["map_location"] = {"cpu": "cpu"}
    p = tmp_path / "c.pt"
    fastckpt.save(sd, p)
    if case == "safe_global":
        with torch.serialization.safe_globals([_Point]):
            got = fastckpt.load(p, **kw)
        assert got["pt"].x == 5
    else:
        got = fastckpt.load(p, **kw)
    assert torch.equal(got["w"], sd["w"])
    if case == "sparse":
        assert torch.equal(got["s"].to_dense(), sd["s"].to_dense())
    assert behind_calls == []


def test_the_scan_is_conservative():
    """_unpickling_reads_no_data: this machine's byte order, protocols <= 3
    and only data-blind globals."""
    import sys
    native = sys.byteorder.encode()

    def small(obj, protocol=2, byteorder=native):
        b = io.BytesIO()
        torch.save(obj, b, pickle_protocol=protocol)
        with zipfile.ZipFile(b) as z:
            return {"data.pkl": z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))),
                    "byteorder": byteorder}
    ok = fastckpt.formats.pickle_scan.unpickling_reads_no_data
    assert ok(small(_plain_state()))
    assert not ok(small(_plain_state(), byteorder=b"big" if native == b"little" else b"little"))
    assert not ok({"data.pkl": small(_plain_state())["data.pkl"]})  # no byteorder record: torch's config decides
    assert not ok(small({"s": _sparse()}))
    assert not ok(small({"w": torch.ones(2)}, protocol=4))
    assert not ok(small({"n": __import__("numpy").arange(3)}))
    # a string that looks like a GLOBAL of something else only makes it say no
    assert not ok(small({"k": "x\ncos\nsystem\n"}))
    assert not ok({"data.pkl": b"", "byteorder": native})
    assert not ok({"data.pkl": pickle.dumps({"a": 1}, protocol=5), "byteorder": native})


def test_a_storage_restored_off_the_cpu_waits_for_the_reads():
    """A location tag other than "cpu" (map_location None: torch copies the
    storage there) joins the background read first; "cpu" does not."""
    class Records:
        joins = 0

        def join(self):
            self.joins += 1
    recs = Records()
    restore = fastckpt.torchsave.load._restore_behind(recs, None)
    s = torch.UntypedStorage(8)
    assert restore(s, "cpu") is s and recs.joins == 0
    assert restore(s, "meta").device.type == "meta" and recs.joins == 1
    restore_cpu = fastckpt.torchsave.load._restore_behind(recs, "cpu")
    assert restore_cpu(s, "meta") is s and recs.joins == 1  # map_location="cpu": everything stays


def test_a_foreign_byte_order_is_swapped_after_the_reads(tmp_path, behind_calls, monkeypatch):
    """A file of the other byte order is byteswapped by torch as each storage is
    unpickled: it waits for its storages, and loads as torch.load loads it."""
    import types
    other = "big" if sys.byteorder == "little" else "little"
    p = tmp_path / "be.pt"
    sd = {"w": torch.arange(1 << 14, dtype=torch.int32)}
    monkeypatch.setattr(fastckpt.formats.archive, "sys", types.SimpleNamespace(**{**vars(__import__("sys")), "byteorder": other}))
    fastckpt.save(sd, p)
    monkeypatch.undo()
    got = fastckpt.load(p)
    assert behind_calls == []
    assert torch.equal(got["w"], torch.load(p)["w"])
    assert torch.equal(got["w"].view(torch.uint8).view(-1, 4).flip(1).reshape(-1).view(torch.int32), sd["w"])
