"""The pickler's shortcut for plain tensors (plain_tensor_reduce: torch.Tensor.__reduce_ex__ without
its detour) pickles exactly what torch.save pickles: data.pkl byte for byte, for every kind of tensor
a state dict holds, the shortcut's and the others (which it leaves to the tensor's own reduction)."""
import warnings
import zipfile

import pytest
import torch

import fastckpt
from fastckpt.formats.pickler import plain_tensor_reduce


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g)
    attr = torch.randn(2)
    attr.note = "kept"
    hooked = torch.randn(3, requires_grad=True)
    hooked.register_hook(lambda grad: grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(4, generator=g), 0.1, 0, torch.qint8)
    return {
        "plain": (torch.randn(5, generator=g), True), "scalar": (torch.tensor(3.0), True),
        "view": (x[1:, 2:], True), "transposed": (x.t(), True), "bf16": (torch.randn(7, generator=g).bfloat16(), True),
        "uint16 (v3)": (torch.zeros(5, dtype=torch.uint16), True),
        "float8 (v3)": (torch.zeros(4, dtype=torch.float8_e4m3fn), True),
        "conj": (torch.randn(3, dtype=torch.complex64, generator=g).conj(), True),
        "requires_grad": (torch.randn(3, requires_grad=True), True), "empty": (torch.empty(0, 3), True),
        "bool": (torch.tensor([True, False]), True), "int64": (torch.arange(9), True),
        "parameter": (torch.nn.Parameter(torch.randn(2, generator=g)), False), "attribute": (attr, False),
        "hooked": (hooked, False), "quantized": (q, False), "sparse": (torch.randn(3, 3, generator=g).to_sparse(), False),
        "meta": (torch.empty(3, device="meta"), False),
    }


CASES = _cases()


def _pkl(path):
    z = zipfile.ZipFile(path)
    return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


@pytest.mark.parametrize("name", [n for n in CASES if n != "meta"])
def test_data_pkl_is_torch_saves(tmp_path, name):
    t, _ = CASES[name]
    obj = {"t": t, "again": [t, t], "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(obj, tmp_path / "torch.pt")
        fastckpt.save(obj, tmp_path / "fast.pt")
    assert _pkl(tmp_path / "fast.pt") == _pkl(tmp_path / "torch.pt")


@pytest.mark.parametrize("name", list(CASES))
def test_which_tensors_take_the_shortcut(name):
    t, fast = CASES[name]
    got = plain_tensor_reduce(t)
    assert (got is not NotImplemented) == fast
    if fast:
        assert got[0] in (torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3)
        assert got[1][1:5] == (t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad)


def test_a_state_dict_of_many_tensors(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    obj = {"model": model.state_dict(), "optim": opt.state_dict(), "scalars": [torch.tensor(float(i)) for i in range(50)]}
    torch.save(obj, tmp_path / "torch.pt")
    fastckpt.save(obj, tmp_path / "fast.pt")
    assert _pkl(tmp_path / "fast.pt") == _pkl(tmp_path / "torch.pt")


def test_the_shortcut_numbers_shared_storages_once_and_refuses_two_dtypes_as_torch_does(tmp_path):
    """The shortcut gives a plain tensor's storage its persistent id at once (no storage object made):
    tensors sharing one storage get one key, in torch's order, across dtypes of both rebuild functions;
    one storage viewed as two dtypes is torch's own RuntimeError."""
    base = torch.arange(64, dtype=torch.float32)
    obj = {"a": base[:8], "u16": torch.zeros(4, dtype=torch.uint16), "b": base[8:], "c": base.view(8, 8)[1],
           "h": torch.ones(3, dtype=torch.float16), "scalars": [torch.tensor(float(i)) for i in range(5)]}
    torch.save(obj, tmp_path / "torch.pt")
    fastckpt.save(obj, tmp_path / "fast.pt")
    assert _pkl(tmp_path / "fast.pt") == _pkl(tmp_path / "torch.pt")
    mixed = {"f": base, "i": base.view(torch.int32)}
    with pytest.raises(RuntimeError, match="view the same data as different types") as theirs:
        torch.save(mixed, tmp_path / "t2.pt")
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        fastckpt.save(mixed, tmp_path / "f2.pt")
    assert theirs.value is not None and not (tmp_path / "f2.pt").exists()
