"""The weights-only load of a plain state dict with CPython's C unpickler (``fastckpt.load``,
and the meta tree of :class:`fastckpt.sources.ZipSource` that ``load_into`` and the command read).

torch's weights-only unpickler interprets every opcode in Python: for a state of many small
tensors it is most of ``torch.load``'s time (and of ``fastckpt.load``'s). A ``data.pkl`` that the
one safety walk (:func:`fastckpt.formats.unpickler.check`) found to keep to the vocabulary of a
torch.save'd state dict (``PickleVerdict::plain`` in csrc/pickle/pickle_scan.h: OrderedDict,
the tensor and parameter rebuild functions, torch.Size, storage classes and dtypes as values;
calls only of those; BUILD only of an OrderedDict with a dict; the opcodes torch.save writes for
dicts, lists, tuples, numbers and strings) is unpickled here instead, by the C unpickler:

* ``find_class`` returns the objects of torch's own allow-list
  (``torch._weights_only_unpickler._get_allowed_globals``) for exactly those names, nothing else;
* ``persistent_load`` builds each storage as torch's loader does (the record's bytes, the
  location restored once per key, a ``TypedStorage`` of the pickled dtype, shared by the
  tensors that name the same key);
* what the walk checked makes every opcode do what torch's unpickler does with it (the
  same calls with the same arguments, the same containers filled).

Anything outside the vocabulary that only shows while unpickling (a name of module torch that is
not a storage class or dtype, a persistent id that is not a storage, an unusual setting of
torch's: fake tensors, skip_data, a byte order to swap, extra unpickler arguments) raises
:class:`NotPlain`; the caller then runs torch's own unpickler on the same records, which decides
and words any error exactly as ``torch.load`` would."""

import io
import pickle
import sys
from typing import Any, Callable, Dict, Optional

import torch
import torch.serialization as ts

from ..formats import torch_rules as _torch_rules
from ..formats.torch_rules import element_size

__all__ = ["NotPlain", "load_plain", "PLAIN_CALLS"]

# The callables of the vocabulary (their objects come from torch's allow-list).
PLAIN_CALLS = frozenset(["collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                         "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_parameter", "torch.Size"])


class NotPlain(Exception):
    """The pickle or the settings leave the plain vocabulary: torch's unpickler must judge it."""


def _is_storage_type(obj: Any) -> bool:
    """What torch's allow-list gives for a storage class's name: a StorageType (its dtype).
    (torch.UntypedStorage is not on it: a pickle naming it goes to torch's unpickler.)"""
    return isinstance(obj, ts.StorageType)


def _settings_allow(reader: Any, pickle_load_args: Dict[str, Any]) -> None:
    if set(pickle_load_args) - {"encoding"}:
        raise NotPlain("unpickler arguments other than encoding")
    if torch._guards.detect_fake_mode(None) is not None or ts._serialization_tls.skip_data:
        raise NotPlain("fake tensors or skip_data")
    if reader.has_record("byteorder"):
        order = reader.get_record("byteorder")
        if order != sys.byteorder.encode():
            raise NotPlain("a byte order to swap (or an unknown one)")
    elif sys.byteorder != "little" or _torch_rules.default_load_endianness() not in (None, ts.LoadEndianness.LITTLE):
        raise NotPlain("no byteorder record, and not a little-endian load")


class _Unpickler(pickle.Unpickler):
    """load_plain's unpickler. A class of the module, its state on the instance: a class made per
    call, its methods closing over the reader and the storages, would be a reference cycle
    (class, methods, cells) holding the loaded tensors' memory after the caller dropped them,
    until Python's cyclic collector next ran."""

    def __init__(self, file: Any, allowed: Dict[str, Any], reader: Any, restore_location: Any,
                 meta_storage: Optional[Callable[[tuple, Any], None]], **pickle_load_args: Any):
        super().__init__(file, **pickle_load_args)
        self._allowed = allowed
        self._reader = reader
        self._restore_location = restore_location
        self._meta_storage = meta_storage
        self._loaded: Dict[str, Any] = {}

    def find_class(self, module, name):
        full = f"{module}.{name}"
        obj = self._allowed.get(full)
        if obj is None or not (full in PLAIN_CALLS or (module == "torch" and (
                isinstance(obj, torch.dtype) or _is_storage_type(obj)))):
            raise NotPlain(full)
        return obj

    def persistent_load(self, pid):
        if type(pid) is not tuple or len(pid) != 5 or ts._maybe_decode_ascii(pid[0]) != "storage":
            raise NotPlain("a persistent id that is not a storage")
        _, storage_type, key, location, numel = pid
        if not _is_storage_type(storage_type) or type(key) is not str or type(numel) is not int:
            raise NotPlain("an unusual storage id")
        typed = self._loaded.get(key)
        if typed is not None:
            return typed
        dtype = storage_type.dtype
        nbytes = numel * element_size(dtype)
        if self._meta_storage is not None:  # as torch's loader makes it for map_location="meta"
            wrap = torch.UntypedStorage(nbytes, device="meta")
            self._meta_storage(pid, wrap)
        else:
            storage = self._reader.get_storage_from_record(f"data/{key}", nbytes, torch.UntypedStorage).untyped_storage()
            wrap = self._restore_location(storage, ts._maybe_decode_ascii(location))
        typed = torch.storage.TypedStorage(wrap_storage=wrap, dtype=dtype, _internal=True)
        if typed._data_ptr() != 0:
            self._loaded[key] = typed
        return typed


def load_plain(reader: Any, restore_location: Any, pickle_load_args: Dict[str, Any],
               meta_storage: Optional[Callable[[tuple, Any], None]] = None) -> Any:
    """Unpickle ``reader``'s data.pkl (a plain state dict, by the walk's verdict) as torch's
    weights-only loader would, with the C unpickler. ``reader`` is the records' reader
    (:class:`fastckpt.torchsave.reader.Reader`), ``restore_location`` the loader's
    ``restore_location(storage, location)``. With ``meta_storage`` the tree is built as
    ``torch.load(map_location="meta")`` builds it (``restore_location`` is then ``"meta"``): no
    record is read, each storage is a meta storage of the record's size, and
    ``meta_storage(pid, untyped)`` is called with its persistent id. Raises :class:`NotPlain`
    (nothing of the user's was changed: the caller loads the same records with torch's
    unpickler) or what a read or ``meta_storage`` raised."""
    _settings_allow(reader, pickle_load_args)
    from torch import _weights_only_unpickler as wo
    unpickler = _Unpickler(io.BytesIO(reader.get_record("data.pkl")), wo._get_allowed_globals(), reader,
                           restore_location, meta_storage, **pickle_load_args)
    ts._serialization_tls.map_location = restore_location  # as torch's loader sets it while unpickling
    try:
        result = unpickler.load()
    finally:
        ts._serialization_tls.map_location = None
    torch._utils._validate_loaded_sparse_tensors()
    torch._C._log_api_usage_metadata("torch.load.metadata", {"serialization_id": reader.serialization_id()})
    return result
