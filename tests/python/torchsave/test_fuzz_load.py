"""Fuzzing fastckpt.load with damaged and hostile files (short run;
FASTCKPT_FUZZ_EXAMPLES raises the count for the long run).

Every damaged file must give a clean outcome: it loads (a flipped bit inside
tensor data is only caught with verify=True), or raises fastckpt.FormatError,
an OSError, or pickle.UnpicklingError (the weights-only unpickler refusing a
damaged pickle). Never another exception, a crash, a hang or a huge
allocation: sizes read from the file are checked against the file first.

The memory oracle: each input is loaded in a probe process (crafted.MemoryProbe)
that measures the peak RSS growth of that one load (its high-water mark reset
just before it), which must stay within crafted.memory_bound: a small
multiple of the file's size, plus one of its pickle's (the objects a pickle
builds take more memory than its bytes), plus a constant. Inputs are mutations of a
valid file and archives built structure by structure (crafted.py): records
overlapping one blob, central directories out of file order, declared sizes
and counts far beyond the file, pickles nested deeply or storing huge memo
indices, a pickle's sizes disagreeing with its records; each maybe damaged
further.
"""
import os
import struct

import pytest
import torch

import fastckpt

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import crafted  # noqa: E402
from crafted import ALLOWED, DEVICE_UNAVAILABLE  # noqa: E402,F401
from paths import DATA  # noqa: E402

EXAMPLES = int(os.environ.get("FASTCKPT_FUZZ_EXAMPLES", "300"))


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


def _sanitized() -> bool:
    """Under tests/fuzz/run_sanitized.sh (ASan preloaded): ASan's quarantine and
    shadow memory make RSS meaningless, its max_allocation_size_mb bounds each
    allocation instead, and its plugin counts the loads made in this process."""
    with open("/proc/self/maps") as f:
        return bool(os.environ.get("FASTCKPT_SANITIZED_DIR")) or "libasan" in f.read()


@pytest.fixture(scope="module")
def probe(tmp_path_factory, reference):
    """The memory probe, or None (inputs then load in this process, without the
    memory oracle) under ASan or where a process cannot reset its peak RSS:
    test_memory_oracle_can_fail then skips, saying why."""
    if _sanitized() or crafted.hwm_resettable():
        yield None
        return
    warm = tmp_path_factory.mktemp("probe") / "warm.pt"
    warm.write_bytes(reference)
    p = crafted.MemoryProbe(str(warm))
    yield p
    p.close()


def _check(data: bytes, path, verify: bool, as_file: bool = False):
    """Load `data` here: a clean outcome or the exception that is not one."""
    with open(path, "wb") as f:
        f.write(data)
    crafted.load_cleanly(path, verify, as_file)


def _check_bounded(probe, data: bytes, path, verify: bool, as_file: bool = False):
    """Load `data` in the probe process (as_file: from a file object, which
    torch.load reads): a clean outcome, and a peak RSS growth of that load
    within crafted.memory_bound(len(data), size of its data.pkl)."""
    if probe is None:  # under ASan: see _sanitized
        return _check(data, path, verify, as_file)
    with open(path, "wb") as f:
        f.write(data)
    growth, error = probe.load(path, verify, as_file)
    if error is not None:
        pytest.fail(f"{len(data)}-byte input {path} (verify={verify}, as_file={as_file}): {error}")
    pkl = crafted.pickle_size(data)
    bound = crafted.memory_bound(len(data), pkl)
    assert 0 <= growth <= bound, (f"loading a {len(data)}-byte input ({pkl}-byte data.pkl) grew the peak RSS "
                                  f"by {growth} bytes (bound {bound})")


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
def test_damaged_files_fail_cleanly(reference, probe, tmp_path_factory, muts, verify):
    path = tmp_path_factory.getbasetemp() / "fuzz.pt"
    _check_bounded(probe, _apply(bytearray(reference), muts), path, verify)


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
def test_damaged_zip_structures_fail_cleanly(reference, probe, tmp_path_factory, data):
    heads = _header_positions(reference)
    base = data.draw(st.sampled_from(heads))
    off = data.draw(st.integers(0, 46))
    val = data.draw(st.sampled_from([0, 1, 0xFF, 0xFFFF, 0xFFFFFFFF, 0x12345678]))
    width = data.draw(st.sampled_from([1, 2, 4]))
    buf = bytearray(reference)
    if base + off + width <= len(buf):
        buf[base + off:base + off + width] = val.to_bytes(8, "little")[:width]
    _check_bounded(probe, bytes(buf), tmp_path_factory.getbasetemp() / "fuzz2.pt", data.draw(st.booleans()))


CORPUS = str(DATA / "fuzz_corpus")


