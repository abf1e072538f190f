"""fastckpt.save / fastckpt.load: torch.save and torch.load at disk speed;
fastckpt.load_into: a checkpoint read into the tensors of a state that exists.

The file is a standard torch.save zip archive (stock ``torch.load`` reads it,
with ``mmap=True`` too) whose storage records of 64 KiB or more start on 4 KiB
boundaries and whose other records are packed as torch.save packs them; see
docs/FORMAT.md 1.3. Saving to a path streams every storage through the C++
engine (O_DIRECT, io_uring, staging buffers reused across saves) into a
temporary file that is made durable and renamed over the target: a crash
leaves the previous file or the complete new one. Loading from a path reads
all storages in parallel through the engine, then unpickles with PyTorch's
own loader (and its ``weights_only`` unpickler).

This module holds the public functions and torch's argument rules; the
archive's writer and reader are :mod:`fastckpt.torchsave`, collective saves and
loads :mod:`fastckpt.collective`, URLs :mod:`fastckpt.remote`, the reads of
:func:`load_into` :mod:`fastckpt.sources.into`.
"""

import io
import os
import pickle
import warnings
from typing import Any, Dict, Optional, Union

import torch
import torch.serialization as ts

from ._core import paths as _paths
from .formats import torch_rules as _torch_rules
from .formats.pickler import DEFAULT_PROTOCOL, pickle_with_storages
from .formats.torch_rules import FileLike, MapLocation
from .torchsave import load as _load
from .torchsave.reader import check_layout
from .torchsave.writer import save_legacy, write_archive

__all__ = ["save", "load", "load_into"]


def save(obj: Any, f: FileLike, pickle_module: Any = pickle, pickle_protocol: int = DEFAULT_PROTOCOL,
         _use_new_zipfile_serialization: bool = True, _disable_byteorder_record: bool = False, *,
         group: Any = None, placement: str = "shared", storage_options: Optional[Dict[str, Any]] = None) -> None:
    """Save an object like :func:`torch.save`, durably and atomically.

    Args:
        obj: what torch.save accepts: (nested) containers of tensors and plain
            Python values, state dicts of models, optimizers, schedulers, scalers.
        f: a path (written through the engine: temporary file in the same
            directory, O_DIRECT writes, fdatasync, rename, directory fsync), a
            writable binary file object (written sequentially, not fsync'd), or
            an fsspec URL (``s3://bucket/dir/ckpt.pt``, ``gs://...``,
            ``file:///mnt/shared/ckpt.pt``): saved locally under ``TMPDIR``, then
            uploaded in parallel parts that become visible only when complete
            (:mod:`fastckpt.remote`; ``pip install 'fastckpt-io[s3]'``).
        pickle_module, pickle_protocol: as for torch.save.
        storage_options: with a URL ``f``: the fsspec filesystem's options
            (credentials, ``client_kwargs={"endpoint_url": ...}``), as DCP's
            fsspec writer takes them.
        _use_new_zipfile_serialization: as for torch.save. ``False`` writes
            torch's legacy (pre-1.6) format with torch's own writer, to a path
            still through the engine's temporary file, fdatasync and rename.
        _disable_byteorder_record: as for torch.save: no ``byteorder`` record.
        group: a ``torch.distributed`` process group whose every rank calls
            save with the same object and the same path on a filesystem they
            share (collective save, see :mod:`fastckpt.collective.save`): each rank
            writes a balanced share of the storages' bytes into one temporary
            file, rank 0 the rest and the commit; every rank returns after the
            commit or raises (ValueError when the ranks' objects differ,
            OSError naming ``f`` when any rank fails). The file is the one a
            single-process save writes. ``None``: this process writes alone.
        placement: with ``group``: ``"shared"`` (the default: one file on a
            filesystem every rank shares, as above) or ``"node"`` (node-local
            disks: every node writes one complete copy to its own ``f``, its
            ranks splitting that copy as "shared" splits the file; a rank's
            node is ``$FASTCKPT_NODE``, else its host name; the ranks of one
            node must pass the same ``f``). Every copy is the single-process
            save's file; a failure before the nodes rename leaves every node's
            previous file; a rename that fails on some node raises a "partial
            commit" OSError on every rank whose ``committed_nodes`` lists the
            nodes holding the new file (see :mod:`fastckpt.collective.save`).
            ``"node"`` without ``group`` is a ValueError.

    torch's settings are honoured as torch.save honours them:
    ``torch.serialization.skip_data()`` (storages' bytes are not written:
    their records are zero-filled or, in a seekable file object, left as holes,
    with CRC 0; ``materialize_fake_tensors`` lets fake tensors be saved), and
    ``torch.utils.serialization.config.save``: ``compute_crc32=False`` records
    CRC 0 (``fastckpt.load`` then loads the file unverified, with a warning;
    ``verify=True`` refuses it), ``storage_alignment`` aligns every record to
    it (storages of 64 KiB or more to a multiple of it and of 4096).
    ``use_pinned_memory_for_d2h`` does not change the file (fastckpt
    always copies CUDA storages through pinned buffers).

    Raises:
        FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
        OSError: the path cannot be written: checked before anything is written
            where it can be (missing or read-only parent directory, a target
            that is a directory); the message and ``filename`` name ``f``, even
            for errors of the engine's temporary file (ENOSPC, EIO), whose name
            is in ``filename2``. The previous file under that name is
            untouched and no temporary file is left.
        fastckpt.errors.MissingDependencyError: ``f`` is a URL whose scheme
            needs a package that is not installed (the message names the pip
            extra, ``fastckpt-io[s3]``). The store (bucket, credentials) is
            checked before anything is pickled: PermissionError,
            FileNotFoundError, OSError naming the URL.
        pickle.PicklingError, TypeError, RuntimeError: ``obj`` cannot be saved;
            raised before anything is written.

    Example:
        >>> fastckpt.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, "ckpt.pt")
    """
    ts._check_dill_version(pickle_module)
    if _paths.is_url(f) or storage_options is not None:
        if group is not None or not _paths.is_url(f):
            raise ValueError("fastckpt.save: storage_options= goes with a URL (s3://...), and a URL without group=")
        from .remote import urlio
        urlio.save(f, storage_options, lambda p: save(obj, p, pickle_module, pickle_protocol,
                                                      _use_new_zipfile_serialization, _disable_byteorder_record))
        return
    ts._check_save_filelike(f)
    if placement != "shared" and group is None:
        from .collective.save import PLACEMENTS
        raise ValueError(f"fastckpt.save: placement={placement!r} needs group= (a process group)" if placement in
                         PLACEMENTS else f"fastckpt.save: placement={placement!r} is not one of {PLACEMENTS}")
    if group is not None:
        if not _use_new_zipfile_serialization:
            raise ValueError("fastckpt.save: group= writes the zip format only (_use_new_zipfile_serialization=True)")
        from .collective import save as _collective
        _collective.save(obj, f, group, pickle_module, pickle_protocol, byteorder=not _disable_byteorder_record,
                         placement=placement)
        return
    if _paths.is_path(f):
        f = _paths.check_save_target(f)
    if not _use_new_zipfile_serialization:
        save_legacy(obj, f, pickle_module, pickle_protocol)
        return
    skip_data = bool(ts._serialization_tls.skip_data)
    data_pkl, storages = pickle_with_storages(obj, pickle_module, pickle_protocol, skip_data=skip_data)
    write_archive(f, data_pkl, storages, byteorder=not _disable_byteorder_record, skip_data=skip_data)


