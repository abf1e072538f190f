"""fastckpt.save / fastckpt.load against torch.save / torch.load.

Parity in every direction (fastckpt -> torch, torch -> fastckpt, fastckpt ->
fastckpt), compared bitwise with a recursive ``assert_same`` that also checks
Python structure and the storage-sharing graph; the archive layout (stock zip,
valid CRCs, 4 KiB-aligned records); map_location; weights_only against
malicious pickles; verify=True; corrupt, truncated and foreign files; injected
I/O faults; CUDA (skipped without a device); torch's legacy format.
"""
import collections
import errno
import io
import math
import os
import pickle
import random
import struct
import sys
import threading
import warnings
import zipfile
import zlib

import pytest
import torch
from torch import nn

import fastckpt
from fastckpt import _C
from leaks import fd_count, fd_table, temp_files

pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
    pytest.mark.filterwarnings("ignore:Detected pickle protocol"),
    pytest.mark.filterwarnings("ignore:.*quantize_per_tensor.*deprecated"),
]

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a dependency of the venv
    np = None


# ---------------------------------------------------------------- comparison

def _storage_bytes(s) -> torch.Tensor:
    """The whole storage (not just a tensor's view of it) as uint8 on the CPU."""
    if isinstance(s, torch.storage.TypedStorage):
        s = s._untyped_storage
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).cpu()


def _same_float(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b)  # bitwise: NaN == NaN, -0.0 != 0.0


def _same_tensor(a: torch.Tensor, b: torch.Tensor, path: str, device) -> None:
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.layout == b.layout, f"{path}: layout {a.layout} != {b.layout}"
    assert a.requires_grad == b.requires_grad, f"{path}: requires_grad {a.requires_grad} != {b.requires_grad}"
    assert (a.device if device is None else torch.device(device)) == b.device, f"{path}: device {a.device} != {b.device}"
    assert a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg(), f"{path}: conj/neg bits differ"
    _same(getattr(a, "__dict__", {}), getattr(b, "__dict__", {}), f"{path}.__dict__", device)
    if a.layout == torch.sparse_coo:
        _same(a._indices(), b._indices(), f"{path}._indices()", device)
        _same(a._values(), b._values(), f"{path}._values()", device)
        return
    if a.layout == torch.sparse_csr:
        _same(a.crow_indices(), b.crow_indices(), f"{path}.crow_indices()", device)
        _same(a.col_indices(), b.col_indices(), f"{path}.col_indices()", device)
        _same(a.values(), b.values(), f"{path}.values()", device)
        return
    assert a.stride() == b.stride(), f"{path}: stride {a.stride()} != {b.stride()}"
    assert a.storage_offset() == b.storage_offset(), f"{path}: storage_offset {a.storage_offset()} != {b.storage_offset()}"
    assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes(), f"{path}: storage sizes differ"
    if a.is_quantized:
        assert a.qscheme() == b.qscheme(), f"{path}: qscheme"
        if a.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            assert _same_float(a.q_scale(), b.q_scale()) and a.q_zero_point() == b.q_zero_point(), f"{path}: qparams"
        else:
            _same(a.q_per_channel_scales(), b.q_per_channel_scales(), f"{path}.scales", None)
            _same(a.q_per_channel_zero_points(), b.q_per_channel_zero_points(), f"{path}.zero_points", None)
            assert a.q_per_channel_axis() == b.q_per_channel_axis(), f"{path}: axis"
    if a.device.type == "meta" or b.device.type == "meta":
        return
    # Whole storages compared byte for byte, and with equal geometry the views too
    # (dtype-agnostic: float8, bits, complex32, NaN payloads all compare exactly).
    assert torch.equal(_storage_bytes(a.untyped_storage()), _storage_bytes(b.untyped_storage())), \
        f"{path}: data differs"


def _same(a, b, path="<root>", device=None) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{path}: {type(a)} vs {type(b)}"
        return _same_tensor(a, b, path, device)
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, (torch.storage.TypedStorage, torch.UntypedStorage)):
        if isinstance(a, torch.storage.TypedStorage):
            assert a.dtype == b.dtype, f"{path}: storage dtype {a.dtype} != {b.dtype}"
        assert a.nbytes() == b.nbytes(), f"{path}: storage nbytes {a.nbytes()} != {b.nbytes()}"
        if a.device.type != "meta" and b.device.type != "meta":
            assert torch.equal(_storage_bytes(a), _storage_bytes(b)), f"{path}: storage data differs"
    elif isinstance(a, dict):  # dict, OrderedDict, defaultdict: same keys in the same order
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]", device)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]", device)
    elif isinstance(a, float):
        assert _same_float(a, b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, complex):
        assert _same_float(a.real, b.real) and _same_float(a.imag, b.imag), f"{path}: {a!r} != {b!r}"
    elif np is not None and isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), f"{path}: arrays differ"
    elif isinstance(a, nn.Module):
        _same(a.state_dict(keep_vars=True), b.state_dict(keep_vars=True), f"{path}.state_dict()", device)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _same(vars(a), vars(b), f"{path}.__dict__", device)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _walk_tensors(o, out, seen):
    """Tensors and storages in `o`, in a deterministic order (dict order, list order)."""
    if isinstance(o, (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)):
        out.append(o)
        if isinstance(o, torch.Tensor) and o.layout == torch.sparse_coo:
            out.extend([o._indices(), o._values()])
        return
    if id(o) in seen:
        return
    seen.add(id(o))
    if isinstance(o, dict):
        for v in o.values():
            _walk_tensors(v, out, seen)
    elif isinstance(o, (list, tuple)):
        for v in o:
            _walk_tensors(v, out, seen)
    elif isinstance(o, nn.Module):
        _walk_tensors(list(o.state_dict(keep_vars=True).values()), out, seen)
    elif hasattr(o, "__dict__") and not isinstance(o, type):
        _walk_tensors(vars(o), out, seen)


def sharing_graph(o):
    """For each tensor or storage in `o`, in order: (index of the first object it is
    identical to, index of the first object whose storage it shares, its byte
    offset into that storage). Equal graphs mean equal aliasing."""
    items = []
    _walk_tensors(o, items, set())
    first_obj, first_storage, graph = {}, {}, []
    for i, x in enumerate(items):
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                graph.append((first_obj.setdefault(id(x), i), None, None))
                continue
            s = x.untyped_storage()
            byte_off = x.storage_offset() * x.element_size()
            if x.device.type != "meta" and x.numel() and s.data_ptr() != 0:
                assert x.data_ptr() - s.data_ptr() == byte_off  # data_ptr relationship within the storage
        else:
            s = x._untyped_storage if isinstance(x, torch.storage.TypedStorage) else x
            byte_off = 0
        # Aliasing of empty storages is unobservable, and torch.load does not keep it
        # (it caches loaded storages only when their data_ptr is not 0): not compared.
        group = first_storage.setdefault(s._cdata, i) if s.nbytes() else "empty"
        graph.append((first_obj.setdefault(id(x), i), group, byte_off))
    return graph


def assert_same(a, b, device=None) -> None:
    """`b` is `a` (a loaded or reference object) in structure, Python types, tensor
    metadata, bytes, and storage sharing. With `device`, `b`'s tensors must be there."""
    _same(a, b, device=device)
    assert sharing_graph(a) == sharing_graph(b), "storage sharing differs"


# ---------------------------------------------------------------- objects

