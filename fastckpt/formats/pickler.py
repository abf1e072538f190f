"""The torch.save pickler: an object pickled as torch.save pickles it, its
storages replaced by persistent ids and returned in key order.

The one pickler of ``data.pkl`` records. ``fastckpt.save`` and async_save
pickle live objects with it; writers that describe tensors without holding
their bytes (``fastckpt convert`` streaming from a source file, DCP's
per-tensor records) pickle :class:`~fastckpt.formats.torch_rules.StorageRef`
placeholders, which it writes as the same persistent ids, with
:func:`tensor_reduce` (the call torch.save pickles for a tensor)."""

import collections
import io
import pickle
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.serialization as ts

from .torch_rules import StorageRef, element_size, v3_dtypes


DEFAULT_PROTOCOL = 2  # torch.save's pickle protocol

# Types that are never storages (exact types: a subclass goes through persistent_id).
# Classes and functions (the rebuild functions, storage classes) are never storages either.
_PLAIN_TYPES = frozenset([str, int, float, bool, type(None), tuple, list, dict, bytes, torch.Size, torch.dtype,
                          torch.device, torch.Tensor, torch.nn.Parameter, collections.OrderedDict,
                          type, type(torch.FloatStorage), types.FunctionType, types.BuiltinFunctionType])


def tensor_reduce(ref: StorageRef, untyped: bool, dtype: torch.dtype, storage_offset: int, size: Sequence[int],
                  stride: Sequence[int], requires_grad: bool = False, metadata: Any = None) -> Tuple[Callable, Tuple]:
    """What torch.save pickles for a dense tensor on storage `ref`:
    ``_rebuild_tensor_v2`` (a typed storage), or ``_rebuild_tensor_v3`` with
    the dtype (an untyped one: the dtypes of :func:`torch_rules.v3_dtypes`);
    `metadata` (``torch._utils.get_tensor_metadata``) only when there is some."""
    args: Tuple = (ref, storage_offset, tuple(size), tuple(stride), requires_grad, collections.OrderedDict())
    if untyped:
        fn = torch._utils._rebuild_tensor_v3
        args = args + (dtype,)
    else:
        fn = torch._utils._rebuild_tensor_v2
    if metadata:
        args = args + (metadata,)
    return fn, args


_FAST_DEVICES = frozenset(["cpu", "cuda"])


def _storage_object(t: torch.Tensor, v3: bool) -> Any:
    """The storage object ``Tensor.__reduce_ex__`` pickles for `t`: its untyped
    storage (v3 dtypes), else a TypedStorage of its dtype."""
    if v3:
        return t.untyped_storage()
    return torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)


def plain_tensor_reduce(t: Any, storage_of: Callable[[torch.Tensor, bool], Any] = _storage_object) -> Any:
    """What ``Tensor.__reduce_ex__`` returns for `t`, computed without its
    detour (``_get_obj_state``, ``copyreg._slotnames``, ``warn_if_has_hooks``:
    half of torch.save's time for a state of many small tensors), for the
    tensors where that detour changes nothing: exactly ``torch.Tensor`` (no
    subclass), strided, on the CPU or a CUDA device, not quantized, no Python
    attributes and no backward hooks. Anything else: ``NotImplemented`` (the
    pickler then asks the tensor, as torch.save does). ``storage_of(t, v3)``:
    what stands for the storage in the reduction (by default the storage
    object torch pickles; :func:`pickle_with_storages` puts its persistent
    id there at once)."""
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_quantized or t.is_nested \
            or t.device.type not in _FAST_DEVICES or t._backward_hooks or t.__dict__:
        return NotImplemented
    if t.dtype in v3_dtypes():
        fn = torch._utils._rebuild_tensor_v3
        args: Tuple = (storage_of(t, True), t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad,
                       collections.OrderedDict(), t.dtype)
    else:
        fn = torch._utils._rebuild_tensor_v2
        args = (storage_of(t, False), t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad,
                collections.OrderedDict())
    metadata = torch._utils.get_tensor_metadata(t)
    if metadata:
        args = args + (metadata,)
    return fn, args


