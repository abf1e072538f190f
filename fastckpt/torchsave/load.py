"""The unpickling half of fastckpt.load: torch's own loader (and its
weights-only unpickler) over records read, or being read, by the engine."""

import logging
import pickle
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.serialization as ts

from .._core import paths as _paths
from ..errors import FormatError
from ..formats import unpickler as _unpickle
from ..formats.pickle_scan import is_legacy, unpickling_reads_no_data
from ..formats.torch_rules import MapLocation
from .device import DeviceRecords, moves_off_cpu, open_for_device
from .plain import load_plain
from .reader import Reader, Records, check_storages, read_archive, weights_only_message

log = logging.getLogger("fastckpt")


def tensor_names(reader: Reader, records: List[str], pickle_module, pickle_load_args) -> List[str]:
    """Names (paths in the loaded object) of the tensors stored in `records`."""
    offsets = {reader.get_record_offset(n): n for n in records}
    try:
        meta = ts._load(reader, "meta", pickle_module, **pickle_load_args)
    except Exception:  # the pickle itself is unreadable: report the records alone
        return [f"record {n!r}" for n in records]
    found: List[str] = []
    todo = [(meta, "")]  # a loop, not recursion: the object may be nested deeper than Python's stack
    seen = set()
    while todo:
        o, path = todo.pop()
        if isinstance(o, torch.Tensor):
            off = getattr(o.untyped_storage(), "_checkpoint_offset", None)
            if off in offsets:
                found.append(f"tensor {path or '<root>'} (record {offsets[off]!r})")
        elif isinstance(o, (dict, list, tuple)) and id(o) not in seen:
            seen.add(id(o))
            items = o.items() if isinstance(o, dict) else ((f"[{i}]", v) for i, v in enumerate(o))
            kids = [(v, (f"{path}.{k}" if path else str(k)) if isinstance(o, dict) else f"{path}{k}")
                    for k, v in items]
            todo.extend(reversed(kids))
    return found or [f"record {n!r}" for n in records]


class _MapLocationError(Exception):
    """Carries an error of map_location out of the unpickler unchanged."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def is_plain_cpu(map_location: MapLocation) -> bool:
    """map_location leaves every storage where it is, on the CPU, without a call of the user's."""
    return map_location is None or (isinstance(map_location, (str, torch.device))
                                    and torch.device(map_location).type == "cpu" and
                                    torch.device(map_location).index is None)


def load_weights_only(path: str, small, archive, storages, map_location, pickle_load_args):
    """load()'s unpickling while read_behind fills the storages (weights-only,
    map_location None or the CPU). A storage tagged with another location
    (restored there by torch's rules, copying its bytes) waits for the reads."""
    return unpickle_records(path, small, archive, storages, [], _restore_behind(storages, map_location), True,
                            ts._weights_only_unpickler, None, pickle_load_args)


def _restore_behind(storages: "Records", map_location: MapLocation):
    """torch's restore for map_location None or the CPU, for storages still
    being read: one bound for a location other than the CPU (its bytes are
    copied there) waits for the reads first."""
    cpu = map_location is not None

    def restore(storage, location):
        target = "cpu" if cpu else location
        if target != "cpu":
            storages.join()
        return ts.default_restore_location(storage, target)
    return restore