def rand_tensor(dtype, shape, seed=0) -> torch.Tensor:
    """Random bits of any dtype (NaNs included for float types)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


_DTYPE_NAMES = [
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32", "bool",
    "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
]
DTYPES = [getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)]


def dtypes_obj():
    out = {}
    for i, dt in enumerate(DTYPES):
        base = rand_tensor(dt, (6, 4), seed=i)
        out[str(dt)] = {
            "base": base,
            "t": base.t(),                      # same storage, transposed
            "step": base[::2, 1:],              # same storage, stepped, offset
            "scalar": rand_tensor(dt, (1,), seed=100 + i).squeeze(0),  # 0-dim
            "empty": torch.empty(0, 3, dtype=dt),
            "alone_view": rand_tensor(dt, (10,), seed=200 + i)[3:7],   # only the view is saved
        }
    return out


def nested_obj():
    g = torch.Generator().manual_seed(1)
    leaf = torch.randn(3, generator=g).requires_grad_()
    with_attr = torch.ones(2)
    with_attr.note = "kept"
    shared = torch.arange(5)
    return {
        "int": 3, "big_int": 2 ** 100, "neg": -7, "float": 1.5, "nan": float("nan"), "inf": float("-inf"),
        "neg_zero": -0.0, "complex": 1 + 2j, "str": "héllo", "bytes": b"\x00\xff", "bytearray": bytearray(b"ab"),
        "none": None, "true": True, "set": {1, 2, 3},
        "list": [1, "a", torch.arange(3), []],
        "tuple": (torch.ones(2), (1, 2), (), [torch.zeros(1)]),
        "empty_dict": {}, 7: "int key", (1, "x"): "tuple key",
        "od": collections.OrderedDict([("z", torch.zeros(1)), ("a", 1), ("m", collections.OrderedDict())]),
        "nested": {"deeper": [{"x": (torch.randn(2, 2, generator=g),)}]},
        "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "scalar": torch.tensor(3.25), "empty_t": torch.empty(0, 5), "int_scalar": torch.tensor(7, dtype=torch.int64),
        "param": nn.Parameter(torch.randn(2, 2, generator=g)),
        "frozen_param": nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "leaf_requires_grad": leaf,
        "with_attr": with_attr,
        "same_object_twice": [shared, shared],
        "conj": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
    }


def views_obj():
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    big = torch.randn(100)
    e = torch.empty(0, 4)
    return {
        "base": base,
        "t": base.t(),
        "step": base[::2, ::3],
        "offset": base[2:, 1:],
        "flat_tail": base.view(-1)[5:17],
        "expand": base[0:1].expand(4, 8),   # stride 0
        "diag": base.diagonal(),
        "reshaped": base.view(2, 3, 8).permute(2, 0, 1),
        "alone_t": torch.randn(3, 5).t(),
        "alone_offset": big[40:60],        # the whole 100-element storage is saved
        "alone_offset_again": big[90:],    # and shared with the view above
        "empty_and_its_view": [e, e.view(4, 0)],
        "int_of_other_storage": torch.arange(10, dtype=torch.int16)[1::3],
    }


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 8))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied weights
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, idx):
        self.seen += idx.numel()
        return self.head(self.body(self.emb(idx)))


def _grad_scaler():
    """torch.amp.GradScaler on the CPU, or the reason it cannot be used."""
    try:
        return torch.amp.GradScaler("cpu"), None
    except Exception as e:  # pragma: no cover - depends on the torch build
        return None, f"torch.amp.GradScaler('cpu') is not available: {e}"


def make_training(steps=3, seed=0):
    """A model with its SGD, Adam and AdamW optimizers (step tensors included),
    LR schedulers and GradScaler after `steps` real training steps."""
    torch.manual_seed(seed)
    model = TinyNet()
    opts = {
        "sgd": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        "adam": torch.optim.Adam(model.parameters(), lr=1e-3),
        "adamw": torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, amsgrad=True),
    }
    scheds = {"step": torch.optim.lr_scheduler.StepLR(opts["sgd"], step_size=2, gamma=0.5),
              "cos": torch.optim.lr_scheduler.CosineAnnealingLR(opts["adam"], T_max=10)}
    scaler, _ = _grad_scaler()
    for _ in range(steps):
        training_step(model, opts, scaler)
        for s in scheds.values():
            s.step()
    return model, opts, scheds, scaler


def training_step(model, opts, scaler):
    idx = torch.randint(0, 10, (12,))
    loss = nn.functional.cross_entropy(model(idx), idx)
    for o in opts.values():
        o.zero_grad()
    if scaler is not None:
        scaler.scale(loss).backward()
        for o in opts.values():
            scaler.step(o)
        scaler.update()
    else:
        loss.backward()
        for o in opts.values():
            o.step()
    return loss.detach()


def training_obj():
    model, opts, scheds, scaler = make_training()
    obj = {
        "model": model.state_dict(),
        "optim": {k: o.state_dict() for k, o in opts.items()},
        "sched": {k: s.state_dict() for k, s in scheds.items()},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "epoch": 3,
    }
    if scaler is not None:
        obj["scaler"] = scaler.state_dict()
    if np is not None:  # numpy's state with its array as a tensor (weights_only-safe)
        name, keys, pos, has_gauss, cached = np.random.get_state()
        obj["rng"]["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
    return obj


OBJECTS = {
    "nested": nested_obj,
    "dtypes": dtypes_obj,
    "views": views_obj,
    "training": training_obj,
    "bare_view": lambda: torch.randn(4, 6)[:, 1::2].t(),
    "tensor_list": lambda: [torch.randn(2), torch.randn(3).double()],
    "tuple_root": lambda: (torch.ones(1), 2),
    "no_tensors": lambda: {"a": [1, 2.5, "x"], "b": None},
    "none": lambda: None,
    "empty_dict": dict,
}


from zip_layout import assert_layout_rule as assert_fastckpt_layout, record_layout  # noqa: E402


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xA5]))


def torch_load(f, **kw):
    kw.setdefault("weights_only", True)
    return torch.load(f, **kw)


# ---------------------------------------------------------------- the comparison itself

def _differs(a, b):
    try:
        assert_same(a, b)
    except AssertionError:
        return True
    return False


def test_assert_same_can_fail():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert not _differs({"x": x, "n": float("nan")}, {"x": x.clone(), "n": float("nan")})
    f8 = torch.zeros(4, dtype=torch.float8_e4m3fn)
    f8_other = f8.clone()
    f8_other.view(torch.uint8)[2] = 1
    assert _differs(f8, f8_other)                                           # one bit of a float8
    nan2 = torch.tensor([float("nan")])
    nan2.view(torch.int32)[0] += 1
    assert _differs(torch.tensor([float("nan")]), nan2)                     # NaN payload
    assert _differs(torch.tensor(0.0), torch.tensor(-0.0))
    assert _differs(collections.OrderedDict(a=1), {"a": 1})
    assert _differs({"a": 1, "b": 2}, {"b": 2, "a": 1})                    # key order
    assert _differs((1, 2), [1, 2])
    assert _differs([x, x.t()], [x, x.t().clone()])                         # sharing lost
    assert _differs([x, x], [x, x.clone()])                                 # identity lost
    assert _differs(x.t().contiguous(), x.t())                              # strides
    assert _differs(x[1:], x.clone()[1:].clone())                           # offset, storage size
    assert _differs(nn.Parameter(x.clone()), x.clone())                     # Parameter vs Tensor
    assert _differs(x.clone().requires_grad_(), x.clone())
    assert _differs(x.double(), x)
    assert _differs(x.storage_offset(), 1)


# ---------------------------------------------------------------- parity

DIRECTIONS = [("fastckpt", "fastckpt"), ("fastckpt", "torch"), ("torch", "fastckpt")]


@pytest.mark.parametrize("writer,reader", DIRECTIONS, ids=["fast-fast", "fast-torch", "torch-fast"])
@pytest.mark.parametrize("name", list(OBJECTS))
def test_round_trip_parity(tmp_path, name, writer, reader):
    obj = OBJECTS[name]()
    torch.save(obj, tmp_path / "ref.pt")
    ref = torch_load(tmp_path / "ref.pt")
    path = tmp_path / "ckpt.pt"
    (fastckpt.save if writer == "fastckpt" else torch.save)(obj, path)
    got = fastckpt.load(path) if reader == "fastckpt" else torch_load(path)
    assert_same(ref, got)   # what torch.load gives
    assert_same(obj, got)   # and what was saved
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_alone(tmp_path, dtype):
    obj = {"x": rand_tensor(dtype, (5, 3), seed=7), "s": rand_tensor(dtype, (1,), seed=8).squeeze(0),
           "e": torch.empty(0, dtype=dtype)}
    obj["v"] = obj["x"].t()[1:, ::2]
    fastckpt.save(obj, tmp_path / "a.pt")
    got = fastckpt.load(tmp_path / "a.pt")
    assert_same(obj, got)
    assert_same(obj, torch_load(tmp_path / "a.pt"))
    assert got["x"].dtype == dtype and got["s"].dim() == 0 and got["e"].numel() == 0
    assert got["v"].untyped_storage().data_ptr() == got["x"].untyped_storage().data_ptr()


def test_sharing_is_exact(tmp_path):
    """A view and its base, tied weights, and one object referenced twice."""
    obj = views_obj()
    model = TinyNet()
    obj["model"] = model.state_dict()
    fastckpt.save(obj, tmp_path / "a.pt")
    got = fastckpt.load(tmp_path / "a.pt")
    base = got["base"]
    for k in ("t", "step", "offset", "flat_tail", "expand", "diag", "reshaped"):
        assert got[k].untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), k
        assert got[k].data_ptr() == base.data_ptr() + got[k].storage_offset() * 4, k
    assert got["offset"].storage_offset() == obj["offset"].storage_offset() == 17
    assert got["step"].stride() == (16, 3)
    assert got["expand"].stride() == (0, 1)
    assert got["alone_offset"].untyped_storage().nbytes() == 400
    assert got["alone_offset"].untyped_storage().data_ptr() == got["alone_offset_again"].untyped_storage().data_ptr()
    sd = got["model"]
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    base.fill_(-1)  # writes through every view, as with torch.load
    assert (got["t"] == -1).all() and (got["step"] == -1).all()
    m = TinyNet()
    m.load_state_dict(sd)
    assert m.head.weight is m.emb.weight


def test_storages_in_the_object(tmp_path):
    t = torch.arange(8, dtype=torch.float32)
    b = torch.arange(16, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        typed = t.storage()
    obj = {"t": t, "typed": typed, "view": t[2:], "lone_untyped": torch.UntypedStorage(16).fill_(7),
           "bytes": b, "untyped_of_bytes": b.untyped_storage()}
    torch.save(obj, tmp_path / "ref.pt")
    fastckpt.save(obj, tmp_path / "a.pt")
    for got in (fastckpt.load(tmp_path / "a.pt"), torch_load(tmp_path / "a.pt"), fastckpt.load(tmp_path / "ref.pt")):
        assert_same(torch_load(tmp_path / "ref.pt"), got)


def test_sparse_and_quantized(tmp_path):
    g = torch.Generator().manual_seed(3)
    obj = {
        "coo": torch.randn(4, 5, generator=g).relu().to_sparse(),
        "csr": torch.randn(3, 3, generator=g).relu().to_sparse_csr(),
        "q": torch.quantize_per_tensor(torch.randn(5, generator=g), 0.1, 3, torch.quint8),
        "qc": torch.quantize_per_channel(torch.randn(3, 4, generator=g), torch.tensor([0.1, 0.2, 0.3]),
                                         torch.tensor([1, 2, 3]), 0, torch.qint8),
    }
    torch.save(obj, tmp_path / "ref.pt")
    fastckpt.save(obj, tmp_path / "a.pt")
    ref = torch_load(tmp_path / "ref.pt")
    assert_same(ref, fastckpt.load(tmp_path / "a.pt"))
    assert_same(ref, torch_load(tmp_path / "a.pt"))
    assert_same(ref, fastckpt.load(tmp_path / "ref.pt"))


def test_training_resume_is_exact(tmp_path):
    """Model, optimizers (Adam/AdamW step tensors), schedulers, GradScaler and RNG
    restored from a fastckpt file continue exactly like the originals."""
    model, opts, scheds, scaler = make_training(steps=3)
    state = {"model": model.state_dict(), "optim": {k: o.state_dict() for k, o in opts.items()},
             "sched": {k: s.state_dict() for k, s in scheds.items()},
             "scaler": scaler.state_dict() if scaler is not None else None,
             "rng": torch.get_rng_state()}
    for k in ("adam", "adamw"):
        step = next(iter(state["optim"][k]["state"].values()))["step"]
        assert isinstance(step, torch.Tensor) and step.dim() == 0 and float(step) == 3.0
    fastckpt.save(state, tmp_path / "ckpt.pt")
    got = fastckpt.load(tmp_path / "ckpt.pt")
    assert_same(state, got)

    model2, opts2, scheds2, scaler2 = make_training(steps=0, seed=123)
    model2.load_state_dict(got["model"])
    for k in opts2:
        opts2[k].load_state_dict(got["optim"][k])
    for k in scheds2:
        scheds2[k].load_state_dict(got["sched"][k])
    if scaler2 is not None:
        scaler2.load_state_dict(got["scaler"])
    torch.set_rng_state(got["rng"])
    loss2 = training_step(model2, opts2, scaler2)
    torch.set_rng_state(state["rng"])
    loss1 = training_step(model, opts, scaler)
    assert torch.equal(loss1, loss2)
    for (n, p1), (_, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(p1, p2), n
    assert model2.head.weight is model2.emb.weight


def test_grad_scaler_state(tmp_path):
    scaler, why = _grad_scaler()
    if scaler is None:
        pytest.skip(why)
    _, _, _, scaler = make_training(steps=2)
    sd = scaler.state_dict()
    assert sd and "scale" in sd
    fastckpt.save({"scaler": sd}, tmp_path / "a.pt")
    assert_same({"scaler": sd}, fastckpt.load(tmp_path / "a.pt"))


def test_rng_states(tmp_path):
    if np is None:
        pytest.skip("numpy is not installed")
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    expect = (torch.rand(3), random.random(), np.random.rand(3))
    fastckpt.save(state, tmp_path / "rng.pt")
    torch.save(state, tmp_path / "ref.pt")
    # numpy's state holds an ndarray: weights_only needs numpy's globals allowed.
    with pytest.raises(pickle.UnpicklingError):
        torch_load(tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    got = fastckpt.load(tmp_path / "rng.pt", weights_only=False)
    assert_same(ref, got)
    assert_same(state, got)
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "rng.pt"))
    allowed = [type(np.dtype(np.uint32))]  # needed by BUILD, not listed by torch
    for dotted in unsafe:
        mod, _, attr = dotted.rpartition(".")
        allowed.append(getattr(__import__(mod, fromlist=[attr]), attr))
    with torch.serialization.safe_globals(allowed):
        assert_same(ref, fastckpt.load(tmp_path / "rng.pt"))
    torch.set_rng_state(got["torch"])
    random.setstate(got["python"])
    np.random.set_state(got["numpy"])
    again = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(expect[0], again[0]) and expect[1] == again[1] and (expect[2] == again[2]).all()


def test_whole_module_needs_weights_only_false(tmp_path):
    model = TinyNet()
    fastckpt.save(model, tmp_path / "m.pt")
    got = fastckpt.load(tmp_path / "m.pt", weights_only=False)
    assert type(got) is TinyNet
    assert got.head.weight is got.emb.weight and isinstance(got.head.weight, nn.Parameter)
    assert_same(model, got)
    assert_same(torch.load(tmp_path / "m.pt", weights_only=False), got)
    with pytest.raises(pickle.UnpicklingError):
        fastckpt.load(tmp_path / "m.pt")


@pytest.mark.parametrize("protocol", [2, 3])
def test_pickle_protocols(tmp_path, protocol):
    obj = views_obj()
    fastckpt.save(obj, tmp_path / "a.pt", pickle_protocol=protocol)
    torch.save(obj, tmp_path / "b.pt", pickle_protocol=protocol)
    for p in ("a.pt", "b.pt"):
        assert_same(obj, fastckpt.load(tmp_path / p))
        assert_same(obj, torch_load(tmp_path / p))


# ---------------------------------------------------------------- paths and file objects

@pytest.mark.parametrize("kind", ["str", "pathlib", "bytesio", "open_file"])
def test_destinations_and_sources(tmp_path, kind):
    obj = {"views": views_obj(), "nested": nested_obj()}
    path = tmp_path / "ckpt.pt"
    if kind == "str":
        fastckpt.save(obj, str(path))
        sources = [str(path)]
    elif kind == "pathlib":
        fastckpt.save(obj, path)
        sources = [path]
    elif kind == "bytesio":
        buf = io.BytesIO()
        fastckpt.save(obj, buf)
        path.write_bytes(buf.getvalue())
        sources = [io.BytesIO(buf.getvalue())]
    else:
        with open(path, "wb") as f:
            fastckpt.save(obj, f)
            assert not f.closed  # the caller's file stays open
        sources = [open(path, "rb")]
    ref = torch_load(io.BytesIO(path.read_bytes()))
    assert_same(obj, ref)
    for src in sources:
        assert_same(ref, fastckpt.load(src))
        if hasattr(src, "close"):
            src.close()
    assert_same(ref, fastckpt.load(path))
    # a file written to a file object has the same layout
    assert_fastckpt_layout(path)
    assert zipfile.ZipFile(path).testzip() is None
    # torch.save to a file object -> fastckpt.load of a file object
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    assert_same(ref, fastckpt.load(buf))


def test_relative_and_unusual_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    obj = {"w": torch.randn(3, 3).t()}
    fastckpt.save(obj, "rel.pt")
    assert_same(obj, fastckpt.load("rel.pt"))
    d = tmp_path / "dir with spaces é"
    d.mkdir()
    fastckpt.save(obj, d / "ckpt ü.pt")
    assert_same(obj, fastckpt.load(str(d / "ckpt ü.pt")))
    assert_same(obj, torch_load(d / "ckpt ü.pt"))
    assert temp_files(tmp_path) == [] and temp_files(d) == []


def test_concurrent_saves_and_loads(tmp_path):
    errors = []

    def work(i):
        try:
            obj = {"i": i, "w": torch.full((1000 + i,), float(i)), "v": views_obj()}
            for rep in range(3):
                fastckpt.save(obj, tmp_path / f"c{i}.pt")
                assert_same(obj, fastckpt.load(tmp_path / f"c{i}.pt"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert temp_files(tmp_path) == []


def test_save_overwrites_existing_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    fastckpt.save({"a": torch.ones(100000)}, path)
    fastckpt.save({"b": torch.zeros(3)}, path)  # smaller: no stale tail
    assert_same({"b": torch.zeros(3)}, fastckpt.load(path))
    assert zipfile.ZipFile(path).testzip() is None
    assert temp_files(tmp_path) == []


# ---------------------------------------------------------------- the archive

@pytest.mark.parametrize("name", ["training", "dtypes", "views"])
def test_archive_is_standard_and_aligned(tmp_path, name):
    obj = OBJECTS[name]()
    path = tmp_path / "ckpt.pt"
    fastckpt.save(obj, path)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every CRC valid
        infos = z.infolist()
        assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
        prefixes = {i.filename.split("/", 1)[0] for i in infos}
        assert len(prefixes) == 1
        prefix = prefixes.pop()
        assert z.read(f"{prefix}/byteorder") == sys.byteorder.encode()
        assert z.read(f"{prefix}/version").strip() in (b"3", b"2", b"1")
    layout = record_layout(path)
    data = sorted((n for n in layout if n.startswith("data/")), key=lambda n: int(n.split("/")[1]))
    assert "data.pkl" in layout and data == [f"data/{i}" for i in range(len(data))]
    assert len(data) > 0
    assert_fastckpt_layout(path)
    raw = path.read_bytes()
    for n, (off, size, crc) in layout.items():
        assert zlib.crc32(raw[off:off + size]) == crc, n
    # stock torch.load reads it: weights_only, mmap, and computed storage offsets
    ref = torch_load(path)
    assert_same(obj, ref)
    assert_same(obj, torch_load(path, mmap=True))
    assert_same(obj, fastckpt.load(path, mmap=True))
    cfg = torch.utils.serialization.config.load
    old = cfg.calculate_storage_offsets
    cfg.calculate_storage_offsets = True
    try:
        assert_same(obj, torch_load(path, mmap=True))
    finally:
        cfg.calculate_storage_offsets = old
    # torch's own offset arithmetic (map_location="meta") finds the same records
    meta = torch_load(path, map_location="meta")
    offsets = {off for off, _, _ in layout.values()}
    items = []
    _walk_tensors(meta, items, set())
    for t in items:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            assert t.untyped_storage()._checkpoint_offset in offsets


def test_every_storage_saved_once(tmp_path):
    base = torch.randn(1000)
    obj = [base, base[10:], base.view(10, 100).t(), base[::7]]
    fastckpt.save(obj, tmp_path / "a.pt")
    layout = record_layout(tmp_path / "a.pt")
    assert [n for n in layout if n.startswith("data/")] == ["data/0"]
    assert layout["data/0"][1] == 4000


# ---------------------------------------------------------------- map_location

def _remember_locations(calls):
    def f(storage, location):
        calls.append(location)
        return storage
    return f


MAP_LOCATIONS = {
    "none": lambda: None,
    "cpu": lambda: "cpu",
    "device": lambda: torch.device("cpu"),
    "dict": lambda: {"cpu": "cpu"},
    "callable": lambda: (lambda s, loc: s),
    "meta": lambda: "meta",
}


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
@pytest.mark.parametrize("where", list(MAP_LOCATIONS))
def test_map_location(tmp_path, where, writer):
    obj = {"views": views_obj(), "model": TinyNet().state_dict(), "p": nn.Parameter(torch.ones(2))}
    path = tmp_path / "ckpt.pt"
    (fastckpt.save if writer == "fastckpt" else torch.save)(obj, path)
    try:
        ref = torch_load(path, map_location=MAP_LOCATIONS[where]())
    except Exception as e:  # pragma: no cover - depends on torch
        pytest.skip(f"torch.load does not support map_location={where}: {e}")
    got = fastckpt.load(path, map_location=MAP_LOCATIONS[where]())
    assert_same(ref, got)
    if where == "meta":
        assert got["p"].device.type == "meta" and isinstance(got["p"], nn.Parameter)
    else:
        assert_same(obj, got)


def test_map_location_callable_sees_location_tags(tmp_path):
    obj = views_obj()
    fastckpt.save(obj, tmp_path / "a.pt")
    ours, theirs = [], []
    fastckpt.load(tmp_path / "a.pt", map_location=_remember_locations(ours))
    torch_load(tmp_path / "a.pt", map_location=_remember_locations(theirs))
    assert ours == theirs and ours and set(ours) == {"cpu"}


def test_meta_tensors_round_trip_like_torch(tmp_path):
    # torch.save accepts meta tensors (pickled without a storage, via
    # _rebuild_meta_tensor_no_storage); fastckpt keeps parity with it.
    path = tmp_path / "m.pt"
    fastckpt.save({"w": torch.ones(2), "meta": torch.empty(3, 4, device="meta")}, path)
    for got in (fastckpt.load(path), torch.load(path)):
        assert got["meta"].device.type == "meta" and got["meta"].shape == (3, 4)
        assert torch.equal(got["w"], torch.ones(2))


def test_meta_storages_cannot_be_saved(tmp_path):
    path = tmp_path / "m.pt"
    with pytest.raises(ValueError, match="meta"):
        fastckpt.save({"w": torch.ones(2), "s": torch.empty(3, 4, device="meta").untyped_storage()}, path)
    assert not path.exists() and temp_files(tmp_path) == []


# ---------------------------------------------------------------- CUDA

def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("where", ["cuda:0", "cuda", "callable"])
def test_cuda_map_location(tmp_path, where):
    _need_cuda()
    obj = {"views": views_obj(), "model": TinyNet().state_dict()}
    fastckpt.save(obj, tmp_path / "a.pt")
    ml = (lambda s, loc: s.cuda(0)) if where == "callable" else where
    ref = torch_load(tmp_path / "a.pt", map_location=ml)
    got = fastckpt.load(tmp_path / "a.pt", map_location=ml)
    assert_same(ref, got, device="cuda:0")
    assert got["model"]["emb.weight"].device == torch.device("cuda:0")
    assert torch.equal(got["views"]["step"].cpu(), obj["views"]["step"])


def test_cuda_tensors_through_the_pinned_stager(tmp_path):
    """CUDA storages bigger than the staging chunk, a non-contiguous CUDA view and
    shared CUDA storages: torch.load gives the same CPU data and aliasing."""
    _need_cuda()
    dev = torch.device("cuda:0")
    g = torch.Generator(device=dev).manual_seed(0)
    big = torch.randn(50 << 20, device=dev, generator=g)  # 200 MiB > 4 x the 8 MiB staging buffer
    odd = torch.randint(0, 255, ((37 << 20) + 4093,), dtype=torch.uint8, device=dev, generator=g)
    base = torch.randn(64, 48, device=dev, generator=g)
    obj = {"big": big, "odd": odd, "base": base, "view": base.t()[::3, 5:], "tail": big[-1000:],
           "cpu": torch.arange(5), "param": nn.Parameter(torch.ones(3, device=dev))}
    path = tmp_path / "cuda.pt"
    torch.save(obj, tmp_path / "ref.pt")
    fastckpt.save(obj, path)
    assert zipfile.ZipFile(path).testzip() is None
    assert_fastckpt_layout(path)
    ref_cpu = torch_load(tmp_path / "ref.pt", map_location="cpu")
    assert_same(ref_cpu, torch_load(path, map_location="cpu"))
    assert_same(ref_cpu, fastckpt.load(path, map_location="cpu", verify=True))
    got = fastckpt.load(path)  # location tags say cuda:0
    assert got["big"].device == dev and got["cpu"].device.type == "cpu"
    assert_same(obj, got)
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert got["tail"].untyped_storage().data_ptr() == got["big"].untyped_storage().data_ptr()


def test_cuda_save_fault_leaves_old_file(tmp_path):
    _need_cuda()
    path = tmp_path / "cuda.pt"
    old = {"w": torch.randn(1000)}
    fastckpt.save(old, path)
    _C.fault_inject("write", nth=2, errno=errno.ENOSPC)
    with pytest.raises(OSError) as ei:
        fastckpt.save({"w": torch.randn(20 << 20, device="cuda")}, path)
    assert ei.value.errno == errno.ENOSPC
    assert_same(old, fastckpt.load(path))
    assert temp_files(tmp_path) == []


# ---------------------------------------------------------------- weights_only

def _call_pickle(module: str, name: str, *args: str) -> bytes:
    """A protocol-0 pickle that calls module.name(*args) when loaded."""
    body = b"".join(b"V" + a.encode("raw_unicode_escape") + b"\n" for a in args)
    return f"c{module}\n{name}\n(".encode() + body + b"tR."


def write_torch_zip(path, data_pkl: bytes, storages=()):
    """A torch.save-shaped archive written by Python's zipfile (unaligned records)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", sys.byteorder)
        for i, b in enumerate(storages):
            z.writestr(f"archive/data/{i}", b)
        z.writestr("archive/version", "3\n")


class Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y


def test_plain_zip_archive_loads(tmp_path):
    data = torch.arange(6, dtype=torch.int32)
    pkl = io.BytesIO()

    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch.storage.TypedStorage):
                return ("storage", torch.IntStorage, "0", "cpu", o._size())
            return None

    P(pkl, protocol=2).dump({"x": data})
    write_torch_zip(tmp_path / "z.pt", pkl.getvalue(), [data.numpy().tobytes()])
    assert_same(torch_load(tmp_path / "z.pt"), fastckpt.load(tmp_path / "z.pt"))
    assert torch.equal(fastckpt.load(tmp_path / "z.pt")["x"], data)


def _malicious(tmp_path, case, marker):
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    if case == "os.system":
        return _call_pickle("os", "system", f"touch {marker}")
    if case == "posix.system":
        return _call_pickle("posix", "system", f"touch {marker}")
    if case == "eval":
        return _call_pickle("builtins", "eval", code)
    if case == "exec":
        return _call_pickle("builtins", "exec", code)
    if case == "subprocess":
        return _call_pickle("subprocess", "getoutput", f"touch {marker}")
    if case == "import":  # importing an arbitrary module is itself code execution
        mod = tmp_path / "fastckpt_evil_mod.py"
        mod.write_text(f"{code}\ndef boom():\n    return 1\n")
        return b"cfastckpt_evil_mod\nboom\n(tR."
    raise AssertionError(case)


