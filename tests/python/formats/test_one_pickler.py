"""The one torch.save pickler (fastckpt/formats/pickler.py) behind fastckpt.save,
fastckpt convert and DCP's per-tensor records: StorageRef placeholders become
the persistent ids torch.save writes, and tensor_reduce is torch's own call."""

import io
import pickle
import zipfile

import torch

from fastckpt.formats import dcp as _blob
from fastckpt.formats.pickler import pickle_with_storages, tensor_reduce
from fastckpt.formats.torch_rules import StorageRef


def _torch_pkl(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def test_a_described_tensor_pickles_as_torch_saves_the_real_one():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:]

    def reduce(obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        ref = StorageRef(torch.FloatStorage, "0", "cpu", 12)
        return tensor_reduce(ref, False, obj.dtype, obj.storage_offset(), obj.shape, obj.stride())

    described, live = pickle_with_storages({"t": t}, pickle, 2, reducer_override=reduce)
    real, storages = pickle_with_storages({"t": t}, pickle, 2)
    assert live == [] and len(storages) == 1
    assert described == real == _torch_pkl({"t": t})


def test_dcp_records_use_the_same_bytes():
    for dtype, shape in ((torch.float32, (3,)), (torch.bfloat16, (2, 5)), (torch.uint16, (4,)), (torch.bool, ())):
        assert _blob.tensor_pickle(dtype, shape) == _torch_pkl(torch.zeros(shape, dtype=dtype)), (dtype, shape)
