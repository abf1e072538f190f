"""fastckpt.load of a plain state dict unpickles data.pkl with CPython's C unpickler
(fastckpt.torchsave.plain), on the walk's verdict (PickleVerdict::plain): it must build exactly what
torch's weights-only unpickler builds, and for every other pickle (crafted ones included) the
outcome must be the one of torch's unpickler: the same object, or the same error, word for word.

The oracle is fastckpt.load itself with the plain path turned off (torch's unpickler on the same
records), and torch.load."""
import collections
import io
import pickle
import struct

import pytest
import torch

import fastckpt
import fastckpt.torchsave.load as _load
from fastckpt.formats import unpickler as _unpickle
from fastckpt.torchsave import plain as _plain

from states import assert_same


@pytest.fixture
def plain_calls(monkeypatch):
    """Counts the loads the plain path finished (it raised for the others)."""
    calls = {"ok": 0, "refused": 0}
    orig = _plain.load_plain

    def spy(*a, **k):
        try:
            out = orig(*a, **k)
        except Exception:
            calls["refused"] += 1
            raise
        calls["ok"] += 1
        return out
    monkeypatch.setattr(_load, "load_plain", spy)
    return calls


def _without_plain(path, **kw):
    orig = _load.load_plain

    def off(*a, **k):
        raise _plain.NotPlain("turned off by the test")
    _load.load_plain = off
    try:
        return fastckpt.load(path, **kw)
    finally:
        _load.load_plain = orig


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - compared below
        return ("error", type(e), str(e))


def _same_structure(a, b):
    """As an unpickler must build it: types, values, strides, offsets, requires_grad, _metadata."""
    assert_same(a, b, exact=True, exact_types=True, ordered=True, bitwise=True)


def _states():
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 6, generator=g)).sum().backward()
    opt.step()
    base = torch.randn(10, generator=g)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scalars": {f"s{i}": torch.tensor(float(i)) for i in range(300)},
        "values": {"int": 7, "neg": -3, "big": 2 ** 70, "float": 1.5, "none": None, "flags": [True, False],
                   "text": "ünïcode", "tuple": (1, (2, 3)), 5: "int key", ("a", 1): "tuple key"},
        "views": {"base": base, "tail": base[3:], "again": base},
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),
        "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
        "dtypes": [torch.randn(4, generator=g).to(d) for d in (torch.float16, torch.bfloat16, torch.int8,
                                                                 torch.int64, torch.bool, torch.complex64)],
        "grad": torch.randn(2, requires_grad=True),
        "empty": torch.empty(0, 4),
    }


@pytest.mark.parametrize("name", list(_states()))
def test_a_plain_state_loads_as_torch_loads_it(tmp_path, plain_calls, name):
    obj = _states()[name]
    p = tmp_path / "c.pt"
    fastckpt.save(obj, p)
    got = fastckpt.load(p)
    assert plain_calls == {"ok": 1, "refused": 0}
    _same_structure(got, torch.load(p))
    _same_structure(got, _without_plain(p))


def test_storages_are_shared_as_torch_shares_them(tmp_path, plain_calls):
    base = torch.arange(10.0)
    fastckpt.save({"a": base, "b": base[2:], "c": base}, tmp_path / "c.pt")
    got = fastckpt.load(tmp_path / "c.pt")
    assert plain_calls["ok"] == 1
    assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()
    assert got["a"] is got["c"]  # the memo: one object, as pickled
    got["a"][5] = -1
    assert got["b"][3] == -1


@pytest.mark.parametrize("where", ["cpu", torch.device("cpu"), None], ids=["str", "device", "none"])
def test_map_locations_that_keep_storages_on_the_cpu(tmp_path, plain_calls, where):
    fastckpt.save({"a": torch.ones(3), "b": torch.zeros(2)}, tmp_path / "c.pt")
    got = fastckpt.load(tmp_path / "c.pt", map_location=where)
    assert plain_calls["ok"] == 1
    _same_structure(got, torch.load(tmp_path / "c.pt", map_location=where))


