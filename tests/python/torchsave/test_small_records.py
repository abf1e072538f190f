"""Small records packed (docs/FORMAT.md 1.3): storage records of 64 KiB or more
start on a multiple of 4096 (O_DIRECT straight into place), the others are
packed at torch's alignment (64), and the file stays a stock torch.save archive
that stock torch.load reads, with mmap=True and with torch's own offset
arithmetic (calculate_storage_offsets, map_location="meta") too.

No timing assertions here: the speed of many small tensors is measured by
benchmarks/bench_small.py."""

import io
import json
import os
import pickle
import zipfile
import zlib

import pytest
import torch
from torch.utils.serialization import config as torch_config

import fastckpt
from fastckpt import _C
from fastckpt.formats import zip as _zip
from fastckpt._core.engine import get_engine

from zip_layout import DIRECT_MIN, assert_layout_rule, record_layout  # noqa: E402


def layout(path):
    return record_layout(path, verify_crcs=True)


def check_rule(path, alignment=64):
    return assert_layout_rule(path, alignment, verify_crcs=True)


def mixed_state():
    """Sizes around the threshold, shared storages, views, many dtypes."""
    g = torch.Generator().manual_seed(12)
    base = torch.randn(DIRECT_MIN // 4 + 7, generator=g)  # just above the threshold
    sd = {
        "below": torch.randn(DIRECT_MIN // 4 - 1, generator=g),  # 65532 bytes: packed
        "at": torch.randint(0, 255, (DIRECT_MIN,), dtype=torch.uint8, generator=g),  # aligned
        "above": torch.randint(-9, 9, (DIRECT_MIN + 1,), dtype=torch.int8, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0),
        "base": base,
        "view": base[5:100].view(5, 19),
        "strided": base[::3],
        "tied": {"a": base, "b": base},
        "bias": torch.randn(7, generator=g),
        "big": torch.randn(1 << 18, generator=g),  # 1 MiB
        "step": 100,
    }
    for i, dt in enumerate([torch.float16, torch.bfloat16, torch.float64, torch.int16, torch.int32,
                            torch.int64, torch.bool, torch.complex64, torch.uint16, torch.float8_e4m3fn]):
        t = torch.randn(3 + i, 5, generator=g)
        sd[f"d{i}"] = (t > 0) if dt is torch.bool else t.to(dt)
        sd[f"d{i}_big"] = torch.zeros(DIRECT_MIN // 2 + i, dtype=torch.float16 if dt.is_floating_point else torch.int16)
    return sd


def same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    else:
        assert a == b


def test_mixed_layout_is_read_by_stock_torch(tmp_path):
    sd = mixed_state()
    p = tmp_path / "m.pt"
    fastckpt.save(sd, p)
    lay = check_rule(p)
    data = {n: v for n, v in lay.items() if n.startswith("data/")}
    assert any(size >= DIRECT_MIN for _, size, _ in data.values())
    raw = p.read_bytes()
    assert all(zlib.crc32(raw[off:off + size]) == crc for off, size, crc in lay.values())
    for kw in ({}, {"mmap": True}, {"weights_only": False}, {"mmap": True, "weights_only": False}):
        got = torch.load(p, **kw)
        same(sd, got)
        assert got["tied"]["a"] is got["tied"]["b"]
        assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    # torch's own offset arithmetic: with calculate_storage_offsets (mmap) and for meta tensors
    with torch_config.patch({"load.calculate_storage_offsets": True}):
        same(sd, torch.load(p, mmap=True))
    os.environ["TORCH_SERIALIZATION_DEBUG"] = "1"  # torch checks every offset it computes
    try:
        same(sd, torch.load(p))
    finally:
        del os.environ["TORCH_SERIALIZATION_DEBUG"]
    meta = torch.load(p, map_location="meta")
    offsets = {off for off, _, _ in data.values()}
    for k in ("below", "at", "above", "big", "scalar"):
        assert meta[k].untyped_storage()._checkpoint_offset in offsets, k
    # fastckpt reads it too, checked
    same(sd, fastckpt.load(p, verify=True))
    same(sd, fastckpt.load(p, mmap=True))


def test_file_object_gets_the_same_layout(tmp_path):
    sd = mixed_state()
    fastckpt.save(sd, tmp_path / "p.pt")
    buf = io.BytesIO()
    fastckpt.save(sd, buf)
    (tmp_path / "b.pt").write_bytes(buf.getvalue())
    a, b = check_rule(tmp_path / "p.pt"), check_rule(tmp_path / "b.pt")
    a.pop(".data/serialization_id"), b.pop(".data/serialization_id")
    assert a == b
    same(sd, torch.load(io.BytesIO(buf.getvalue())))


def test_many_scalars_file_size_close_to_torch_save(tmp_path):
    """100k scalars made a 424 MB file (torch.save: 27 MB) when every record was
    4 KiB-aligned; packed, the file is within 1.3 times torch.save's."""
    sd = {f"t{i}": torch.tensor(float(i)) for i in range(20000)}
    fastckpt.save(sd, tmp_path / "f.pt")
    torch.save(sd, tmp_path / "t.pt")
    f, t = os.path.getsize(tmp_path / "f.pt"), os.path.getsize(tmp_path / "t.pt")
    assert f <= 1.3 * t, (f, t)
    check_rule(tmp_path / "f.pt")
    got = fastckpt.load(tmp_path / "f.pt", verify=True)
    assert len(got) == len(sd) and all(got[k].item() == sd[k].item() for k in ("t0", "t1", "t19999"))
    got = torch.load(tmp_path / "f.pt", mmap=True)
    assert got["t12345"].item() == 12345.0


def test_small_model_with_large_params(tmp_path):
    """A model of many small parameters (norms, biases) and a few large ones:
    800 small storages would take 3.2 MB of padding on 4 KiB next to 1.7 MB of
    data, so the file keeps torch.save's alignment and stays close to its size."""
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32))
                              for _ in range(200)])
    sd = m.state_dict()
    sd["embed"] = torch.randn(1000, 64)
    sd["head"] = torch.randn(64, 2000)
    fastckpt.save(sd, tmp_path / "f.pt")
    torch.save(sd, tmp_path / "t.pt")
    lay = check_rule(tmp_path / "f.pt")
    big = [off for n, (off, size, _) in lay.items() if n.startswith("data/") and size >= DIRECT_MIN]
    assert len(big) == 2
    assert os.path.getsize(tmp_path / "f.pt") <= 1.3 * os.path.getsize(tmp_path / "t.pt")
    same(dict(sd), dict(fastckpt.load(tmp_path / "f.pt", verify=True)))
    same(dict(sd), dict(torch.load(tmp_path / "f.pt", mmap=True)))