MALICIOUS = ["os.system", "posix.system", "eval", "exec", "subprocess", "import"]


@pytest.mark.parametrize("case", MALICIOUS)
def test_weights_only_rejects_code(tmp_path, monkeypatch, case):
    """A data.pkl that would run a command, eval/exec code or import a module is
    refused with UnpicklingError, and nothing of it runs (checked even when the
    load fails some other way)."""
    marker = tmp_path / f"pwned-{case}"
    monkeypatch.syspath_prepend(str(tmp_path))
    write_torch_zip(tmp_path / "evil.pt", _malicious(tmp_path, case, marker))
    try:
        with pytest.raises(pickle.UnpicklingError):
            torch_load(tmp_path / "evil.pt")  # torch refuses it too
        with pytest.raises(pickle.UnpicklingError) as ei:
            fastckpt.load(tmp_path / "evil.pt")
        assert "weights_only" in str(ei.value) or "Weights only" in str(ei.value)
        with pytest.raises(pickle.UnpicklingError):
            fastckpt.load(tmp_path / "evil.pt", weights_only=True, verify=True)
    finally:
        assert not marker.exists(), "the checkpoint ran code"
        assert "fastckpt_evil_mod" not in sys.modules
        sys.modules.pop("fastckpt_evil_mod", None)