def _check_unpickler_args(weights_only: bool, pickle_module: Any, pickle_load_args: Dict[str, Any]) -> None:
    """The caller's extra arguments go to the unpickler, as torch.load's do: one it does not take is
    torch.load's TypeError, raised here before anything is read (later it would look like a damaged
    file)."""
    unpickler = ts._weights_only_unpickler.Unpickler if weights_only else pickle_module.Unpickler
    unpickler(io.BytesIO(b""), **pickle_load_args)


def load(f: FileLike, map_location: MapLocation = None, pickle_module: Any = None, *,
         weights_only: Optional[bool] = None, mmap: Optional[bool] = None, verify: Optional[bool] = None,
         group: Any = None, storage_options: Optional[Dict[str, Any]] = None, **pickle_load_args) -> Any:
    """Load an object saved by :func:`save` or by :func:`torch.save`.

    Args:
        f: a path (read through the engine: every storage in parallel with
            O_DIRECT), a readable binary file object (read by torch.load), or an
            fsspec URL (``s3://...``: read with parallel ranged reads into
            memory, then loaded with every check of a path; errors name the URL).
        storage_options: with a URL ``f``: the fsspec filesystem's options.
        map_location: as for torch.load: a device string, torch.device, dict
            of location tags, or callable. Storages bound for a device (by
            map_location, or by their saved location tag when it is None) are
            read in chunks into the staging pool and copied to the device
            while the next chunks are read: host memory is the pool, not the
            checkpoint. A callable is called once per storage, as by torch,
            with a storage of the right size and location whose bytes are
            filled after it returns (it must not read them).
        pickle_module: as for torch.load; only without weights-only.
        weights_only: as for torch.load (the same rules, on every path:
            files, file objects, mmap, legacy files): ``None`` (default) and
            True unpickle with torch's restricted unpickler, so no code from
            the file runs (classes allowed with
            ``torch.serialization.add_safe_globals`` load too); ``None`` with
            an explicit ``pickle_module`` means False.
            ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` forces weights-only even over
            ``weights_only=False``; ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``
            turns ``None`` into False (with torch's warning).
        mmap: map the storages from the file instead of reading them
            (delegated to torch.load's mmap mode). ``None``: torch's
            ``torch.utils.serialization.config.load.mmap`` (False by default).
            Loads that read no storage bytes in torch.load (``map_location="meta"``,
            under a FakeTensorMode or ``torch.serialization.skip_data()``)
            are delegated to it too.
        verify: check every storage read against the CRC-32 recorded in the
            file; the engine computes the CRC-32s while it reads, in parallel
            with the reads. ``None`` (default): verify what is read from a
            path (a damaged byte is a ``FormatError`` naming the tensor); a
            file that records no checksums (saved with torch's
            ``compute_crc32`` disabled) loads unverified, with a warning naming
            it; loads left to torch.load (file objects, ``mmap=True``, the
            no-data loads above, torch's legacy format) are not verified.
            ``True``: verify, and refuse what cannot be verified (a file
            without checksums: ``FormatError``; a file object or
            ``mmap=True``: ``ValueError``). ``False``: no check.

        group: a ``torch.distributed`` process group whose every rank calls
            load with the same ``path`` (a shared filesystem, or node-local
            copies written with ``save(..., placement="node")``): the file is
            read from disk once in total, each rank that has it reading about
            an equal share and the shares exchanged over the group (a backend
            that carries CPU tensors, gloo: host memory, onto a device through
            the staging pool; NCCL with a map_location onto CUDA devices:
            device to device; a backend that carries neither the result's
            device nor CPU tensors: ValueError before any storage is read), so
            every rank returns the whole object. A rank whose path does not
            exist gets every byte from its peers. Verified as a local load
            (each piece's CRC-32 computed where it is read, combined on every
            rank); any rank's failure raises on every rank. Needs a path and
            mmap=False.

    Returns:
        The saved object.

    Raises:
        FileNotFoundError, PermissionError, OSError: the file cannot be read.
        fastckpt.FormatError: the file is truncated, corrupt, not a checkpoint,
            or (with ``verify``) a storage does not match its checksum.
        pickle.UnpicklingError: ``weights_only`` refused something in the file;
            the message starts with "Weights only load failed", as torch's.
        RuntimeError: weights-only with an explicit ``pickle_module``, or
            both TORCH_FORCE_* variables set (as torch.load).

    Example:
        >>> sd = fastckpt.load("ckpt.pt", map_location=f"cuda:{local_rank}")
    """
    if _paths.is_url(f) or storage_options is not None:  # the same call on the bytes read into memory
        if group is not None or not _paths.is_url(f):
            raise ValueError("fastckpt.load: storage_options= goes with a URL (s3://...), and a URL without group=")
        from .remote import urlio
        return urlio.load(f, storage_options, lambda p: load(
            p, map_location, pickle_module, weights_only=weights_only, mmap=mmap, verify=verify, **pickle_load_args))
    weights_only, pickle_module = _torch_rules.weights_only_policy(weights_only, pickle_module)
    ts._check_dill_version(pickle_module)
    if mmap is None:  # torch.load's default
        mmap = _torch_rules.default_mmap()
    if pickle_load_args:
        _check_unpickler_args(weights_only, pickle_module, pickle_load_args)
    if group is not None:
        if not _paths.is_path(f) or mmap:
            raise ValueError("fastckpt.load(..., group=...) needs a path (the same on every rank) and mmap=False")
        if pickle_load_args and weights_only:
            warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=2)
        pickle_load_args.setdefault("encoding", "utf-8")  # torch.load's default
        from .collective import load as _collective_load
        return _collective_load.load(f, group, map_location, weights_only, pickle_module, verify, pickle_load_args)
    # torch.load receives the decided weights_only (an explicit value: it
    # decides the same again, without a second warning).
    # The default verify (None) leaves these loads to torch.load unverified;
    # an explicit verify=True insists on a path read through the engine.
    if not _paths.is_path(f) or mmap or (verify is not True and _torch_rules.reads_no_data(map_location)):
        if verify:
            raise ValueError("verify=True needs a path and mmap=False")
        check_layout(f, weights_only)
        return torch.load(f, map_location=map_location, weights_only=weights_only, mmap=mmap,
                          **({} if weights_only else {"pickle_module": pickle_module}), **pickle_load_args)
    return _load.load_path(os.fspath(f), map_location, weights_only, pickle_module, verify, pickle_load_args)


