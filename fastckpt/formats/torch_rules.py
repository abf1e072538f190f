"""What torch.save and torch.load decide from their arguments, torch's
settings and the environment, for fastckpt.save / fastckpt.load to decide
the same: the weights-only rules, the loads that read no data, the record
alignment and the checksums; and how torch.save describes a storage in
``data.pkl`` (its persistent id, the dtypes pickled as untyped storages,
element sizes, contiguous strides), for every writer of such pickles. torch inlines most of these in torch.load and
torch._save; where it has a helper (``_default_to_weights_only``,
``_get_storage_alignment``, ``get_crc32_options``, ``_is_meta_location``) it is
called, and tests/python/formats/test_torch_semantics.py checks the result against
torch's own functions.
"""

import functools
import os
import pickle
import re
import sys
import warnings
from typing import IO, Any, Callable, Dict, FrozenSet, Optional, Sequence, Tuple, Union

import torch
import torch.serialization as ts

from . import zip as _zip

__all__ = ["weights_only_policy", "weights_only_failure", "reads_no_data", "storage_alignment", "compute_crc32", "default_mmap",
           "default_load_endianness",
           "CONFIG_DEFAULTS", "StorageRef",
           "v3_dtypes", "itemsize", "contiguous_stride"]


# What torch.save and torch.load take as a file and as a map_location.
FileLike = Union[str, os.PathLike, IO[bytes]]
MapLocation = Union[None, str, torch.device, Dict[str, str], Callable]

_TRUE_VALUES = ("1", "y", "yes", "true")  # torch.load's, for its TORCH_FORCE_* variables


def weights_only_policy(weights_only: Optional[bool], pickle_module: Any) -> Tuple[bool, Any]:
    """``(weights_only, pickle_module)`` as torch.load decides them (torch
    inlines this in torch.load, so it is followed step by step here, with
    torch's own default rule ``_default_to_weights_only``, and checked
    against torch.load by tests/python/formats/test_torch_semantics.py):

    - ``None`` means weights-only unless a ``pickle_module`` is given;
    - ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` forces weights-only, even over
      ``weights_only=False``; ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns an
      unset ``weights_only`` into False, with torch's warning; both set is an error;
    - weights-only with an explicit ``pickle_module`` is an error; otherwise a
      missing ``pickle_module`` is :mod:`pickle`.
    """
    not_set = weights_only is None
    if not_set:
        default = getattr(ts, "_default_to_weights_only", None)
        weights_only = default(pickle_module) if default else pickle_module is None
    force = os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES
    force_no = os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES
    if force and force_no:
        raise RuntimeError("Only one of `TORCH_FORCE_WEIGHTS_ONLY_LOAD` or `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` "
                           "should be set, but both were set.")
    if force:
        weights_only = True
    elif force_no and not_set:
        warnings.warn("Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected, since the"
                      "`weights_only` argument was not explicitly passed to `torch.load`, forcing weights_only=False.",
                      UserWarning, stacklevel=3)
        weights_only = False
    if weights_only:
        if pickle_module is not None:
            raise RuntimeError("Can not safely load weights when explicit pickle_module is specified")
    elif pickle_module is None:
        pickle_module = pickle
    return bool(weights_only), pickle_module


_DOCS_MESSAGE = ("\n\nCheck the documentation of torch.load to learn more about types accepted by default with "
                 "weights_only https://pytorch.org/docs/stable/generated/torch.load.html.")


def weights_only_failure(message: str, from_torch: bool = True) -> str:
    """torch.load's message for a refusal by its weights-only unpickler, whose
    error is `message` (torch builds it in a function nested in torch.load,
    ``_get_wo_message``, so it is followed here line by line, and
    tests/python/formats/test_unpickler_rules.py compares the result with torch.load's):
    for a global that is not allowed, the two ways to load the file and torch's
    error, which names the global and how to allow it
    (``torch.serialization.add_safe_globals([...])`` or the ``safe_globals``
    context); otherwise torch's warning and the error. `from_torch=False` is
    for a refusal of fastckpt's own walk (an opcode torch.save never writes):
    torch's words without its request to report the file to torch."""
    unsafe = getattr(ts, "UNSAFE_MESSAGE", "")
    if re.search(r"GLOBAL (\S+) was not an allowed global by default.", message) is not None:
        out = ("Weights only load failed. This file can still be loaded, to do so you have two options, "
               "\033[1mdo those steps only if you trust the source of the checkpoint\033[0m. "
               f"\n\t(1) {unsafe}\n\t(2) Alternatively, to load with `weights_only=True` please check "
               "the recommended steps in the following error message.\n\tWeightsUnpickler error: " + message)
    else:
        if re.search(r"(\S+) must be (\S+) to load", message) is not None:
            return f"Weights only load failed. {message}\n {unsafe}\n"
        out = f"Weights only load failed. {unsafe}\n"
        if from_torch and re.search(r"whose module (\S+) is blocked", message) is None:
            out += ("Please file an issue with the following so that we can make "
                    "`weights_only=True` compatible with your use case: WeightsUnpickler error: ")
        out += "\n\n" + message
    return out + _DOCS_MESSAGE