@pytest.mark.parametrize("saver", ["fastckpt", "torch"])
def test_weights_only_rejects_reduce_and_false_allows_it(tmp_path, saver):
    marker = tmp_path / "pwned"
    obj = {"w": torch.ones(3), "evil": Evil(marker)}
    (fastckpt.save if saver == "fastckpt" else torch.save)(obj, tmp_path / "evil.pt")
    assert not marker.exists()  # saving runs nothing
    try:
        with pytest.raises(pickle.UnpicklingError):
            fastckpt.load(tmp_path / "evil.pt")
    finally:
        assert not marker.exists(), "weights_only=True ran code"
    got = fastckpt.load(tmp_path / "evil.pt", weights_only=False)  # trusted: the harmless command runs
    assert marker.exists() and got["evil"] == 0 and torch.equal(got["w"], torch.ones(3))


def test_weights_only_false_runs_handcrafted_pickle(tmp_path):
    marker = tmp_path / "ran"
    write_torch_zip(tmp_path / "p.pt", _malicious(tmp_path, "eval", marker))
    assert fastckpt.load(tmp_path / "p.pt", weights_only=False) is None
    assert marker.exists()


def test_weights_only_with_pickle_module_is_refused(tmp_path):
    fastckpt.save({"a": 1}, tmp_path / "a.pt")
    with pytest.raises(RuntimeError):
        fastckpt.load(tmp_path / "a.pt", pickle_module=pickle, weights_only=True)
    assert fastckpt.load(tmp_path / "a.pt", pickle_module=pickle, weights_only=False) == {"a": 1}
    # as torch.load: an explicit pickle_module with weights_only unset means weights_only=False
    assert fastckpt.load(tmp_path / "a.pt", pickle_module=pickle) == {"a": 1}


