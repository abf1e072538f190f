"""Fuzzing fastckpt.load with damaged files (short run; FASTCKPT_FUZZ_EXAMPLES
raises the count for the long run).

Every damaged file must give a clean outcome: it loads (a flipped bit inside
tensor data is only caught with verify=True), or raises fastckpt.FormatError,
an OSError, or pickle.UnpicklingError (the weights-only unpickler refusing a
damaged pickle). Never another exception, a crash, a hang or a huge
allocation: sizes read from the file are checked against the file first.
"""
import os
import pickle
import re
import struct

import pytest
import torch

import fastckpt

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("FASTCKPT_FUZZ_EXAMPLES", "300"))
ALLOWED = (fastckpt.FormatError, OSError, pickle.UnpicklingError)


def _reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzref")
    sd = {"w": torch.arange(3000, dtype=torch.float32).reshape(30, 100), "b": torch.ones(7, dtype=torch.bfloat16),
          "e": torch.empty(0), "tied": None, "meta": {"step": 3, "name": "x"}}
    sd["tied"] = sd["w"][1:5]
    p = d / "ref.pt"
    fastckpt.save(sd, p)
    return p.read_bytes()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory)


# A storage's location tag damaged into another device's name ("cpu" -> "hpu")
# is a file saved on a device this machine lacks: fastckpt.load raises what
# torch.load raises for such a file (a RuntimeError naming the device), not a
# FormatError, to stay torch-compatible. Only these messages are allowed.
DEVICE_UNAVAILABLE = re.compile(r"device module is not registered|don't know how to restore data location|"
                                r"torch\.\w+\.is_available\(\) is False|Invalid device|device type",
                                re.IGNORECASE)


def _check(data: bytes, path, verify: bool):
    with open(path, "wb") as f:
        f.write(data)
    try:
        fastckpt.load(path, verify=verify)
    except ALLOWED:
        pass
    except RuntimeError as e:
        if not DEVICE_UNAVAILABLE.search(str(e)):
            raise


def test_a_location_damaged_into_an_unavailable_device_is_torchs_error(reference, tmp_path):
    import io
    import zipfile
    pkl = zipfile.ZipFile(io.BytesIO(reference)).read("archive/data.pkl")
    assert b"cpu" in pkl
    damaged = _with_pickle(reference, pkl.replace(b"cpu", b"hpu", 1))
    (tmp_path / "ref.pt").write_bytes(damaged)
    with pytest.raises(RuntimeError) as ours:
        fastckpt.load(tmp_path / "ref.pt")
    with pytest.raises(RuntimeError) as theirs:
        torch.load(tmp_path / "ref.pt", weights_only=True)
    assert DEVICE_UNAVAILABLE.search(str(ours.value)) and str(ours.value) == str(theirs.value)
    _check(damaged, tmp_path / "c.pt", verify=True)  # the fuzzers' check allows it


def test_check_refuses_other_runtime_errors(reference, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("index out of range in a loader")
    monkeypatch.setattr(fastckpt, "load", boom)
    with pytest.raises(RuntimeError, match="index out of range"):
        _check(reference, tmp_path / "c.pt", verify=False)


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.integers(min_value=0, max_value=1 << 20), st.just(0)),
    st.tuples(st.just("flip"), st.integers(min_value=0, max_value=1 << 20), st.integers(0, 7)),
    st.tuples(st.just("u32"), st.integers(min_value=0, max_value=1 << 20),
              st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFFFFFFE, 4096, 1 << 30])),
    st.tuples(st.just("u16"), st.integers(min_value=0, max_value=1 << 20),
              st.sampled_from([0, 1, 0xFFFF, 30, 4096])),
    st.tuples(st.just("u64"), st.integers(min_value=0, max_value=1 << 20),
              st.sampled_from([0, 1 << 40, (1 << 64) - 1, 1 << 32])),
)