def pickle_with_storages(obj, pickle_module, pickle_protocol, skip_data: bool = False,
                         reducer_override: Optional[Callable[[Any], Any]] = None,
                         ) -> Tuple[bytes, List[torch.UntypedStorage]]:
    """Pickle `obj` the way torch.save does: storages become persistent ids
    ("storage", storage type, key, location, numel) and are returned in key order.
    With ``skip_data`` (torch.serialization.skip_data) storages without data
    (meta, fake tensors) are allowed: their bytes will not be written.
    A :class:`StorageRef` is pickled as its own persistent id (it is not
    returned: its bytes are the caller's), one without a key but with a
    payload as the next storage key, its payload returned in the storages'
    place; `reducer_override`, if given, is
    the pickler's (``pickle.Pickler.reducer_override``: a reduce tuple, or
    NotImplemented for the usual pickling)."""
    storages: List[torch.UntypedStorage] = []
    keys: Dict[int, str] = {}
    storage_dtypes: Dict[int, torch.dtype] = {}

    def storage_pid(storage: torch.UntypedStorage, storage_dtype: torch.dtype, storage_type: Any, numel: int,
                    fake_device: Any = None) -> Tuple:
        """torch.save's persistent id of `storage` (its bytes seen as `storage_dtype`), the storage numbered."""
        device = storage.device
        if device.type != "meta" and storage.data_ptr() != 0:
            seen = storage_dtypes.setdefault(storage.data_ptr(), storage_dtype)
            if seen != storage_dtype:
                raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
        key = keys.get(storage._cdata)
        if key is None:
            key = keys[storage._cdata] = str(len(storages))
            storages.append(storage)
        # (each storage's own tag: a tagger registered with torch may look at more than the device)
        location = str(fake_device) if fake_device is not None else ts.location_tag(storage)
        return ("storage", storage_type, key, location, numel)

    def persistent_id(o):
        if isinstance(o, StorageRef):
            if o.pid[2] is None and o.payload is not None:  # numbered with the live storages
                o.pid = o.pid[:2] + (str(len(storages)),) + o.pid[3:]
                storages.append(o.payload)
            return o.pid
        if isinstance(o, torch.storage.TypedStorage):
            storage = o._untyped_storage
            return storage_pid(storage, o.dtype, getattr(torch, o._pickle_storage_type()),
                               storage.nbytes() // element_size(o.dtype),  # o._size(), without its torch.finfo
                               getattr(o, "_fake_device", None))
        if torch.is_storage(o):
            return storage_pid(o, torch.uint8, ts.normalize_storage_type(type(o)), o.nbytes(),
                               getattr(o, "_fake_device", None))
        return None

    def pid_of_tensor(t: torch.Tensor, v3: bool) -> StorageRef:
        """The persistent id of a plain tensor's storage, as persistent_id gives it for the storage object
        torch would pickle (:func:`_storage_object`), without making that object."""
        storage = t.untyped_storage()
        if v3:
            pid = storage_pid(storage, torch.uint8, torch.UntypedStorage, storage.nbytes())
        else:  # the legacy storage class (FloatStorage, ...), as TypedStorage._pickle_storage_type and storage_ref
            dtype = t.dtype  # name it (a dtype it has none for: torch's own KeyError)
            kind = getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
            pid = storage_pid(storage, dtype, kind, storage.nbytes() // element_size(dtype))
        return StorageRef(*pid[1:])

    def fast_reduce(o: Any) -> Any:
        return plain_tensor_reduce(o, pid_of_tensor)

    plain = _PLAIN_TYPES

    class Pickler(pickle_module.Pickler):  # type: ignore[name-defined]
        def persistent_id(self, o):
            # called for every object pickled (17 times a tensor): the common
            # types, which are never storages, answered without a call
            return None if type(o) in plain else persistent_id(o)

    cls = Pickler
    if reducer_override is not None:
        class Reducing(Pickler):
            def reducer_override(self, o):
                r = reducer_override(o)
                return fast_reduce(o) if r is NotImplemented else r
        cls = Reducing
    elif getattr(pickle_module, "Pickler", None) is pickle.Pickler:  # the C pickler, which asks reducer_override
        class Plain(Pickler):
            def reducer_override(self, o):
                return fast_reduce(o)
        cls = Plain

    buf = io.BytesIO()
    cls(buf, protocol=pickle_protocol).dump(obj)
    for s in storages:
        if isinstance(s, torch.UntypedStorage) and s.device.type == "meta" and not skip_data:
            raise ValueError("fastckpt.save: cannot save meta tensors (they have no data)")
    return buf.getvalue(), storages