def test_a_map_location_callable_is_called_as_torch_calls_it(tmp_path):
    fastckpt.save({"a": torch.ones(3), "b": torch.zeros(2), "a2": torch.ones(1)}, tmp_path / "c.pt")
    seen = {"fastckpt": [], "torch": []}

    def where(who):
        def f(storage, location):
            seen[who].append(location)
            return storage
        return f
    got = fastckpt.load(tmp_path / "c.pt", map_location=where("fastckpt"))
    _same_structure(got, torch.load(tmp_path / "c.pt", map_location=where("torch")))
    assert seen["fastckpt"] == seen["torch"] == ["cpu", "cpu", "cpu"]

    def fails(storage, location):
        raise KeyError("no such device here")
    with pytest.raises(KeyError, match="no such device here"):
        fastckpt.load(tmp_path / "c.pt", map_location=fails)


# ---------------------------------------------------------------- crafted pickles

def _archive(path, pkl: bytes, storages=(b"\x00" * 16,)):
    w = torch._C.PyTorchFileWriter(str(path))
    w.write_record("data.pkl", pkl, len(pkl))
    w.write_record("byteorder", b"little", 6)
    for i, s in enumerate(storages):
        w.write_record(f"data/{i}", s, len(s))
    w.write_record(".format_version", b"1", 1)
    w.write_end_of_file()


def _g(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _u(s):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


STORAGE = b"(" + _u("storage") + _g("torch", "FloatStorage") + _u("0") + _u("cpu") + b"K\x04tQ"  # pid, BINPERSID
TENSOR = _g("torch._utils", "_rebuild_tensor_v2") + b"(" + STORAGE + b"K\x00K\x04\x85K\x01\x85\x89" + \
    _g("collections", "OrderedDict") + b")RtR"

CRAFTED = {
    # plain by the walk, outside it only by value: torch's unpickler decides
    "a torch function as a value": b"\x80\x02}" + _u("f") + _g("torch", "load") + b"s.",
    "a torch module attribute that is no dtype": b"\x80\x02}" + _u("f") + _g("torch", "Tensor") + b"s.",
    "a persistent id that is no storage": b"\x80\x02(" + _u("module") + _u("x") + b"tQ.",
    "a storage of a record that is missing": b"\x80\x02" + TENSOR.replace(_u("0"), _u("7")) + b".",
    "a tensor past its storage": b"\x80\x02" + TENSOR.replace(b"K\x04\x85", b"K\x09\x85") + b".",
    "torch.Size of a non-iterable": b"\x80\x02" + _g("torch", "Size") + b"K\x03\x85R.",
    "an OrderedDict of a bad argument": b"\x80\x02" + _g("collections", "OrderedDict") + b"K\x03\x85R.",
    # outside the vocabulary by the walk
    "a call of a torch function": b"\x80\x02" + _g("torch", "load") + _u("x") + b"\x85R.",
    "BUILD of a tensor": b"\x80\x02" + TENSOR + b"(K\x01K\x02K\x03K\x04tb.",
    "SETITEM into a tensor": b"\x80\x02" + TENSOR + b"K\x00K\x01s.",
    "BUILD of an OrderedDict with slots": b"\x80\x02" + _g("collections", "OrderedDict") + b")R}}\x86b.",
    "a global outside the vocabulary": b"\x80\x02" + _g("builtins", "getattr") + b".",
    "protocol 4": b"\x80\x04}.",
    "a plain tensor": b"\x80\x02}" + _u("t") + TENSOR + b"s.",
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_pickle_has_torch_s_outcome(tmp_path, name):
    p = tmp_path / "c.pt"
    _archive(p, CRAFTED[name])
    plain = _outcome(lambda: fastckpt.load(p, verify=False))
    oracle = _outcome(lambda: _without_plain(p, verify=False))
    if oracle[0] == "ok":
        assert plain[0] == "ok", plain
        _same_structure(plain[1], oracle[1])
        _same_structure(plain[1], torch.load(p))
    else:
        assert plain == oracle
        with pytest.raises(Exception):
            torch.load(p)


def test_the_walk_s_verdicts():
    def verdict(pkl):
        got = []
        _unpickle.check(pkl, "x", plain=got)
        return got[0]
    assert verdict(CRAFTED["a plain tensor"]) and verdict(CRAFTED["a torch function as a value"])
    for name in ("a call of a torch function", "BUILD of a tensor", "SETITEM into a tensor",
                 "BUILD of an OrderedDict with slots", "a global outside the vocabulary", "protocol 4"):
        assert not verdict(CRAFTED[name]), name
    buf = io.BytesIO()
    pickle.dump(collections.OrderedDict(a=1), buf, protocol=2)
    assert verdict(buf.getvalue())
