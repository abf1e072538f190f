"""Every dtype of the one safetensors dtype table (fastckpt.formats.safetensors.ST_DTYPES) against
the installed safetensors package: files fastckpt writes read by it, files it writes read by
fastckpt, and per tensor the same header entry (dtype name and shape) and the same bytes. The
files differ only in padding (fastckpt starts the data on 4 KiB, safetensors on 8 bytes), so they
are compared tensor by tensor, not byte for byte.

F4 (torch.float4_e2m1fn_x2) packs two of the format's 4-bit values into one torch element: the
header's last dimension is twice torch's. Stock safetensors 0.8 reads F4 only with
``backend="mmap"`` and fails on empty F4 tensors with ``backend="pread"``, so it reads the
non-empty ones here with the mmap backend.
"""
import math

import pytest
import torch

import fastckpt
import fastckpt.safetensors as fst
from fastckpt.cli import main
from fastckpt.formats.safetensors import ST_DTYPES, ST_NAMES

st = pytest.importorskip("safetensors.torch", reason="the safetensors package is not installed")
from safetensors import SafetensorError  # noqa: E402

from leaks import temp_files  # noqa: E402
from st_files import crafted, header_of  # noqa: E402
from states import assert_same  # noqa: E402

F4 = getattr(torch, "float4_e2m1fn_x2", None)
needs_f4 = pytest.mark.skipif(F4 is None, reason="this torch has no float4_e2m1fn_x2")