def _apply(data: bytearray, muts):
    for kind, pos, val in muts:
        if not data:
            break
        pos %= len(data)
        if kind == "truncate":
            del data[pos:]
        elif kind == "flip":
            data[pos] ^= 1 << val
        elif kind == "u32" and pos + 4 <= len(data):
            data[pos:pos + 4] = struct.pack("<I", val)
        elif kind == "u16" and pos + 2 <= len(data):
            data[pos:pos + 2] = struct.pack("<H", val)
        elif kind == "u64" and pos + 8 <= len(data):
            data[pos:pos + 8] = struct.pack("<Q", val)
    return bytes(data)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(muts=st.lists(mutation, min_size=1, max_size=4), verify=st.booleans())
def test_damaged_files_fail_cleanly(reference, tmp_path_factory, muts, verify):
    path = tmp_path_factory.getbasetemp() / "fuzz.pt"
    _check(_apply(bytearray(reference), muts), path, verify)


def _header_positions(data: bytes):
    """Offsets of zip structure fields: the interesting places to damage."""
    out = []
    for sig in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x07\x08"):
        i = data.find(sig)
        while i >= 0:
            out.append(i)
            i = data.find(sig, i + 1)
    return sorted(out)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_damaged_zip_structures_fail_cleanly(reference, tmp_path_factory, data):
    heads = _header_positions(reference)
    base = data.draw(st.sampled_from(heads))
    off = data.draw(st.integers(0, 46))
    val = data.draw(st.sampled_from([0, 1, 0xFF, 0xFFFF, 0xFFFFFFFF, 0x12345678]))
    width = data.draw(st.sampled_from([1, 2, 4]))
    buf = bytearray(reference)
    if base + off + width <= len(buf):
        buf[base + off:base + off + width] = val.to_bytes(8, "little")[:width]
    _check(bytes(buf), tmp_path_factory.getbasetemp() / "fuzz2.pt", data.draw(st.booleans()))


CORPUS = os.path.join(os.path.dirname(__file__), "fuzz_corpus")


@pytest.mark.parametrize("name", sorted(os.listdir(CORPUS)) if os.path.isdir(CORPUS) else [])
def test_corpus_regressions(name, tmp_path):
    """Inputs that once broke the loader stay fixed."""
    with open(os.path.join(CORPUS, name), "rb") as f:
        data = f.read()
    _check(data, tmp_path / "c.pt", verify=True)
    _check(data, tmp_path / "c.pt", verify=False)


def _with_pickle(reference: bytes, pkl: bytes) -> bytes:
    """`reference` with data.pkl replaced by `pkl` (same length or shorter,
    zero-padded) and every CRC field of that record fixed up: damage that the
    checksums cannot catch, as a hostile file would have."""
    import zipfile
    import io
    import zlib
    zf = zipfile.ZipFile(io.BytesIO(reference))
    info = next(i for i in zf.infolist() if i.filename.endswith("/data.pkl"))
    buf = bytearray(reference)
    name_len, extra_len = struct.unpack_from("<HH", buf, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    n = info.file_size
    body = (pkl + bytes(n))[:n]
    buf[start:start + n] = body
    old, new = struct.pack("<I", info.CRC), struct.pack("<I", zlib.crc32(body))
    buf[start + n + 4:start + n + 8] = new  # data descriptor
    cd = buf.find(b"PK\x01\x02" + bytes(2), 0)
    i = bytes(buf).find(old, start + n + 8)
    while i >= 0:  # the central directory's copy
        buf[i:i + 4] = new
        i = bytes(buf).find(old, i + 4)
    return bytes(buf)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_pickles_with_valid_checksums_fail_cleanly(reference, tmp_path_factory, data):
    import io
    import zipfile
    pkl = zipfile.ZipFile(io.BytesIO(reference)).read("archive/data.pkl")
    buf = bytearray(pkl)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "byte", "cut"]))
        pos = data.draw(st.integers(0, len(buf) - 1)) if buf else 0
        if not buf:
            break
        if kind == "flip":
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "byte":
            buf[pos] = data.draw(st.integers(0, 255))
        else:
            del buf[pos:]
    _check(_with_pickle(reference, bytes(buf)), tmp_path_factory.getbasetemp() / "fuzz3.pt", data.draw(st.booleans()))