def reads_no_data(map_location: Any) -> bool:
    """torch.load reads no storage bytes here (a meta map_location, an active
    fake mode, torch.serialization.skip_data()), so neither does fastckpt.load:
    it leaves such loads to torch.load."""
    is_meta = getattr(ts, "_is_meta_location", None)
    return bool(ts._serialization_tls.skip_data or torch._guards.detect_fake_mode(None) is not None
                or (is_meta(map_location) if is_meta else isinstance(map_location, str) and map_location == "meta"))


# torch's serialization settings are in torch.utils.serialization.config, which torch imports on its
# first save or load; that first import takes 10-15 ms (the config module parses its own source). While
# no code has imported it, no setting can differ from its default, so fastckpt takes the defaults
# without importing it (tests/python/formats/test_torch_semantics.py checks them against torch's).
_CONFIG = "torch.utils.serialization.config"
CONFIG_DEFAULTS = {"save.storage_alignment": _zip.TORCH_ALIGNMENT, "save.compute_crc32": True, "load.mmap": False,
                   "load.endianness": None}


def _setting(name: str, read: Optional[Callable[[], Any]]) -> Any:
    """torch's setting `name` (a key of CONFIG_DEFAULTS) as `read()` gives it once torch's config
    module is imported; its default before that, or where this torch has no such reader."""
    if read is None or _CONFIG not in sys.modules:
        return CONFIG_DEFAULTS[name]
    return read()


def storage_alignment() -> int:
    """torch's ``config.save.storage_alignment`` (64 by default): the alignment
    of a new file's records, or a multiple of it and of 4096 where large
    storages dominate (:func:`fastckpt.formats.zip.storage_alignment`)."""
    return max(1, int(_setting("save.storage_alignment", getattr(ts, "_get_storage_alignment", None))))


def compute_crc32() -> bool:
    return bool(_setting("save.compute_crc32", getattr(ts, "get_crc32_options", None)))


def default_mmap() -> bool:
    """torch's ``config.load.mmap``: what ``torch.load(mmap=None)`` does."""
    return bool(_setting("load.mmap", lambda: sys.modules[_CONFIG].load.mmap))


def default_load_endianness() -> Any:
    """torch's ``config.load.endianness`` (``get_default_load_endianness()``): the byte order of a
    file without a byteorder record (None: native)."""
    return _setting("load.endianness", ts.get_default_load_endianness)


# ---------------------------------------------------------------- storages in data.pkl

class StorageRef:
    """Pickled (by a Pickler whose ``persistent_id`` returns ``obj.pid``) as
    torch.save's persistent id of a storage: ``("storage", storage type, key,
    location, numel)``."""

    def __init__(self, storage_type, key: Optional[str], location: str, numel: int, payload: Any = None):
        self.pid = ("storage", storage_type, key, location, numel)
        # With `payload` and no key, the pickler numbers it with the live storages (the next key
        # in order of first use) and returns `payload` in their list (its bytes are the caller's).
        self.payload = payload


def storage_ref(dtype: torch.dtype, nbytes: int, location: str = "cpu", key: Optional[str] = None,
                payload: Any = None, untyped: bool = False) -> Tuple[StorageRef, bool]:
    """(the persistent id torch.save writes for a storage of `nbytes` bytes that tensors of `dtype`
    view, whether it is untyped): an untyped storage for the dtypes torch.save pickles with
    ``_rebuild_tensor_v3`` (and those without a typed storage class, or with `untyped`), else the
    dtype's typed storage class with its element count."""
    names = torch.storage._dtype_to_storage_type_map()
    untyped = untyped or dtype in v3_dtypes() or dtype not in names
    if untyped:
        return StorageRef(torch.UntypedStorage, key, location, nbytes, payload), True
    return StorageRef(getattr(torch, names[dtype]), key, location, nbytes // itemsize(dtype), payload), False


def is_dtensor(obj: Any) -> bool:
    """Whether `obj` is a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed:
    a DTensor exists only once its module is loaded)."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(obj, cls)


@functools.lru_cache(maxsize=1)
def v3_dtypes() -> FrozenSet[torch.dtype]:
    """The dtypes torch.save pickles with an untyped storage (``_rebuild_tensor_v3``)."""
    new = getattr(torch.storage, "_new_dtypes", None)
    return frozenset(new() if new is not None else ())


@functools.lru_cache(maxsize=None)
def element_size(dtype: torch.dtype) -> int:
    """``torch._utils._element_size(dtype)`` (what torch's serialization divides a storage's bytes
    by, and multiplies a pickled numel by), raising as it raises, computed once per dtype (it builds
    a ``torch.finfo``)."""
    return torch._utils._element_size(dtype)


@functools.lru_cache(maxsize=None)
def itemsize(dtype: torch.dtype) -> int:
    """The bytes of one element of `dtype` in memory (``Tensor.element_size()``), raising as making
    a tensor of it raises, computed once per dtype (a header of a thousand tensors asked it a
    thousand times, 7 us each)."""
    return torch.empty((), dtype=dtype).element_size()


def contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    """The row-major strides of `shape` (a size-0 dimension counts as 1, as in torch)."""
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))
