"""The torch.save pickler: an object pickled as torch.save pickles it, its
storages replaced by persistent ids and returned in key order."""

import collections
import io
import types
from typing import Dict, List, Tuple

import torch
import torch.serialization as ts


DEFAULT_PROTOCOL = 2  # torch.save's pickle protocol

# Types that are never storages (exact types: a subclass goes through persistent_id).
# Classes and functions (the rebuild functions, storage classes) are never storages either.
_PLAIN_TYPES = frozenset([str, int, float, bool, type(None), tuple, list, dict, bytes, torch.Size, torch.dtype,
                          torch.device, torch.Tensor, torch.nn.Parameter, collections.OrderedDict,
                          type, type(torch.FloatStorage), types.FunctionType, types.BuiltinFunctionType])


def pickle_with_storages(obj, pickle_module, pickle_protocol, skip_data: bool = False) -> Tuple[bytes, List[torch.UntypedStorage]]:
    """Pickle `obj` the way torch.save does: storages become persistent ids
    ("storage", storage type, key, location, numel) and are returned in key order.
    With ``skip_data`` (torch.serialization.skip_data) storages without data
    (meta, fake tensors) are allowed: their bytes will not be written."""
    storages: List[torch.UntypedStorage] = []
    keys: Dict[int, str] = {}
    storage_dtypes: Dict[int, torch.dtype] = {}

    def persistent_id(o):
        if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
            if isinstance(o, torch.storage.TypedStorage):
                storage = o._untyped_storage
                storage_dtype = o.dtype
                storage_type = getattr(torch, o._pickle_storage_type())
                numel = o._size()
            else:
                storage = o
                storage_dtype = torch.uint8
                storage_type = ts.normalize_storage_type(type(o))
                numel = storage.nbytes()
            if str(storage.device) != "meta" and storage.data_ptr() != 0:
                seen = storage_dtypes.setdefault(storage.data_ptr(), storage_dtype)
                if seen != storage_dtype:
                    raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
            key = keys.get(storage._cdata)
            if key is None:
                key = keys[storage._cdata] = str(len(storages))
                storages.append(storage)
            location = str(o._fake_device) if getattr(o, "_fake_device", None) is not None else ts.location_tag(storage)
            return ("storage", storage_type, key, location, numel)
        return None

    plain = _PLAIN_TYPES

    class Pickler(pickle_module.Pickler):  # type: ignore[name-defined]
        def persistent_id(self, o):
            # called for every object pickled (17 times a tensor): the common
            # types, which are never storages, answered without a call
            return None if type(o) in plain else persistent_id(o)

    buf = io.BytesIO()
    Pickler(buf, protocol=pickle_protocol).dump(obj)
    for s in storages:
        if s.device.type == "meta" and not skip_data:
            raise ValueError("fastckpt.save: cannot save meta tensors (they have no data)")
    return buf.getvalue(), storages