def unpickle_records(path: str, small, archive, storages, bad, map_location, weights_only: bool, pickle_module,
               verify: Optional[bool], pickle_load_args):
    """The unpickling half of :func:`load`, over records read (or being read)."""
    plain: List[bool] = []  # the walk's verdict: a plain state dict (fastckpt.torchsave.plain)
    if weights_only:
        pickle_module = ts._weights_only_unpickler
        # torch's weights-only unpickler is never handed a pickle that nests deep
        # enough to overflow the C stack (a key hashed a million tuples deep) or
        # that would allocate far more than its size: the one walk (formats.unpickler.check), which
        # leaves every class and callable to torch's rules.
        try:
            _unpickle.check(small["data.pkl"], f"{path}: data.pkl", plain=plain)
        except _unpickle.Refused as e:
            raise pickle.UnpicklingError(weights_only_message(path, str(e), from_torch=False)) from None
    reader = Reader(archive, small, storages)
    if bad:
        names = tensor_names(reader, bad, pickle_module, pickle_load_args)
        raise FormatError(f"{path}: checksum mismatch (corrupt data) in {', '.join(names)}")
    restore_arg, done = map_location, (lambda result: result)
    if isinstance(storages, DeviceRecords):
        restore_arg = storages.restore_location

        def done(result):  # the device storages' bytes, through the staging pool
            bad = storages.finish(verify)
            storages.unseal()
            if bad:
                names = tensor_names(reader, bad, pickle_module, pickle_load_args)
                raise FormatError(f"{path}: checksum mismatch (corrupt data) in {', '.join(names)}")
            return result
    if not weights_only:
        return done(ts._load(reader, restore_arg, pickle_module, **pickle_load_args))
    # The restricted unpickler runs no code from the file, so anything it
    # raises, other than a refusal, comes from a damaged pickle; errors of
    # map_location itself are passed through unchanged.
    restore = ts._get_restore_location(restore_arg)

    def restore_location(storage, location):
        if not isinstance(location, str):
            raise FormatError(f"{path}: data.pkl is damaged: storage location {location!r} is not a string")
        try:
            return restore(storage, location)
        except Exception as e:
            try:
                torch.device(location)
            except Exception:
                raise FormatError(f"{path}: data.pkl is damaged: unknown storage location {location!r}") from e
            raise _MapLocationError(e) from e

    if plain and plain[0] and not isinstance(storages, DeviceRecords):
        # A plain state dict: the C unpickler builds what torch's would (fastckpt.torchsave.plain).
        # Anything it does not know, or any other error, and torch's unpickler loads the same
        # records (and words the error as torch.load does); fastckpt's own errors (a read, a record,
        # a location, map_location's) are the ones torch's unpickler would meet at the same point.
        try:
            return done(load_plain(reader, restore_location, pickle_load_args))
        except _MapLocationError as e:
            raise e.error from None
        except (FormatError, OSError):
            raise
        except Exception:  # noqa: BLE001 - decided again, and reported, by torch's unpickler below
            pass
    try:
        result = ts._load(reader, restore_location, pickle_module, **pickle_load_args)
    except _MapLocationError as e:
        raise e.error from None
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(weights_only_message(path, str(e))) from None
    except (FormatError, OSError):
        raise
    except Exception as e:
        raise FormatError(f"{path}: data.pkl is damaged and cannot be unpickled "
                          f"({type(e).__name__}: {e})") from e
    return done(result)


def load_path(path: str, map_location: MapLocation, weights_only: bool, pickle_module: Any,
              verify: Optional[bool], pickle_load_args: Dict[str, Any]) -> Any:
    """fastckpt.load of a path, its arguments decided (torch's rules applied by
    :func:`fastckpt.load`): torch's legacy format goes to torch.load; a zip
    archive is read through the engine (onto a device through the staging
    pool, or on a background thread while torch's weights-only unpickler runs),
    its CRC-32s checked, and unpickled by torch's own loader."""
    with _paths.open_for_reading(path) as fh:  # FileNotFoundError etc. with the usual errno and path
        head = fh.read(32)
        if is_legacy(head):  # torch's pre-1.6 format: torch.load knows it
            log.debug("fastckpt.load: %s is in torch's legacy format; using torch.load", path)
            fh.seek(0)
            return torch.load(fh, map_location=map_location, weights_only=weights_only,
                              **({} if weights_only else {"pickle_module": pickle_module}), **pickle_load_args)
        if pickle_load_args and weights_only:
            warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=3)
        pickle_load_args.setdefault("encoding", "utf-8")  # torch.load's default
        opened = open_for_device(path, fh, verify, map_location) if moves_off_cpu(map_location, fh.fileno()) \
            else None
        if opened is not None:  # storages go to a device through the staging pool
            (archive, small, storages), bad = opened, []
        else:
            # Torch's weights-only unpickler on a plain state dict reads no
            # storage bytes: it runs while the storages are read.
            behind = unpickling_reads_no_data if weights_only and is_plain_cpu(map_location) else None
            archive, small, storages = read_archive(path, fh, verify, behind)
            bad = [] if storages.pending else check_storages(path, archive, storages, verify)
    if isinstance(storages, Records) and storages.pending:
        try:
            result = load_weights_only(path, small, archive, storages, map_location, pickle_load_args)
        except BaseException:
            storages.wait(quiet=True)
            raise
        storages.wait()
        bad = check_storages(path, archive, storages, verify)
        if bad:
            names = tensor_names(Reader(archive, small, storages), bad, ts._weights_only_unpickler, pickle_load_args)
            raise FormatError(f"{path}: checksum mismatch (corrupt data) in {', '.join(names)}")
        return result
    return unpickle_records(path, small, archive, storages, bad, map_location, weights_only, pickle_module,
                            verify, pickle_load_args)