def test_large_records_are_read_with_direct_io(tmp_path):
    """The point of aligning large records: the engine reads them with O_DIRECT
    straight into an aligned destination, no staging copy."""
    sd = {"small": torch.ones(3), "big": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(2)}
    p = tmp_path / "d.pt"
    fastckpt.save(sd, p)
    arch = _zip.Archive.open(str(p))
    e = arch.records["data/1"]
    assert e.size == 4 << 20 and e.data_offset % 4096 == 0
    raw = torch.empty(e.size + 4096, dtype=torch.uint8)
    dst = raw[(-raw.data_ptr()) % 4096:][:e.size]
    st = _C.read_ranges(get_engine(), str(p), [(dst, e.data_offset)], -1)
    if not st["direct"]:
        pytest.skip(f"O_DIRECT is refused on {tmp_path}'s filesystem")
    assert st["direct_requests"] >= 1 and st["bytes_read"] == e.size
    assert torch.equal(dst.view(torch.float32), sd["big"])


def test_inspect_and_verify_packed_file(tmp_path, capsys):
    from fastckpt.cli import main
    sd = {f"p{i}": torch.full((i % 5 + 1,), float(i)) for i in range(200)}  # 800 KiB of padding: < 1 MiB
    sd["w"] = torch.randn(128, 128)
    p = tmp_path / "s.pt"
    fastckpt.save(sd, p)
    assert main(["inspect", "--json", str(p)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["format"] == "fastckpt"
    assert rep["archive"]["alignment"] == 4096 and rep["archive"]["large_alignment"] == 4096
    assert main(["verify", str(p)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")
    # a flipped byte in a packed record is found and named
    off, size, _ = layout(p)["data/17"]
    assert off % 4096 != 0 or size < DIRECT_MIN
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["verify", str(p)]) == 1
    assert "p17" in capsys.readouterr().out
    with pytest.raises(fastckpt.FormatError, match="p17"):
        fastckpt.load(p, verify=True)
    # a stock torch.save file of small tensors is reported as torch's
    torch.save(sd, tmp_path / "t.pt")
    assert main(["inspect", "--json", str(tmp_path / "t.pt")]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "torch"


def test_torch_layout_keeps_format_version(tmp_path):
    """write_archive(direct_min=None) (fastckpt convert --to torch) writes
    torch.save's own layout, .format_version included: torch's offset
    arithmetic holds there."""
    from fastckpt.formats.pickler import pickle_with_storages
    from fastckpt.torchsave.writer import write_archive
    sd = mixed_state()
    pkl, storages = pickle_with_storages(sd, pickle, 2)
    p = tmp_path / "t.pt"
    write_archive(str(p), pkl, storages, alignment=64, direct_min=None)
    lay = layout(p)
    assert ".format_version" in lay and all(off % 64 == 0 for off, _, _ in lay.values())
    os.environ["TORCH_SERIALIZATION_DEBUG"] = "1"
    try:
        same(sd, torch.load(p))
    finally:
        del os.environ["TORCH_SERIALIZATION_DEBUG"]
    assert not _zip.is_fastckpt_layout(_zip.Archive.open(str(p)).records, 64)


# ------------------------------------------------- memory the loaded storages get

def test_large_storages_load_into_aligned_memory_of_their_own(tmp_path):
    """Storages of DIRECT_MIN bytes or more are read O_DIRECT straight into
    4 KiB-aligned memory (no copy out of staging); each is a storage of its own,
    exactly its size and, as torch.load's, not resizable; small ones take torch's
    allocator (no page per scalar)."""
    path = str(tmp_path / "m.pt")
    big = torch.arange(300_000, dtype=torch.float32)           # 1.2 MB
    mid = torch.arange(DIRECT_MIN // 8, dtype=torch.float64)   # exactly DIRECT_MIN bytes
    small = torch.arange(10, dtype=torch.int64)
    view = big[1000:2000]                                      # shares big's storage
    fastckpt.save({"big": big, "mid": mid, "small": small, "view": view}, path)
    for verify in (None, False):
        got = fastckpt.load(path, verify=verify)
        for k in ("big", "mid", "small", "view"):
            assert torch.equal(got[k], {"big": big, "mid": mid, "small": small, "view": view}[k]), k
        for k in ("big", "mid"):
            st = got[k].untyped_storage()
            assert st.data_ptr() % 4096 == 0, k
            assert st.nbytes() == got[k].nbytes, k
            assert not st.resizable(), k  # as torch.load's storages (test_stretched_tensors.py)
        # the view shares the loaded storage, as with torch.load
        assert got["view"].untyped_storage().data_ptr() == got["big"].untyped_storage().data_ptr()
        assert got["small"].untyped_storage().nbytes() == 80
        # as torch.load's, the storage cannot grow; a clone can
        t = got["mid"]
        # (on a view of its own: torch sets the new sizes before it tries to grow the storage, so
        # the tensor it refused keeps twice its storage's size, and reading it reads past the
        # storage; here, memory of its own, that is an unmapped page and a segfault)
        with pytest.raises(RuntimeError, match="not resizable"):
            t.view_as(t).resize_(t.numel() * 2)
        assert t.shape == mid.shape
        c = t.clone()
        c.resize_(t.numel() * 2)
        assert torch.equal(c[:mid.numel()], mid)
        # the memory is writable and independent of the other storages
        got["big"].zero_()
        assert torch.equal(got["view"], torch.zeros(1000))
        assert torch.equal(got["mid"][:mid.numel()], mid)


@pytest.mark.parametrize("prefault", [True, False])
def test_load_same_with_and_without_the_prefault_helper(tmp_path, prefault):
    """knob prefault (FASTCKPT_PREFAULT): the helper thread that faults a load's
    memory in ahead of its O_DIRECT reads changes no byte and no check."""
    path = str(tmp_path / "p.pt")
    sd = {f"w{i}": torch.randn(1 << 20) for i in range(6)}  # 24 MiB: above the helper's 16 MiB
    fastckpt.save(sd, path)
    with fastckpt.knobs.override(prefault=prefault):
        assert fastckpt.knobs.config().prefault is prefault
        got = fastckpt.load(path)
        for k, v in sd.items():
            assert torch.equal(got[k], v), k
        # and a damaged byte is still found
        raw = bytearray(open(path, "rb").read())
        with zipfile.ZipFile(path) as z:
            info = [i for i in z.infolist() if i.filename.endswith("data/3")][0]
        lay = layout(path)
        start = lay[info.filename.split("/", 1)[1]][0]
        raw[start + 12345] ^= 1
        bad = str(tmp_path / "bad.pt")
        open(bad, "wb").write(bytes(raw))
        with pytest.raises(fastckpt.FormatError, match="checksum"):
            fastckpt.load(bad)