def test_safe_globals_allow_a_custom_class(tmp_path):
    obj = {"pt": Point(1, torch.arange(3)), "w": torch.ones(2)}
    fastckpt.save(obj, tmp_path / "a.pt")
    try:
        with pytest.raises(pickle.UnpicklingError) as ei:
            fastckpt.load(tmp_path / "a.pt")
        assert "Point" in str(ei.value)
    finally:
        with torch.serialization.safe_globals([Point]):
            got = fastckpt.load(tmp_path / "a.pt")
            ref = torch_load(tmp_path / "a.pt")
        assert type(got["pt"]) is Point
        assert_same(ref, got)
        assert_same(obj, got)
        saved = torch.serialization.get_safe_globals()
        torch.serialization.add_safe_globals([Point])
        try:
            assert_same(obj, fastckpt.load(tmp_path / "a.pt"))
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(saved)


# ---------------------------------------------------------------- verify

def _state_dict():
    g = torch.Generator().manual_seed(11)
    return collections.OrderedDict([("layer.weight", torch.randn(64, 32, generator=g)),
                                    ("layer.bias", torch.randn(64, generator=g)),
                                    ("other.weight", torch.randn(8, generator=g))])


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
def test_verify_passes_on_good_files(tmp_path, writer):
    sd = _state_dict()
    (fastckpt.save if writer == "fastckpt" else torch.save)(sd, tmp_path / "a.pt")
    assert_same(sd, fastckpt.load(tmp_path / "a.pt", verify=True))


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
def test_verify_detects_a_flipped_data_byte(tmp_path, writer):
    sd = _state_dict()
    path = tmp_path / "a.pt"
    (fastckpt.save if writer == "fastckpt" else torch.save)(sd, path)
    off, size, _ = record_layout(path)["data/0"]  # layer.weight: the first storage pickled
    assert size == sd["layer.weight"].nbytes
    flip_byte(path, off + 1000)
    with pytest.raises(fastckpt.FormatError) as ei:
        fastckpt.load(path, verify=True)
    msg = str(ei.value)
    assert str(path) in msg and "checksum" in msg and "data/0" in msg
    assert "layer.bias" not in msg and "data/1" not in msg
    # verify=False opts out: the file loads, garbage in exactly that tensor, no error.
    got = fastckpt.load(path, verify=False)
    assert not torch.equal(got["layer.weight"], sd["layer.weight"])
    diff = got["layer.weight"].view(torch.uint8) != sd["layer.weight"].view(torch.uint8)
    assert int(diff.sum()) == 1
    assert torch.equal(got["layer.bias"], sd["layer.bias"]) and torch.equal(got["other.weight"], sd["other.weight"])


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
def test_verify_error_names_the_tensor(tmp_path, writer):
    sd = {"model": _state_dict()}
    path = tmp_path / "a.pt"
    (fastckpt.save if writer == "fastckpt" else torch.save)(sd, path)
    off, _, _ = record_layout(path)["data/0"]
    flip_byte(path, off + 7)
    with pytest.raises(fastckpt.FormatError) as ei:
        fastckpt.load(path, verify=True)
    assert "layer.weight" in str(ei.value), str(ei.value)
    assert "layer.bias" not in str(ei.value)


