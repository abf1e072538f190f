"""fastckpt.safetensors follows the installed safetensors.torch's signatures:
every function it mirrors takes the same parameters (names, kinds, defaults),
so code written for safetensors runs unchanged, and a new safetensors release
that adds a keyword fails here first."""
import inspect

import pytest
import torch

import fastckpt
import fastckpt.safetensors as fst

st = pytest.importorskip("safetensors.torch")
from safetensors import SafetensorError  # noqa: E402

MIRRORED = ("save", "load", "save_file", "load_file", "save_model", "load_model")


@pytest.mark.parametrize("name", MIRRORED)
def test_signature_matches_the_installed_safetensors(name):
    ours = inspect.signature(getattr(fst, name)).parameters
    theirs = inspect.signature(getattr(st, name)).parameters
    # theirs, in order; beyond them only keyword-only parameters with defaults (save_file's group=)
    assert list(ours)[:len(theirs)] == list(theirs), (name, list(ours), list(theirs))
    for extra in list(ours)[len(theirs):]:
        assert ours[extra].kind == inspect.Parameter.KEYWORD_ONLY and ours[extra].default is not inspect.Parameter.empty, \
            (name, extra)
    for p in theirs.values():
        q = ours[p.name]
        assert q.kind == p.kind, (name, p.name, q.kind, p.kind)
        assert q.default == p.default, (name, p.name, q.default, p.default)


def test_backend_is_accepted_and_checked_as_safetensors_checks_it(tmp_path):
    path = tmp_path / "m.safetensors"
    model = torch.nn.Linear(4, 3)
    st.save_model(model, str(path))
    for backend in fst.BACKENDS:
        got = fst.load_file(path, backend=backend)
        assert torch.equal(got["weight"], model.weight.detach()), backend
        other = torch.nn.Linear(4, 3)
        assert fst.load_model(other, path, backend=backend) == (set(), [])
        assert torch.equal(other.weight, model.weight)
    for bad, exc in (("foo", SafetensorError), ("MMAP", SafetensorError), (None, TypeError), (1, TypeError)):
        with pytest.raises(exc):
            st.load_file(str(path), backend=bad)
        with pytest.raises(exc):
            fst.load_file(path, backend=bad)
        with pytest.raises(exc):
            fst.load_model(torch.nn.Linear(4, 3), path, backend=bad)


def test_save_and_load_of_bytes_interchange_with_safetensors():
    """``save`` / ``load`` (bytes in memory), as safetensors.torch has them: each reads what the
    other writes; bad bytes are a FormatError (safetensors: its SafetensorError), never a crash or
    an allocation the bytes cannot account for."""
    import fastckpt.safetensors as fst
    stock = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(0)
    t = {"w": torch.randn(3, 4, generator=g), "i": torch.arange(5), "empty": torch.empty(0, 3),
         "scalar": torch.tensor(1.5, dtype=torch.bfloat16)}
    ours = fst.save(t, {"format": "pt"})
    assert isinstance(ours, bytes) and 8 + int.from_bytes(ours[:8], "little") == 4096  # fastckpt's layout
    for got in (stock.load(ours), fst.load(ours), fst.load(stock.save(t)), fst.load(bytearray(stock.save(t)))):
        assert set(got) == set(t)
        for k in t:
            assert got[k].dtype == t[k].dtype and got[k].shape == t[k].shape and torch.equal(got[k], t[k]), k
    f4 = {"f4": torch.arange(6, dtype=torch.uint8).reshape(2, 3).view(torch.float4_e2m1fn_x2)}
    assert torch.equal(fst.load(fst.save(f4))["f4"].view(torch.uint8), f4["f4"].view(torch.uint8))
    for bad in (ours[:100], ours[:8], b"", b"\xff" * 16, ours[:-1]):
        with pytest.raises(fastckpt.FormatError, match="<bytes>"):
            fst.load(bad)
    with pytest.raises(TypeError):
        fst.load("not bytes")
    shared = torch.ones(4)
    for call in (stock.save, fst.save):  # what safetensors.torch.save refuses, refused the same way
        with pytest.raises(RuntimeError):
            call({"a": shared, "b": shared[:2]})


def test_every_reader_and_writer_safetensors_torch_offers_is_here(tmp_path):
    """`from fastckpt.safetensors import X` works for every function safetensors.torch users import for
    files (safe_open was missing: safetensors' own, re-exported, reading fastckpt's files lazily)."""
    for name in ("save", "load", "save_file", "load_file", "save_model", "load_model", "safe_open"):
        assert callable(getattr(fst, name)), name
    from fastckpt.safetensors import safe_open
    fst.save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.int8)}, tmp_path / "x.st")
    with safe_open(str(tmp_path / "x.st"), framework="pt") as f:
        assert sorted(f.keys()) == ["a", "b"]
        assert torch.equal(f.get_slice("a")[1:], torch.arange(3.0, 6.0).reshape(1, 3))
        assert torch.equal(f.get_tensor("b"), torch.ones(2, dtype=torch.int8))
    with pytest.raises(AttributeError):
        fst.no_such_function