def load_into(state: Any, path: Union[str, os.PathLike], group: Any = None, strict: bool = True):
    """Fill the tensors of ``state`` in place from the checkpoint at ``path``.

    The keys of ``state`` and of the checkpoint are matched by path: the flat
    keys of ``model.state_dict()``, or the nested keys of an optimizer's state
    dict (``state.0.exp_avg``, ``param_groups.0.lr``). Every key, shape and
    dtype is checked before any byte is read. Then each tensor's bytes are
    read straight into its memory where it can be (a contiguous CPU tensor
    from a tensor stored contiguously: no second copy of the state and no new
    memory for it; O_DIRECT where memory, offset and length are aligned), the
    others through a bounded host buffer (a non-contiguous tensor, a strided
    view in the file, a tensor on a device). Non-tensor leaves held by dicts
    and lists of ``state`` (an optimizer's ``step`` values, its
    ``param_groups``) are set from the file after the tensors were read, so
    that ``optimizer.load_state_dict(state)`` then resumes it; leaves in
    tuples are left as they are.

    Args:
        state: a dict (nested containers allowed) of tensors and plain values,
            e.g. ``model.state_dict()`` or ``optimizer.state_dict()`` of an
            optimizer that holds its state already (after a step). Tensors may
            be ``torch.distributed.tensor.DTensor`` s: each rank then reads only
            the byte ranges of its own local shard from the full-size tensor of
            the file (``Shard`` and ``Replicate`` placements, any mesh, uneven
            shards; ``_StridedShard`` and ``Partial`` are refused).
        path: a torch.save or fastckpt file, a safetensors file, a sharded
            safetensors set (its directory, holding
            ``model.safetensors.index.json``, or that index file), or a DCP
            directory (loaded by ``torch.distributed.checkpoint.load`` with
            :class:`fastckpt.dcp.FastReader`, which reshards).
        group: a ``torch.distributed`` process group whose every rank calls
            load_into with the same path. For a DCP directory it is DCP's
            ``process_group``. For the other formats, with a gloo group of more
            than one rank: the replicated tensors (plain CPU tensors, and
            DTensors replicated on every mesh dimension) are read once, each by
            one rank (balanced by bytes), and broadcast over the group; every
            rank must then hold the same replicated keys, shapes and dtypes
            (else StateMismatchError on every rank), and a failure on any rank
            raises on every rank (its own error there,
            :class:`fastckpt.errors.RanksFailed` on the others). Sharded
            DTensors are read by each rank for itself either way. ``None``, or
            a group of another backend: every rank reads everything it holds.
        strict: keys of ``state`` missing from the file, or keys of the file
            that ``state`` lacks, raise :class:`fastckpt.errors.StateMismatchError`
            listing them; ``False``: they are returned, and the others loaded.

    Returns:
        A ``LoadIntoResult(missing_keys, unexpected_keys)`` NamedTuple, as
        ``nn.Module.load_state_dict`` returns.

    Verification: a torch.save record read whole in one piece is checked
    against its CRC-32 (a mismatch is raised after the bytes landed, so the
    tensor then holds the damaged values). A record read in part (a shard of a
    DTensor, a view of a larger storage) cannot be checked against the
    record's CRC-32; safetensors files record no checksums; DCP records are
    checked by FastReader.

    Raises:
        FileNotFoundError: ``path`` does not exist (named in the message).
        fastckpt.errors.StateMismatchError (a ValueError): missing or unexpected
            keys (with ``strict``), a shape, dtype or kind mismatch, a refused
            placement; raised before any byte of ``state`` changed.
        fastckpt.FormatError: a truncated, damaged or foreign file, a checksum
            mismatch (naming the path and the record). Nothing from the file
            is run: its pickle is read by a restricted unpickler.
        pickle.UnpicklingError: torch's weights-only unpickler refused
            ``data.pkl`` (as :func:`load` raises it; the message names the path).
        OSError: the file cannot be read.
        fastckpt.errors.RanksFailed: with ``group``, another rank failed.
        TypeError: ``state`` is not a dict, ``path`` not a path.

    Example:
        >>> fastckpt.save(model.state_dict(), "model.pt")
        >>> fastckpt.load_into(model.state_dict(), "model.pt")
        LoadIntoResult(missing_keys=[], unexpected_keys=[])
    """
    if not isinstance(state, dict):
        raise TypeError(f"fastckpt.load_into: state must be a dict (a state dict), not {type(state).__name__}")
    if not _paths.is_path(path) or _paths.is_url(path):
        raise TypeError(f"fastckpt.load_into: path must be a local path (str or os.PathLike), not {path!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"fastckpt.load_into: strict must be a bool, not {type(strict).__name__}")
    from .sources import into as _into
    return _into.load_into(state, os.fsdecode(os.fspath(path)), group, strict)