@pytest.mark.parametrize("record", ["data.pkl", "byteorder", "version"])
def test_corrupt_metadata_is_always_detected(tmp_path, record):
    path = tmp_path / "a.pt"
    fastckpt.save(_state_dict(), path)
    off, size, _ = record_layout(path)[record]
    flip_byte(path, off + size // 2)
    with pytest.raises(fastckpt.FormatError) as ei:
        fastckpt.load(path)  # no verify needed
    assert str(path) in str(ei.value) and record in str(ei.value)


def test_verify_needs_a_path(tmp_path):
    buf = io.BytesIO()
    fastckpt.save({"a": torch.ones(2)}, buf)
    buf.seek(0)
    with pytest.raises(ValueError):
        fastckpt.load(buf, verify=True)
    fastckpt.save({"a": torch.ones(2)}, tmp_path / "a.pt")
    with pytest.raises(ValueError):
        fastckpt.load(tmp_path / "a.pt", mmap=True, verify=True)


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_verify_is_on_by_default(tmp_path, writer, where):
    """A plain fastckpt.load(path) checks every storage's CRC-32 (computed by
    the engine during the reads): a flipped data byte anywhere in a storage is
    a FormatError naming the file and the tensor."""
    sd = {"model": _state_dict(), "step": 3}
    path = tmp_path / "a.pt"
    (fastckpt.save if writer == "fastckpt" else torch.save)(sd, path)
    off, size, _ = record_layout(path)["data/0"]
    flip_byte(path, off + {"first": 0, "middle": size // 2, "last": size - 1}[where])
    with pytest.raises(fastckpt.FormatError) as ei:
        fastckpt.load(path)
    msg = str(ei.value)
    assert str(path) in msg and "checksum mismatch" in msg and "model.layer.weight" in msg, msg
    assert "layer.bias" not in msg
    for kw in ({"map_location": "cpu"}, {"weights_only": False}):
        with pytest.raises(fastckpt.FormatError, match="model.layer.weight"):
            fastckpt.load(path, **kw)
    got = fastckpt.load(path, verify=False)
    assert torch.equal(got["model"]["layer.bias"], sd["model"]["layer.bias"])


def test_verify_uses_the_crcs_of_the_reads_not_a_pass_after_them(tmp_path, monkeypatch):
    """The storages' CRC-32s come back from the engine's reads: load makes no
    checksum pass of its own over the data after the reads."""
    sd = {"model": _state_dict()}
    fastckpt.save(sd, tmp_path / "a.pt")

    def no_pass(*a, **k):
        raise AssertionError("a CRC-32 pass after the reads")
    monkeypatch.setattr(_C, "crc32", no_pass)
    monkeypatch.setattr(zlib, "crc32", no_pass)
    assert_same(sd, fastckpt.load(tmp_path / "a.pt", verify=True))
    assert_same(sd, fastckpt.load(tmp_path / "a.pt"))


def test_verify_by_default_checks_large_and_unaligned_storages(tmp_path):
    """Storages bigger than a staging buffer (read straight into the tensor,
    several requests, CRCs combined in file order) and odd-sized ones (their
    tail through staging) are checked as well; intact ones load."""
    g = torch.Generator().manual_seed(5)
    sd = {"big": torch.randint(0, 255, ((20 << 20) + 3,), dtype=torch.uint8, generator=g),
          "odd": torch.randn(12345, generator=g), "empty": torch.zeros(0)}
    path = tmp_path / "a.pt"
    fastckpt.save(sd, path)
    got = fastckpt.load(path)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    lay = record_layout(path)
    for name, at in (("data/0", (17 << 20) + 5), ("data/1", 12345 * 4 - 1)):
        off, size, _ = lay[name]
        flip_byte(path, off + at)
        with pytest.raises(fastckpt.FormatError, match="checksum mismatch.*" + ("big" if name == "data/0" else "odd")):
            fastckpt.load(path)
        flip_byte(path, off + at)  # restored
    assert torch.equal(fastckpt.load(path)["big"], sd["big"])


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
def test_file_without_checksums_loads_by_default_with_a_warning(tmp_path, writer):
    """torch's compute_crc32=False writes CRC 0 everywhere: the default load
    warns (naming the file) and loads it unverified; verify=True refuses it;
    verify=False loads it silently."""
    from torch.utils.serialization import config as torch_config
    sd = _state_dict()
    path = tmp_path / "nocrc.pt"
    with torch_config.patch({"save.compute_crc32": False}):
        (fastckpt.save if writer == "fastckpt" else torch.save)(sd, path)
    assert {c for _, _, c in record_layout(path).values()} == {0}
    with pytest.warns(UserWarning, match="records no checksums") as rec:
        assert_same(sd, fastckpt.load(path))
    assert str(path) in str(rec[0].message)
    assert rec[0].filename == __file__  # points at the caller's line
    with pytest.raises(fastckpt.FormatError, match="no checksums"):
        fastckpt.load(path, verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(sd, fastckpt.load(path, verify=False))


def test_file_with_only_empty_storages_loads_without_warning(tmp_path):
    """Empty storages record CRC 0, correctly: nothing unverifiable, no warning."""
    sd = {"a": torch.zeros(0), "b": torch.zeros(0, 3)}
    fastckpt.save(sd, tmp_path / "a.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(sd, fastckpt.load(tmp_path / "a.pt"))
        assert_same(sd, fastckpt.load(tmp_path / "a.pt", verify=True))


def test_default_verify_leaves_torch_load_paths_unverified(tmp_path):
    """Loads left to torch.load (file objects, mmap=True, map_location="meta")
    are not verified under the default and do not raise; verify=True keeps
    refusing file objects and mmap."""
    sd = _state_dict()
    path = tmp_path / "a.pt"
    fastckpt.save(sd, path)
    off, _, _ = record_layout(path)["data/0"]
    flip_byte(path, off + 3)
    with open(path, "rb") as f:
        got = fastckpt.load(f)
    assert not torch.equal(got["layer.weight"], sd["layer.weight"])
    assert torch.equal(got["layer.bias"], sd["layer.bias"])
    got = fastckpt.load(path, mmap=True)
    assert torch.equal(got["layer.bias"], sd["layer.bias"])
    meta = fastckpt.load(path, map_location="meta")
    assert meta["layer.weight"].device.type == "meta" and meta["layer.weight"].shape == (64, 32)
    with pytest.raises(fastckpt.FormatError, match="layer.weight"):  # explicit: read and checked
        fastckpt.load(path, map_location="meta", verify=True)
    with open(path, "rb") as f, pytest.raises(ValueError):
        fastckpt.load(f, verify=True)


# ---------------------------------------------------------------- bad files

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError) as ei:
        fastckpt.load(tmp_path / "nope.pt")
    assert ei.value.errno == errno.ENOENT and str(tmp_path / "nope.pt") in str(ei.value.filename)
    with pytest.raises(FileNotFoundError):
        fastckpt.save({"a": 1}, tmp_path / "no-dir" / "a.pt")
    with pytest.raises(IsADirectoryError):
        fastckpt.load(tmp_path)


def _truncation_points(size, layout):
    data_off, data_size, _ = layout["data/0"]
    return {"empty": 0, "10_bytes": 10, "after_header": 4096, "mid_data": data_off + data_size // 2,
            "before_central_dir": data_off + data_size + 16, "minus_22": size - 22, "minus_1": size - 1}


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
@pytest.mark.parametrize("where", ["empty", "10_bytes", "after_header", "mid_data", "before_central_dir",
                                   "minus_22", "minus_1"])
def test_truncated_file(tmp_path, writer, where):
    path = tmp_path / "a.pt"
    (fastckpt.save if writer == "fastckpt" else torch.save)(_state_dict(), path)
    raw = path.read_bytes()
    cut = _truncation_points(len(raw), record_layout(path))[where]
    path.write_bytes(raw[:cut])
    fds = fd_count()
    with pytest.raises(fastckpt.FormatError) as ei:
        fastckpt.load(path)
    msg = str(ei.value)
    assert str(path) in msg
    assert any(w in msg for w in ("truncated", "too short", "corrupt", "not a")), msg
    assert fd_count() == fds


@pytest.mark.parametrize("content", ["random", "text", "empty_zip", "deflated_zip", "zip_without_pickle",
                                     "pk_garbage"])
def test_foreign_files(tmp_path, content):
    path = tmp_path / "x.pt"
    if content == "random":
        g = torch.Generator().manual_seed(0)
        path.write_bytes(torch.randint(0, 256, (10000,), dtype=torch.uint8, generator=g).numpy().tobytes())
    elif content == "text":
        path.write_text("model:\n  layers: 12\n" * 50)
    elif content == "empty_zip":
        zipfile.ZipFile(path, "w").close()
    elif content == "deflated_zip":
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("archive/data.pkl", pickle.dumps({"a": 1}, protocol=2) * 10)
            z.writestr("archive/version", "3\n")
    elif content == "zip_without_pickle":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("archive/version", "3\n")
    else:
        path.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(fastckpt.FormatError) as ei:
        fastckpt.load(path)
    assert str(path) in str(ei.value)


def test_torchscript_archive(tmp_path):
    scripted = torch.jit.script(nn.Linear(2, 2))
    torch.jit.save(scripted, str(tmp_path / "ts.pt"))
    with pytest.raises(fastckpt.FormatError, match="TorchScript"):
        fastckpt.load(tmp_path / "ts.pt")


def _unpicklable(kind, tmp_path):
    if kind == "lambda":
        return {"w": torch.ones(3), "fn": lambda x: x}
    if kind == "open_file":
        return {"w": torch.ones(3), "f": open(tmp_path / "handle.txt", "w")}
    if kind == "lock":
        return {"w": torch.ones(3), "lock": threading.Lock()}
    if kind == "generator":
        return [torch.ones(3), (i for i in range(3))]
    if kind == "mixed_dtype_views":  # torch.save refuses these too
        t = torch.ones(4)
        return {"f": t, "i": t.view(torch.int32)}
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["lambda", "open_file", "lock", "generator", "mixed_dtype_views"])
@pytest.mark.parametrize("existing", [False, True])
def test_unpicklable_object_writes_nothing(tmp_path, kind, existing):
    path = tmp_path / "ckpt.pt"
    old = _state_dict()
    if existing:
        fastckpt.save(old, path)
    before = path.read_bytes() if existing else None
    fds = fd_count()
    obj = _unpicklable(kind, tmp_path)
    try:
        with pytest.raises((pickle.PicklingError, TypeError, AttributeError, RuntimeError)):
            torch.save(obj, io.BytesIO())  # the reference: torch refuses it as well
        with pytest.raises((pickle.PicklingError, TypeError, AttributeError, RuntimeError)):
            fastckpt.save(obj, path)
    finally:
        if kind == "open_file":
            obj["f"].close()
        del obj
    if existing:
        assert path.read_bytes() == before
        assert_same(old, fastckpt.load(path))
    else:
        assert not path.exists()
    assert temp_files(tmp_path) == []
    assert fd_count() == fds


# ---------------------------------------------------------------- injected faults

FAULTS = [
    ("write", 1, errno.ENOSPC),
    ("write", 3, errno.ENOSPC),
    ("write", 2, errno.EIO),
    ("fsync", 1, errno.ENOSPC),
    ("fsync", 1, errno.EIO),
    ("rename", 1, errno.EXDEV),
    ("rename", 1, errno.ENOSPC),
]


@pytest.mark.parametrize("op,nth,err", FAULTS, ids=[f"{o}-{n}-{errno.errorcode[e]}" for o, n, e in FAULTS])
def test_fault_keeps_the_old_checkpoint(tmp_path, backend, op, nth, err):
    path = tmp_path / "ckpt.pt"
    old = _state_dict()
    g = torch.Generator().manual_seed(2)
    new = {"big": torch.randn(300000, generator=g), "small": torch.arange(10)}
    with fastckpt.knobs.override(backend=backend, buffer_size=64 << 10, buffer_count=4):
        fastckpt.save(old, path)  # also creates this configuration's engine
        before = path.read_bytes()
        fds, table = fd_count(), fd_table()
        _C.fault_inject(op, nth=nth, errno=err)
        with pytest.raises(OSError) as ei:
            fastckpt.save(new, path)
        assert _C.fault_fired() == 1
        e = ei.value
        assert e.errno == err, e
        assert os.strerror(err) in str(e)
        assert e.filename and str(tmp_path) in e.filename
        # The traceback keeps save()'s frames, and so its aborted writer (which holds
        # an I/O backend lease), alive: let it go before counting descriptors.
        del e, ei
        assert path.read_bytes() == before
        assert_same(old, fastckpt.load(path, verify=True))
        assert temp_files(tmp_path) == []
        now = fd_table()
        assert fd_count() == fds, ({k: v for k, v in now.items() if table.get(k) != v}, {k: v for k, v in table.items() if now.get(k) != v})
        _C.fault_clear()
        fastckpt.save(new, path)  # a retry succeeds
        assert_same(new, fastckpt.load(path, verify=True))
        assert temp_files(tmp_path) == []


def test_fault_when_creating_a_new_file(tmp_path):
    path = tmp_path / "fresh.pt"
    with fastckpt.knobs.override(buffer_size=64 << 10, buffer_count=4):
        fastckpt.save({"warm": torch.ones(1)}, tmp_path / "warm.pt")
        fds = fd_count()
        _C.fault_inject("write", nth=2, errno=errno.ENOSPC)
        with pytest.raises(OSError) as ei:
            fastckpt.save({"w": torch.randn(200000)}, path)
        assert ei.value.errno == errno.ENOSPC
        del ei
        assert not path.exists() and temp_files(tmp_path) == [] and fd_count() == fds


def test_read_fault_is_oserror(tmp_path):
    path = tmp_path / "ckpt.pt"
    with fastckpt.knobs.override(buffer_size=64 << 10, buffer_count=4):
        fastckpt.save({"w": torch.randn(300000)}, path)
        fastckpt.load(path)
        fds = fd_count()
        _C.fault_inject("read", nth=2, errno=errno.EIO)
        with pytest.raises(OSError) as ei:
            fastckpt.load(path)
        assert ei.value.errno == errno.EIO
        del ei
        assert fd_count() == fds


# ---------------------------------------------------------------- size

def test_large_tensor_and_many_small(tmp_path):
    g = torch.Generator().manual_seed(4)
    big = torch.randn((5 << 20) + 3, generator=g)  # 20 MiB + 12 bytes, > 8 staging buffers of 1 MiB
    sd = collections.OrderedDict(big=big, big_view=big[1000:].view(-1)[::1024])
    for i in range(400):
        sd[f"layers.{i}.w"] = torch.randn(i % 13 + 1, 3, generator=g).to(DTYPES[i % 8])
    path = tmp_path / "large.pt"
    with fastckpt.knobs.override(buffer_size=1 << 20):
        fastckpt.save(sd, path)
        got = fastckpt.load(path, verify=True)
    assert_same(sd, got)
    assert_same(sd, torch_load(path))
    assert_fastckpt_layout(path)
    torch.save(sd, tmp_path / "ref.pt")
    with fastckpt.knobs.override(buffer_size=1 << 20):
        assert_same(sd, fastckpt.load(tmp_path / "ref.pt", verify=True))


# ---------------------------------------------------------------- legacy format

@pytest.mark.parametrize("protocol", [2, 3])
def test_legacy_format(tmp_path, protocol):
    obj = {"views": views_obj(), "model": TinyNet().state_dict(), "nested": [1, (2.5, "x")]}
    path = tmp_path / "legacy.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    assert not zipfile.is_zipfile(path)
    ref = torch_load(path)
    assert_same(ref, fastckpt.load(path))
    assert_same(obj, fastckpt.load(path))
    assert_same(ref, fastckpt.load(path, map_location="cpu"))


@pytest.mark.parametrize("protocol", [4, 5])
def test_legacy_format_newer_protocols(tmp_path, protocol):
    # torch's weights_only unpickler cannot read these legacy files; weights_only=False can.
    obj = {"w": torch.arange(5), "v": torch.randn(4, 4).t()}
    path = tmp_path / "legacy.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    ref = torch.load(path, weights_only=False)
    assert_same(ref, fastckpt.load(path, weights_only=False))


def test_map_location_errors_pass_through_like_torch(tmp_path):
    """Errors of map_location itself are not reported as damaged files."""
    path = tmp_path / "a.pt"
    fastckpt.save({"w": torch.ones(3)}, path)

    def bad(storage, location):
        raise KeyError("no such device here")

    with pytest.raises(KeyError, match="no such device"):
        fastckpt.load(path, map_location=bad)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError) as ours:
            fastckpt.load(path, map_location="cuda:0")
        with pytest.raises(RuntimeError) as theirs:
            torch.load(path, map_location="cuda:0")
        assert not isinstance(ours.value, fastckpt.FormatError)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("weights_only", [True, False])
def test_an_argument_the_unpickler_does_not_take_is_torch_loads_typeerror(tmp_path, weights_only):
    """Extra keyword arguments go to the unpickler, as torch.load's: one it does not take is the
    caller's TypeError (as torch.load raises), before anything is read; not a FormatError calling
    the file damaged. The ones it takes load."""
    p = tmp_path / "x.pt"
    fastckpt.save({"w": torch.ones(3)}, p)
    for kw in ({"bogus": 1}, {"errors": "strict"} if weights_only else {"bogus": 2}):
        with pytest.raises(TypeError) as stock:
            torch.load(p, weights_only=weights_only, **kw)
        with pytest.raises(TypeError) as ours:
            fastckpt.load(p, weights_only=weights_only, **kw)
        assert type(ours.value) is type(stock.value) and list(kw)[0] in str(ours.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "pickle_load_args only works if weights_only=False"
        assert torch.equal(fastckpt.load(p, weights_only=weights_only, encoding="latin1")["w"], torch.ones(3))