@pytest.mark.parametrize("name", sorted(os.listdir(CORPUS)) if os.path.isdir(CORPUS) else [])
def test_corpus_regressions(name, probe, tmp_path):
    """Inputs that once broke the loader stay fixed."""
    with open(os.path.join(CORPUS, name), "rb") as f:
        data = f.read()
    _check_bounded(probe, data, tmp_path / "c.pt", verify=True)
    _check_bounded(probe, data, tmp_path / "c.pt", verify=False)


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
def test_hostile_pickles_with_valid_checksums_fail_cleanly(reference, probe, tmp_path_factory, data):
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
    _check_bounded(probe, _with_pickle(reference, bytes(buf)), tmp_path_factory.getbasetemp() / "fuzz3.pt",
                   data.draw(st.booleans()))


# ---------------------------------------------------------------- crafted structures

_SIZES = [1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, (1 << 63) - 1]


@st.composite
def crafted_recipes(draw):
    """How to build an archive structure by structure (crafted.py), the kind
    of file a mutation of a valid one rarely reaches: a short tuple, so that a
    failing example reads as its recipe (build it with _build)."""
    kind = draw(st.sampled_from(["overlap", "order", "size", "count", "deep", "memo", "numel", "unref"]))
    if kind == "overlap":  # n records over one blob, all referenced by data.pkl
        return (kind, draw(st.integers(2, 200)), draw(st.sampled_from([4096, 1 << 20, 2 << 20])), draw(st.booleans()))
    if kind == "order":
        return (kind, draw(st.lists(st.integers(0, 5000), min_size=1, max_size=4)), draw(st.integers(0, 1000)))
    if kind == "size":
        return (kind, draw(st.sampled_from(_SIZES + [4097, 1 << 20])), draw(st.integers(0, 6)))
    if kind == "count":
        return (kind, draw(st.sampled_from([0xFFFE, 1 << 20, 10 ** 9, (1 << 64) - 1])), draw(st.booleans()))
    if kind == "numel":  # data.pkl asks for more (or less) than the record holds
        return (kind, draw(st.sampled_from([0, 4095, 4097] + _SIZES)))
    if kind == "unref":  # storages that data.pkl does not use, of any size
        return (kind, draw(st.integers(0, 4096)), draw(st.sampled_from([0, 1, 1 << 20])))
    if kind == "deep":  # a list nested this deep, maybe with a tensor at the bottom
        return (kind, draw(st.integers(1, 150_000)), draw(st.booleans()))
    # memo: LONG_BINPUT/LONG_BINGET at an index, or text PUT/GET (protocol 0 opcodes)
    return (kind, draw(st.sampled_from([0, 255, 1 << 16, (1 << 31) - 1, (1 << 32) - 1])),
            draw(st.sampled_from([None, 0, 10 ** 9, 10 ** 18])))


def _build(recipe) -> bytes:
    kind, *a = recipe
    if kind == "overlap":
        return crafted.overlapping_archive(a[0], a[1], local_extra=a[2])
    if kind == "order":
        return crafted.out_of_order_archive([bytes([i]) * n for i, n in enumerate(a[0])], seed=a[1])
    if kind == "size":
        return crafted.huge_size_archive(a[0], which=a[1])
    if kind == "count":
        return crafted.huge_count_archive(a[0], zip64=a[1])
    if kind == "unref":
        return crafted.unreferenced_archive(a[0], a[1])[0]
    storages = []
    if kind == "numel":
        pkl, storages = crafted.tensor_pickle([("0", a[0])]), [bytes(4096)]
    elif kind == "deep":
        pkl = crafted.nested_pickle(a[0])
        if a[1]:
            pkl, storages = crafted.wrap_pickle(pkl, crafted.tensor_pickle([("0", 64)])), [bytes(64)]
    else:
        pkl = crafted.memo_pickle(a[0]) if a[1] is None else b"\x80\x02]p%d\ng%d\n." % (a[1], a[1])
    b = crafted.Builder()
    b.standard(pkl, storages)
    b.tail()
    return b.finish()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(recipe=crafted_recipes(), muts=st.lists(mutation, max_size=2), verify=st.booleans(),
       as_file=st.sampled_from([False, False, False, True]))
def test_crafted_archives_fail_cleanly_in_bounded_memory(probe, tmp_path_factory, recipe, muts, verify, as_file):
    _check_bounded(probe, _apply(bytearray(_build(recipe)), muts), tmp_path_factory.getbasetemp() / "fuzz4.pt",
                   verify, as_file)


def test_memory_oracle_can_fail(reference, tmp_path):
    """With the reader's bounds switched off in the probe process, the
    overlapping-records file breaks the memory bound and the oracle says so."""
    if _sanitized() or crafted.hwm_resettable():
        pytest.skip("under ASan" if _sanitized() else crafted.hwm_resettable())
    data = crafted.overlapping_archive(150, 1 << 20)
    warm = tmp_path / "warm.pt"
    warm.write_bytes(reference)
    broken = crafted.MemoryProbe(str(warm), env={"FASTCKPT_PROBE_BREAK": "bounds"})
    try:
        with pytest.raises(AssertionError, match="grew the peak RSS"):
            _check_bounded(broken, data, tmp_path / "overlap.pt", verify=False)
    finally:
        broken.close()
