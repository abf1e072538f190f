"""fastckpt.safetensors: the safetensors.torch API through the engine.

Files it writes are read by the real safetensors package unchanged, and it reads what that package
writes; it refuses what that package refuses, with the same exception types; saves are atomic
(a failed save leaves the previous file and no temporary); damaged or crafted files are a
FormatError, never more memory than the file's size; sharded Hugging Face checkpoints round-trip
and their index is the commit marker; device loads go through the staging pipeline (simulated
device).
"""
import errno
import json
import os
import random
import struct
import subprocess
import sys

import pytest
import torch

import fastckpt
from fastckpt import _C
import fastckpt.safetensors as fst

st = pytest.importorskip("safetensors.torch", reason="the safetensors package is not installed")
from safetensors import safe_open  # noqa: E402

import fastspawn  # noqa: E402
from sim_device import SimDevice  # noqa: E402
from states import assert_same  # noqa: E402
from st_files import crafted, header_of  # noqa: E402


def make_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(512, 64, generator=g),                # 128 KiB: a whole 4 KiB multiple
        "layer.0.weight": torch.randn(256, 256, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(255, generator=g).to(torch.float16),  # odd size
        "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "i8": torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (5, 3), dtype=torch.uint8, generator=g),
        "f64": torch.randn(3, 2, dtype=torch.float64, generator=g),
        "i32": torch.randint(0, 1 << 30, (9,), dtype=torch.int32, generator=g),
        "c64": torch.randn(4, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }



def test_files_read_by_safetensors_and_the_other_way(tmp_path):
    sd = make_state()
    ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
    fst.save_file(sd, ours, metadata={"format": "pt", "note": "ü"})
    st.save_file(sd, theirs, metadata={"format": "pt", "note": "ü"})
    assert_same(st.load_file(ours), sd)
    assert_same(fst.load_file(theirs), sd)
    assert_same(fst.load_file(ours), sd)
    with safe_open(ours, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "ü"}
    assert fst.load_metadata(theirs) == {"format": "pt", "note": "ü"}
    fst.save_file({"a": torch.ones(2)}, ours)  # no metadata: none in the file either, as safetensors does
    with safe_open(ours, framework="pt") as f:
        assert f.metadata() is None


def test_layout_is_aligned_for_direct_io(tmp_path):
    sd = make_state()
    p = str(tmp_path / "a.safetensors")
    fst.save_file(sd, p)
    start, header = header_of(p)
    assert start % 4096 == 0  # the data starts on a 4 KiB boundary
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        size = b - a
        if size and size % 4096 == 0:
            assert a % 4096 == 0, name  # whole 4 KiB tensors come first: each aligned
        assert a % sd[name].element_size() == 0, name
    loaded = fst.load_file(p)
    # each tensor has memory of its own (saving one of them alone does not drag the others along)
    ptrs = {t.untyped_storage().data_ptr() for t in loaded.values() if t.numel()}
    assert len(ptrs) == sum(1 for t in loaded.values() if t.numel())
    assert loaded["embed.weight"].untyped_storage().nbytes() == 512 * 64 * 4


def _refusals():
    base = torch.zeros(8)
    return [
        ("not a dict", [torch.zeros(2)], None),
        ("non-tensor", {"a": 3}, None),
        ("sparse", {"a": torch.zeros(3, 3).to_sparse()}, None),
        ("non-contiguous", {"a": torch.zeros(4, 4).t()}, None),
        ("shared", {"a": base, "b": base}, None),
        ("shared-overlap", {"a": base[:6], "b": base[4:]}, None),
        ("non-str key", {1: torch.zeros(2)}, None),
        ("non-str metadata", {"a": torch.zeros(2)}, {"k": 1}),
    ]


@pytest.mark.parametrize("what,tensors,metadata", _refusals(), ids=[r[0] for r in _refusals()])
def test_refuses_what_safetensors_refuses(tmp_path, what, tensors, metadata):
    p = tmp_path / "x.safetensors"
    with pytest.raises(Exception) as theirs:
        st.save_file(tensors, str(tmp_path / "theirs"), metadata=metadata)
    with pytest.raises(type(theirs.value)):
        fst.save_file(tensors, str(p), metadata=metadata)
    assert os.listdir(tmp_path) in ([], ["theirs"]) and not p.exists()


def test_disjoint_views_of_one_storage_are_saved_as_safetensors_saves_them(tmp_path):
    base = torch.arange(8.0)
    sd = {"a": base[:4], "b": base[4:]}
    st.save_file(sd, str(tmp_path / "t"))
    fst.save_file(sd, str(tmp_path / "o"))
    assert_same(st.load_file(str(tmp_path / "o")), {"a": torch.arange(4.0), "b": torch.arange(4.0, 8.0)})


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(16)


def test_models_with_tied_weights_both_ways(tmp_path):
    torch.manual_seed(0)
    m = Tied()
    ours, theirs = str(tmp_path / "o.safetensors"), str(tmp_path / "t.safetensors")
    fst.save_model(m, ours)
    st.save_model(m, theirs)
    with safe_open(ours, framework="pt") as a, safe_open(theirs, framework="pt") as b:
        assert sorted(a.keys()) == sorted(b.keys()) and a.metadata() == b.metadata()
    for saved in (ours, theirs):
        for loader in (fst.load_model, st.load_model):
            m2 = Tied()
            missing, unexpected = loader(m2, saved)
            assert (set(missing), unexpected) == (set(), [])
            assert m2.head.weight is m2.embed.weight
            for k, v in m.state_dict().items():
                assert torch.equal(m2.state_dict()[k], v), (saved, loader, k)
    with pytest.raises(RuntimeError, match="Missing key"):
        fst.load_model(torch.nn.Sequential(torch.nn.Linear(16, 16)), ours)
    missing, unexpected = fst.load_model(torch.nn.Sequential(torch.nn.Linear(16, 16)), ours, strict=False)
    assert missing == {"0.bias", "0.weight"} and "norm.weight" in unexpected


@pytest.mark.parametrize("fault", ["ENOSPC", "EIO", "short"])
def test_failed_save_leaves_the_previous_file(tmp_path, fault):
    p = str(tmp_path / "m.safetensors")
    old = {"w": torch.ones(300, 300)}
    fst.save_file(old, p)
    before = open(p, "rb").read()
    # From the second write of the new file (10 MB: more than one staging buffer), so that part of
    # it is written when the fault comes; a 100-byte transfer is refused by O_DIRECT (EINVAL), an
    # error there (the first write would take it for a filesystem refusing O_DIRECT: a fallback).
    if fault == "short":
        _C.fault_inject("write", nth=2, short=100, times=1000)
    else:
        _C.fault_inject("write", nth=2, errno=getattr(errno, fault))
    try:
        with pytest.raises(OSError) as ei:
            fst.save_file({"w": torch.zeros(1600, 1600)}, p)
    finally:
        _C.fault_clear()
    assert p in str(ei.value) and ei.value.filename == p
    if fault != "short":
        assert ei.value.errno == getattr(errno, fault)
    assert open(p, "rb").read() == before
    assert os.listdir(tmp_path) == ["m.safetensors"]  # no temporary left


def test_save_refuses_bad_targets_naming_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        fst.save_file({"a": torch.ones(1)}, str(tmp_path / "nope" / "x.safetensors"))
    with pytest.raises(IsADirectoryError):
        fst.save_file({"a": torch.ones(1)}, str(tmp_path))


def _valid_file(tmp_path):
    p = str(tmp_path / "v.safetensors")
    st.save_file({"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.int16)}, p)
    return p, open(p, "rb").read()


@pytest.mark.parametrize("case", ["truncated-data", "truncated-header", "huge-header-length", "offsets-past-end",
                                  "overlap", "gap", "trailing", "bad-dtype", "shape-mismatch", "not-json",
                                  "negative-shape", "empty"])
def test_damaged_and_crafted_files_are_format_errors(tmp_path, case):
    p, good = _valid_file(tmp_path)
    (n,) = struct.unpack("<Q", good[:8])
    data = good[8 + n:]
    a = {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}
    b = {"dtype": "I16", "shape": [3, 5], "data_offsets": [256, 286]}
    bad = {
        "truncated-data": good[:-7],
        "truncated-header": good[:8 + n // 2],
        "huge-header-length": struct.pack("<Q", 1 << 60) + good[8:],
        "offsets-past-end": crafted({"a": a, "b": dict(b, data_offsets=[256, 1 << 40])}, data),
        "overlap": crafted({"a": a, "b": dict(b, data_offsets=[250, 280])}, data),
        "gap": crafted({"a": a, "b": dict(b, data_offsets=[262, 292])}, data + b"\0" * 6),
        "trailing": data and crafted({"a": a, "b": b}, data + b"junk"),
        "bad-dtype": crafted({"a": dict(a, dtype="F99"), "b": b}, data),
        "shape-mismatch": crafted({"a": dict(a, shape=[1 << 40]), "b": b}, data),
        "not-json": struct.pack("<Q", 5) + b"{nope" + data,
        "negative-shape": crafted({"a": dict(a, shape=[-64]), "b": b}, data),
        "empty": b"",
    }[case]
    q = tmp_path / f"{case}.safetensors"
    q.write_bytes(bad)
    with pytest.raises(fastckpt.FormatError) as ei:
        fst.load_file(str(q))
    assert str(q) in str(ei.value)


def test_random_damage_never_escapes_as_anything_else(tmp_path):
    """Header bytes flipped at random: a FormatError or a correct-shaped result, never another error,
    never more memory than the file (the loader checks every offset against the file before allocating)."""
    p, good = _valid_file(tmp_path)
    (n,) = struct.unpack("<Q", good[:8])
    rng = random.Random(7)
    q = tmp_path / "d.safetensors"
    outcomes = set()
    for _ in range(300):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(0, 8 + n)] = rng.randrange(256)
        q.write_bytes(bytes(b))
        try:
            got = fst.load_file(str(q))
        except fastckpt.FormatError:
            outcomes.add("format")
            continue
        outcomes.add("loaded")
        assert sum(t.numel() * t.element_size() for t in got.values()) <= len(b)
    assert "format" in outcomes


def test_missing_file_is_an_oserror_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError) as ei:
        fst.load_file(str(tmp_path / "none.safetensors"))
    assert ei.value.filename == str(tmp_path / "none.safetensors")


def test_sharded_checkpoint_round_trip_and_read_by_safetensors(tmp_path):
    sd = {f"layers.{i}.weight": torch.randn(128, 128) for i in range(10)}  # 64 KiB each
    d = tmp_path / "ckpt"
    shards = fst.save_sharded(sd, d, max_shard_size="200KB")
    assert sorted(os.listdir(d)) == sorted(list(shards) + ["model.safetensors.index.json"])
    assert len(shards) == 4 and list(shards)[0] == "model-00001-of-00004.safetensors"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 10 * 128 * 128 * 4
    for name, f in index["weight_map"].items():
        assert torch.equal(st.load_file(str(d / f))[name], sd[name])  # each shard readable by safetensors
    assert_same(fst.load_sharded(d), sd)
    # one shard: a plain model.safetensors, no index
    one = tmp_path / "one"
    assert list(fst.save_sharded(sd, one)) == ["model.safetensors"]
    assert os.listdir(one) == ["model.safetensors"]
    assert_same(fst.load_sharded(one), sd)


def test_sharded_save_failing_midway_leaves_no_index_naming_a_mix(tmp_path):
    d = tmp_path / "ckpt"
    old = {f"w{i}": torch.full((128, 128), float(i)) for i in range(6)}
    fst.save_sharded(old, d, max_shard_size="100KB")
    _C.fault_inject("write", nth=5, errno=errno.ENOSPC)
    try:
        with pytest.raises(OSError) as ei:
            fst.save_sharded({k: v + 100 for k, v in old.items()}, d, max_shard_size="100KB")
    finally:
        _C.fault_clear()
    assert ei.value.errno == errno.ENOSPC
    # failed before any rename: the previous checkpoint is whole, and no temporary is left
    assert_same(fst.load_sharded(d), old)
    assert not [f for f in os.listdir(d) if not f.startswith("model")]


_MANY_SHARDS = r"""
import sys, torch
import fastckpt.safetensors as fst
from fastckpt import _C
sd = {f"t{i}": torch.full((65536,), float(i)) for i in range(24)}  # 24 shards of 256 KiB
_C.fault_inject("write", nth=1, delay_ms=20, times=0)  # completions come late: writers hold buffers
fst.save_sharded(sd, sys.argv[1], max_shard_size="300KB")
_C.fault_clear()
got = fst.load_sharded(sys.argv[1])
assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
print("OK", len(got))
"""


def test_sharded_save_of_more_shards_than_staging_buffers_finishes(tmp_path):
    # More shards than the engine has staging buffers, written by a pool of threads: a shard
    # written but left uncommitted keeps buffers, so every pool thread's next shard would wait
    # for one forever (a hang, seen in the crash driver's resave_st under load). Each shard is
    # committed inside the new directory as soon as it is written.
    env = dict(os.environ, FASTCKPT_BUFFER_COUNT="4")
    try:
        r = fastspawn.run([sys.executable, "-c", _MANY_SHARDS, str(tmp_path / "m")], env=env,
                          capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("save_sharded of 24 shards with 4 staging buffers hung")
    assert r.returncode == 0 and "OK 24" in r.stdout, r.stdout + r.stderr


def test_sharded_index_naming_the_wrong_shard_is_a_format_error(tmp_path):
    d = tmp_path / "ckpt"
    sd = {f"w{i}": torch.ones(128, 128) for i in range(4)}
    fst.save_sharded(sd, d, max_shard_size="100KB")
    ip = d / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    index["weight_map"]["w0"], index["weight_map"]["w3"] = index["weight_map"]["w3"], index["weight_map"]["w0"]
    ip.write_text(json.dumps(index))
    with pytest.raises(fastckpt.FormatError, match="maps to"):
        fst.load_sharded(d)
    index["weight_map"]["w0"] = "../../etc/passwd"
    ip.write_text(json.dumps(index))
    with pytest.raises(fastckpt.FormatError, match="not a file name"):
        fst.load_sharded(d)
    ip.write_text("{]")
    with pytest.raises(fastckpt.FormatError, match="not a safetensors index"):
        fst.load_sharded(d)


@pytest.mark.parametrize("seed", [0, 1])
def test_load_onto_a_device_goes_through_staging(tmp_path, seed, monkeypatch):
    from fastckpt.staging import device as _staging
    monkeypatch.setattr(_staging, "default_chunk", lambda: 64 << 10)
    sd = make_state(seed)
    p = str(tmp_path / "a.safetensors")
    fst.save_file(sd, p)
    with SimDevice(seed=seed, max_delay=0.002) as sim:
        got = fst.load_file(p, device="sim:0")
        for k, t in got.items():
            if t.numel():
                assert sim.device_index(t) == 0, k
        sim.close()
        assert not sim.violations
        host = {k: v.clone() for k, v in got.items()}
    assert_same(host, sd)


def test_a_file_whose_tensors_are_misaligned_loads_them_into_aligned_memory(tmp_path):
    """A header whose length leaves the data 1 byte past a multiple of 8 (safetensors' writers pad it;
    a file need not): the tensors whose elements that misaligns get memory of their own, aligned;
    the bytes are the file's, and the one-byte dtypes stay in the block."""
    g = torch.Generator().manual_seed(3)
    sd = {"f": torch.randn(3000, generator=g), "d": torch.randn(100, dtype=torch.float64, generator=g),
          "u": torch.randint(0, 255, (77,), dtype=torch.uint8, generator=g)}
    header, data = {}, b""
    for k in ("u", "f", "d"):
        raw = sd[k].numpy().tobytes()
        header[k] = {"dtype": {"u": "U8", "f": "F32", "d": "F64"}[k], "shape": list(sd[k].shape),
                     "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    pad = 0
    while (len(crafted(dict(header, __metadata__={"pad": "x" * pad}))) % 8) != 1:  # data_start: 1 mod 8
        pad += 1
    blob = crafted(dict(header, __metadata__={"pad": "x" * pad}), data)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(blob)
    data_start, _ = header_of(path)
    assert data_start % 8 == 1
    got = fst.load_file(path)
    assert_same(got, sd)
    assert all(got[k].data_ptr() % got[k].element_size() == 0 for k in sd)
    assert got["u"].data_ptr() % 4096 == data_start % 4096  # in the block, at the file's phase


def test_safetensors_own_file_is_read_straight_into_the_tensors(tmp_path, monkeypatch):
    """safetensors packs its tensors at unaligned offsets: the tensors get one block of memory laid
    out as the file's data is, at its phase within a page, so the engine reads the data's aligned
    body O_DIRECT straight in, in one range, and stages only its head and tail; every tensor still
    has a storage of its own size."""
    from engines import drop_page_cache, record_reads
    from fastckpt.formats.zip import DIRECT_MIN
    g = torch.Generator().manual_seed(9)
    # b of 4 floats: d starts 4 bytes past a multiple of 8 (its phase is kept: float32 needs 4)
    sd = {"a": torch.randn(70001, generator=g), "b": torch.randn(4, generator=g),
          "c": torch.randn(40000, generator=g).to(torch.bfloat16), "d": torch.randn(250000, generator=g)}
    path = tmp_path / "theirs.safetensors"
    st.save_file(sd, path)
    data_start, header = header_of(path)
    drop_page_cache(path)
    calls = record_reads(monkeypatch)
    got = fst.load_file(path)
    assert_same(got, sd)
    big = [k for k, v in sd.items() if v.numel() * v.element_size() >= DIRECT_MIN]
    offs = {k: data_start + header[k]["data_offsets"][0] for k in big}
    assert any(o % 8 for o in offs.values()), offs  # the case of an offset that is not a multiple of 8
    for k in big:
        assert offs[k] % sd[k].element_size() == 0, (k, offs[k])  # safetensors keeps dtypes aligned
        assert got[k].data_ptr() % 4096 == offs[k] % 4096, k
    first = min(sd, key=lambda k: header[k]["data_offsets"][0])
    for k in sd:  # one block, as the file lays it out; a storage of each tensor's own
        assert got[k].data_ptr() - got[first].data_ptr() == header[k]["data_offsets"][0], k
        assert got[k].untyped_storage().nbytes() == sd[k].numel() * sd[k].element_size(), k
    reads = [c for c in calls if c.get("bytes_read")]
    if not any(c.get("direct") for c in reads):
        pytest.skip(f"no O_DIRECT reads on this filesystem ({tmp_path})")
    assert len(reads) == 1 and reads[0]["direct_requests"] >= 1
    assert reads[0]["staged_bytes"] <= 2 * 4096  # the head and the tail only
    assert sum(c["bytes_read"] for c in reads) <= os.path.getsize(path) + 2 * 4096