def random_tensor(dtype, shape, seed=0):
    """A tensor of `dtype` and `shape` with random bytes (booleans 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
    hi = 2 if dtype == torch.bool else 256
    return torch.randint(0, hi, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def state_of(dtype, empty=True):
    """A few tensors of `dtype`: a matrix, a vector, a 0-d one (not for F4, which the format cannot
    hold 0-d) and, with `empty`, empty ones."""
    sd = {"m": random_tensor(dtype, (3, 4), 1), "v": random_tensor(dtype, (5,), 2)}
    if dtype != F4:
        sd["s"] = random_tensor(dtype, (), 3)
    if empty:
        sd.update({"e0": random_tensor(dtype, (0, 3)), "e1": random_tensor(dtype, (3, 0))})
    return sd


def entries(path):
    """name -> (header dtype, header shape, the tensor's bytes) of the file at `path`."""
    start, header = header_of(path)
    data = open(path, "rb").read()[start:]
    return {n: (e["dtype"], e["shape"], data[e["data_offsets"][0]:e["data_offsets"][1]])
            for n, e in header.items() if n != "__metadata__"}


def stock_save(sd, path):
    """safetensors' own save_file; a skip where the installed safetensors has no such dtype."""
    try:
        st.save_file(sd, str(path))
    except (SafetensorError, TypeError, ValueError, KeyError) as e:
        pytest.skip(f"the installed safetensors cannot save {next(iter(sd.values())).dtype}: {e}")


@pytest.mark.parametrize("name", sorted(ST_DTYPES))
def test_every_dtype_both_ways_and_the_same_header_entries(tmp_path, name):
    dtype = ST_DTYPES[name]
    sd = state_of(dtype)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    stock_save(sd, theirs)
    fst.save_file(sd, str(ours))
    mine, stock = entries(ours), entries(theirs)
    assert mine == stock
    assert {e[0] for e in mine.values()} == {name}
    for n, t in sd.items():
        assert mine[n][2] == t.reshape(-1).view(torch.uint8).numpy().tobytes(), n
    # stock reads the non-empty ones (see the module's docstring); fastckpt reads everything
    full = {n: t for n, t in sd.items() if t.numel()}
    got = st.load_file(str(ours), backend="mmap")
    assert_same({n: got[n] for n in full}, full, bitwise=True)
    assert_same(fst.load_file(str(theirs)), sd, bitwise=True)
    assert_same(fst.load_file(str(ours)), sd, bitwise=True)


@needs_f4
def test_f4_is_in_the_table_and_counts_values_in_the_header(tmp_path):
    assert ST_DTYPES["F4"] is F4 and ST_NAMES[F4] == "F4"
    t = torch.tensor([[0x12, 0x34, 0x56], [0x78, 0x9A, 0xFF]], dtype=torch.uint8).view(F4)
    p = tmp_path / "a.safetensors"
    fst.save_file({"w": t}, str(p))
    assert entries(p) == {"w": ("F4", [2, 6], bytes([0x12, 0x34, 0x56, 0x78, 0x9A, 0xFF]))}
    got = fst.load_file(str(p))["w"]
    assert got.dtype == F4 and got.shape == (2, 3)


@needs_f4
def test_f4_0d_is_refused_before_anything_is_written(tmp_path):
    t = torch.tensor(0x21, dtype=torch.uint8).view(F4)
    with pytest.raises(SafetensorError):
        st.save_file({"s": t}, str(tmp_path / "stock.safetensors"))
    p = tmp_path / "a.safetensors"
    with pytest.raises(ValueError, match="tensor `s`: a 0-d float4_e2m1fn_x2 tensor"):
        fst.save_file({"ok": torch.ones(2), "s": t}, str(p))
    d = tmp_path / "sharded"
    with pytest.raises(ValueError, match="tensor `s`"):
        fst.save_sharded({"ok": torch.ones(2), "s": t}, str(d))
    assert not p.exists() and not d.exists() and temp_files(tmp_path) == []


@needs_f4
@pytest.mark.parametrize("shape", [[2, 5], [3], [], [1]], ids=["odd-last-dim", "odd", "0-d", "one-value"])
def test_f4_entry_that_is_0d_or_odd_is_a_format_error(tmp_path, shape):
    nbytes = math.prod(shape) // 2
    p = tmp_path / "bad.safetensors"
    p.write_bytes(crafted({"w": {"dtype": "F4", "shape": shape, "data_offsets": [0, nbytes]}}, b"\0" * nbytes))
    with pytest.raises(SafetensorError):
        st.load_file(str(p))
    with pytest.raises(fastckpt.FormatError) as ei:
        fst.load_file(str(p))
    msg = str(ei.value)
    assert str(p) in msg and "'w'" in msg and f"shape {shape}" in msg and "multiple of 2" in msg


@needs_f4
def test_f4_empty_tensors_round_trip(tmp_path):
    sd = {f"e{i}": torch.empty(s, dtype=torch.uint8).view(F4) for i, s in enumerate([(0,), (0, 3), (3, 0), (2, 0, 4)])}
    p, q = tmp_path / "a.safetensors", tmp_path / "stock.safetensors"
    fst.save_file(sd, str(p))
    st.save_file(sd, str(q))
    assert entries(p) == entries(q) and entries(p)["e1"] == ("F4", [0, 6], b"")
    got = fst.load_file(str(p))
    assert {n: (t.dtype, tuple(t.shape)) for n, t in got.items()} == {n: (F4, tuple(t.shape)) for n, t in sd.items()}


def test_f6_dtypes_stay_unknown_without_a_torch_dtype(tmp_path):
    for name, torch_name in (("F6_E2M3", "float6_e2m3fn"), ("F6_E3M2", "float6_e3m2fn")):
        if hasattr(torch, torch_name):
            continue
        assert name not in ST_DTYPES
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(crafted({"w": {"dtype": name, "shape": [4], "data_offsets": [0, 3]}}, b"\0" * 3))
        with pytest.raises(fastckpt.FormatError, match=f"tensor 'w': unknown dtype '{name}'"):
            fst.load_file(str(p))


@needs_f4
def test_convert_a_torch_save_file_with_float4_to_safetensors(tmp_path, capsys):
    t = random_tensor(F4, (4, 3))
    src, dst = tmp_path / "a.pt", tmp_path / "a.safetensors"
    torch.save({"w": t, "b": torch.arange(3.0)}, src)
    assert main(["convert", str(src), str(dst)]) == 0, capsys.readouterr().err
    assert entries(dst)["w"] == ("F4", [4, 6], t.view(torch.uint8).numpy().tobytes())
    assert_same(st.load_file(str(dst), backend="mmap")["w"], t, bitwise=True)
    torch.save({"s": torch.tensor(7, dtype=torch.uint8).view(F4)}, tmp_path / "s.pt")
    assert main(["convert", str(tmp_path / "s.pt"), str(tmp_path / "s.safetensors")]) == 1
    assert "tensor `s`: a 0-d float4_e2m1fn_x2 tensor" in capsys.readouterr().err
    assert not (tmp_path / "s.safetensors").exists() and temp_files(tmp_path) == []
