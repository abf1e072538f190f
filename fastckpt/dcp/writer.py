"""FastWriter: a torch.distributed.checkpoint StorageWriter that writes through fastckpt's engine.

The checkpoint it produces is a stock DCP directory (``.metadata`` plus
``__<rank>_<n>.distcp`` files, every tensor a torch.save archive at the
offset/length recorded in ``.metadata``): the stock ``FileSystemReader`` loads
it. What differs is how it gets there (docs/FORMAT.md, section 2):

* every data file is written by one engine ``Writer``: O_DIRECT (io_uring or a
  pwrite pool) out of reused staging buffers, CRC-32 of each tensor computed
  while it is copied, under a temporary name, then ``fdatasync``, ``rename``,
  directory ``fsync``;
* tensor bytes start on 4 KiB boundaries of the file (tensors >= 64 KiB), so
  that a reader can fetch them with O_DIRECT straight into place;
* the commit is atomic: ``.metadata`` is written last, after every rank's
  data is durable, through the same temporary-name/fdatasync/rename/fsync
  path. Over an existing checkpoint the save is written into a temporary
  sibling directory that the coordinator makes (its name reaches every rank
  with its plan), and the coordinator's ``finish`` writes ``.metadata`` there
  and puts it in place with the one directory commit (fastckpt/_core/dircommit.py:
  ``renameat2(RENAME_EXCHANGE)``): at every moment, and after a crash at any
  moment, the directory holds the old checkpoint or the complete new one.
  Its files that are not the checkpoint's (neither ``.metadata``,
  ``__<rank>.metadata`` nor ``*.distcp``) are carried over (hard links).

Stream transforms (``_extensions``, e.g. torch's ``ZStandard``) are applied as
the stock writer applies them: each record (a tensor's torch.save archive or a
BYTE_IO item) is written through the extensions' ``transform_to`` streams, its
``.metadata`` entry carries the descriptors torch records
(``_StorageInfo.transform_descriptors``), and the transformed bytes go through
the same engine Writer (temporary name, fdatasync, rename). Such records hold
no raw tensor bytes, so they are neither 4 KiB-aligned nor read in place.

One FastWriter may serve overlapping saves (two ``dcp.async_save`` calls, or a
``dcp.save`` while an async save runs): the state of a save (its directory,
save id, rank, coordinator role) is kept per save, i.e. per thread that runs
it, since DCP calls every StorageWriter method of one save from one thread.
"""

import dataclasses
import errno
import logging
import os
import pickle
import re
import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.futures import Future

from .._core import dircommit as _dircommit
from .._core import engine as _engine
from .._core.atomic import AtomicFile, write_file
from .._core import dist_exit as _dist_exit
from ..staging import device as _staging
from .._core.owner import check_directory_owner
from .._core.paths import check_dcp_target, raise_named_after_target
from ..formats.torch_rules import itemsize
from .._core.engine import fsync_dir, get_engine
from ..formats import dcp as _blob
from ..staging.statedict import Stager
from ..staging.tohost import ToHost

try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # torch < 2.6
    CURRENT_DCP_VERSION = None

__all__ = ["FastWriter"]

log = logging.getLogger("fastckpt")

METADATA = ".metadata"
SUFFIX = ".distcp"


def _item_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * itemsize(td.properties.dtype)


def _split(bins: int, items: List[WriteItem]) -> List[List[WriteItem]]:
    """Items into `bins` files of about equal size (largest first, each to the
    lightest file); byte items round-robin. Same idea as the stock writer."""
    if bins <= 1:
        return [list(items)]
    out: List[List[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True)
    for k, it in enumerate(byte_items):
        out[k % bins].append(it)
    for it in tensors:
        b = min(range(bins), key=sizes.__getitem__)
        out[b].append(it)
        sizes[b] += _item_nbytes(it)
    return out


@dataclasses.dataclass
class _Target(_StoragePrefix):
    """A rank's plan's storage data: its file-name prefix and the directory its
    files go into (a temporary sibling of the checkpoint directory when the save
    replaces a checkpoint; None: the checkpoint directory itself)."""
    directory: Optional[str] = None


def _checkpoint_file(name: str) -> bool:
    """A file of a DCP checkpoint (FastWriter's or the stock writer's)."""
    return name == METADATA or name.endswith(SUFFIX) or re.fullmatch(r"__\d+\.metadata", name) is not None


@dataclasses.dataclass
class _Entry:
    item: WriteItem
    offset: int
    length: int
    payload: Optional[bytes] = None           # BYTE_IO
    blob: Optional[_blob.TensorBlob] = None   # tensors


class _Cancelled(Exception):
    pass


@dataclasses.dataclass
class _Save:
    """The state of one save. DCP calls every StorageWriter method of a save from
    the thread that runs it (the caller's for ``dcp.save``, a worker's for
    ``dcp.async_save``), so a FastWriter keeps one of these per thread: saves
    that overlap never see each other's directory."""
    path: Path
    save_id: str
    is_coordinator: bool = True
    rank: Optional[int] = None
    use_collectives: bool = True
    set_up: bool = False      # set_up_storage_writer ran (a later reset() starts another save)
    staging: Optional[str] = None  # coordinator: the temporary sibling directory of a replacing save

    def metadata_name(self) -> str:
        if not self.use_collectives and self.rank is not None:
            return f"__{self.rank}{METADATA}"
        return METADATA


TRANSFORM_CHUNK = 4 << 20  # tensor bytes are fed to the stream transforms in pieces this big


def _feed_tensor(out, pieces) -> int:
    """Write the host uint8 views `pieces` (a tensor's bytes, from
    :func:`_host_tensors`) to `out`; returns their CRC-32."""
    crc = 0
    for flat in pieces:
        for i in range(0, flat.numel(), TRANSFORM_CHUNK):
            piece = flat[i:i + TRANSFORM_CHUNK]
            crc = _engine.crc32(piece, crc)
            out.write(memoryview(piece.numpy()))
    return crc


def _writer_transforms(extensions: Optional[Sequence[Any]]):
    """torch's own transform stack for `extensions` (None when there are none)."""
    if not extensions:
        return None
    try:
        from torch.distributed.checkpoint._extension import StreamTransformExtension
        from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
    except ImportError:  # pragma: no cover (torch < 2.7)
        raise NotImplementedError("fastckpt.dcp.FastWriter: this torch has no DCP stream transforms "
                                  "(_extensions)") from None
    for ex in extensions:
        if not isinstance(ex, StreamTransformExtension):
            raise NotImplementedError(f"fastckpt.dcp.FastWriter applies stream transforms "
                                      f"(torch.distributed.checkpoint._extension.StreamTransformExtension) "
                                      f"only; got {type(ex).__name__}")
    return _StorageWriterTransforms(list(extensions))


def _host_tensor(t: torch.Tensor) -> torch.Tensor:
    """The bytes to write: a contiguous CPU tensor (copies only when needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def _host_tensors(entries: List[_Entry], planner: SavePlanner, on_resolve=None):
    """(entry, tensor or None, host pieces or None) in order, through the one
    staging pipeline (:class:`fastckpt.staging.tohost.ToHost`): a device tensor's
    bytes are copied into the bounded staging pool ahead of the writes, on a
    copy stream of *its own device*, and each piece is handed out only after
    the event recorded on that stream fired. `on_resolve` sees every tensor
    the planner resolved, before any copy."""
    def tensor_of(e: _Entry):
        if e.payload is not None:
            return None
        t = planner.resolve_data(e.item).detach()
        if on_resolve is not None:
            on_resolve(t)
        return t if _staging.copier_for(t) is not None else _host_tensor(t)

    pipe = ToHost(entries, tensor_of)
    try:
        yield from pipe
    finally:
        pipe.close()


class FastWriter(StorageWriter, AsyncStager):
    """Write DCP checkpoints through fastckpt's engine (drop-in for ``FileSystemWriter``).

    Args:
        path: the checkpoint directory (created if missing). ``dcp.save(...,
            checkpoint_id=...)`` replaces it.
        single_file_per_rank: one data file per rank (per ``thread_count``
            bucket) rather than one per item, as the stock writer.
        sync_files: accepted for compatibility; FastWriter always makes its
            files durable (fdatasync + rename + directory fsync).
        thread_count: data files each rank writes concurrently (items are
            split between them by size), each through its own engine Writer.
        per_thread_copy_ahead, cache_staged_state_dict: accepted for
            compatibility (device-to-host copies always run one tensor ahead of
            the writes; stage() always reuses its buffers).
        overwrite: allow replacing an existing checkpoint in ``path``: the
            new one is written into a temporary sibling directory and
            exchanged with ``path`` atomically once complete (an interrupted
            overwrite leaves the old checkpoint, loadable). False raises if
            ``path`` holds a checkpoint. (With ``use_collectives=False``, where
            every rank is its own coordinator, the ranks' ``__<rank>.metadata``
            are replaced in place: each is removed before that rank writes.)
        _extensions: stream transforms applied to every record, as the
            stock writer applies them (e.g. ``[ZStandard()]`` from
            ``torch.distributed.checkpoint._extension``; user-defined
            ``StreamTransformExtension`` subclasses too). Both ``FastReader``
            and the stock ``FileSystemReader`` read the result (give them an
            ``_extension_registry`` that knows user-defined extensions).
            Transformed records are not 4 KiB-aligned and are read whole.
        serialization_format: torch.save records only (the default); others
            raise NotImplementedError.

    As an ``AsyncStager`` (``dcp.async_save(sd, storage_writer=FastWriter(p))``),
    :meth:`stage` copies the state dict into host buffers that are kept and
    reused by the next ``stage()``; buffers that a save still uses are never
    reused. One FastWriter may serve overlapping saves (each keeps its own
    directory and save id); each save writes exactly the state dict it was
    given.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> from fastckpt.dcp import FastWriter, FastReader
        >>> dcp.save(state_dict, storage_writer=FastWriter("/ckpt/step_100"))
        >>> dcp.load(state_dict, storage_reader=FastReader("/ckpt/step_100"))
    """

    _synchronize_after_execute: bool = False  # stage() is synchronous

    def __init__(self, path: Union[str, os.PathLike], single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = True,
                 overwrite: bool = True, _extensions: Optional[Sequence[Any]] = None,
                 serialization_format: Any = None):
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1 (got {thread_count})")
        if not sync_files:
            log.warning("fastckpt.dcp.FastWriter: sync_files=False is ignored; files are always fdatasync'd")
        self._transforms = _writer_transforms(_extensions)
        if serialization_format is not None and getattr(serialization_format, "value", "torch_save") != "torch_save":
            raise NotImplementedError(f"fastckpt.dcp.FastWriter writes torch.save records only, not "
                                      f"{serialization_format}")
        # per_thread_copy_ahead: device-to-host copies run one tensor ahead of the writes;
        # cache_staged_state_dict: stage() always reuses its buffers. Both accepted for compatibility.
        self.path = Path(check_dcp_target(path))  # URL, file, unwritable: refused before any data
        self.single_file_per_rank = single_file_per_rank
        self.thread_count = thread_count
        self.overwrite = overwrite
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = True
        self.rank: Optional[int] = None
        self.use_collectives = True
        self.last_write_stats: List[Dict[str, Any]] = []  # engine statistics of this rank's last write_data
        self._stager = Stager()
        self._local = threading.local()  # .save: the _Save of the save this thread runs

    # ---------------------------------------------------------------- per-save state

    def _save(self) -> _Save:
        """The state of the save that the calling thread runs; outside a save, the
        writer's own attributes (the last values any save set)."""
        s = getattr(self._local, "save", None)
        if s is not None:
            return s
        return _Save(self.path, self.save_id, self.is_coordinator, self.rank, self.use_collectives)

    def _end_save(self) -> None:
        self._local.save = None

    # ---------------------------------------------------------------- StorageWriter

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        # DCP calls this first (when given a checkpoint_id): it starts a save in this thread.
        if checkpoint_id:
            self.path = Path(check_dcp_target(checkpoint_id))
        self.save_id = str(uuid.uuid4())
        self._local.save = _Save(Path(checkpoint_id) if checkpoint_id else self.path, self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        s = getattr(self._local, "save", None)
        if s is None or s.set_up:  # no reset() for this save: it writes to the writer's path
            s = _Save(self.path, self.save_id)
        s.set_up = True
        s.is_coordinator = is_coordinator
        s.rank = kwargs.get("rank")
        s.use_collectives = kwargs.get("use_collectives", True)
        self._local.save = s
        self.is_coordinator, self.rank, self.use_collectives = s.is_coordinator, s.rank, s.use_collectives
        _dist_exit.register()  # a destroyed group torch still references must not live into finalization

    @staticmethod
    def _invalidate(path: Path, names: Sequence[str]) -> None:
        """Remove the metadata files of an earlier checkpoint in `path`, durably."""
        removed = False
        for n in names:
            try:
                os.unlink(os.path.join(path, n))
                removed = True
            except FileNotFoundError:
                pass
        if removed:
            log.warning("fastckpt.dcp: replacing the checkpoint in %s", path)
            fsync_dir(os.fspath(path))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        s = self._save()
        try:
            check_directory_owner(s.path, "DCP checkpoint directory")
            os.makedirs(s.path, exist_ok=True)
            if not self.overwrite:
                existing = METADATA if s.use_collectives else "__0" + METADATA
                if os.path.exists(os.path.join(s.path, existing)):
                    raise RuntimeError(f"{s.path} already holds a checkpoint and overwrite=False")
            if s.rank is not None and not s.use_collectives:
                # Without collectives every rank is its own coordinator.
                self._invalidate(s.path, [METADATA, s.metadata_name()])
                plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{s.rank}_"))
        except BaseException:
            self._end_save()
            raise
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        # Runs on the coordinator after every rank planned and before any rank
        # writes: an old checkpoint here stops being one before its files change.
        s = self._save()
        if not s.use_collectives:
            return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) if p.storage_data is None else p
                    for i, p in enumerate(plans)]
        # Replacing a checkpoint (its .metadata, or the rank-local metadata of a use_collectives=False
        # save, which dcp.load falls back to): every rank writes into a temporary sibling directory,
        # which finish() exchanges with the checkpoint directory. A directory holding no checkpoint has
        # nothing to lose: the files go straight in, .metadata last.
        s.staging = None
        if any(_checkpoint_file(n) and n.endswith(METADATA) for n in os.listdir(s.path)):
            s.staging = _dircommit.new_directory(s.path)
            log.debug("fastckpt.dcp: replacing the checkpoint in %s (written into %s first)", s.path, s.staging)
        return [dataclasses.replace(p, storage_data=_Target(f"__{i}_", s.staging)) if p.storage_data is None else p
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        s = self._save()
        claims: set = set()  # the staged generations whose buffers this save writes

        def on_resolve(t: torch.Tensor) -> None:
            c = self._stager.owner_of(t)
            if c is not None:
                claims.add(c)

        ok = False
        try:
            results = self._write_files(s, plan, planner, on_resolve)
            ok = True
        finally:
            for c in claims:  # their buffers may be reused from here on (by a newer stage())
                self._stager.release(c)
            if not ok and s.staging is not None:  # the coordinator's own files failed: finish never runs
                shutil.rmtree(s.staging, ignore_errors=True)
            if not ok or (s.use_collectives and not s.is_coordinator):
                self._end_save()  # nothing else of this save runs here (finish: coordinator only)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        s = self._save()
        try:
            self._finish(s, metadata, results)
        finally:
            self._end_save()

    def _finish(self, s: _Save, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        try:
            self._finish_in(s, metadata, results)
        except BaseException:
            if s.staging is not None:
                shutil.rmtree(s.staging, ignore_errors=True)  # the checkpoint directory is as it was
            raise

    def _finish_in(self, s: _Save, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        if CURRENT_DCP_VERSION is not None:
            metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = StorageMeta(checkpoint_id=s.path, save_id=s.save_id)
        data = pickle.dumps(metadata)
        if s.staging is not None:  # every rank's files are durable in it: .metadata, then the exchange
            write_file(os.path.join(s.staging, s.metadata_name()), data, os.path.join(s.path, s.metadata_name()))
            _dircommit.commit_directory(s.staging, s.path, keep=lambda n: not _checkpoint_file(n))
            return
        write_file(os.path.join(s.path, s.metadata_name()), data)  # temporary name, fdatasync, rename, dir fsync
        parent = os.path.dirname(os.path.abspath(s.path))
        fsync_dir(parent)  # the checkpoint directory's own entry, if it was created by this save

    def storage_meta(self) -> Optional[StorageMeta]:
        s = self._save()
        return StorageMeta(checkpoint_id=s.path, save_id=s.save_id)

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike]:
        return self._save().path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        if isinstance(checkpoint_id, Path):
            return True
        if "://" in str(checkpoint_id):
            return False
        for p in Path(checkpoint_id).parents:
            if p.exists() and os.access(str(p), os.W_OK):
                return True
        return False

    # ---------------------------------------------------------------- AsyncStager

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """A copy of `state_dict` in host buffers reused from the previous stage()."""
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        """No-op: stage() returns once the copy is complete."""

    def close(self) -> None:
        """Free the staging buffers that no save is using."""
        self._stager.close()

    @property
    def staging_allocations(self) -> int:
        """How many staging buffers were allocated so far (constant across repeated saves)."""
        return self._stager.allocations

    # ---------------------------------------------------------------- writing

    def _layout(self, items: List[WriteItem], planner: SavePlanner) -> Tuple[List[_Entry], int]:
        entries: List[_Entry] = []
        pos = 0
        # bytes first (small), then tensors in plan order; every record 64-byte aligned
        for it in items:
            if it.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(it)
                payload = bytes(data.getbuffer()) if hasattr(data, "getbuffer") else bytes(data)
                pos += (-pos) % _blob.RECORD_ALIGN
                entries.append(_Entry(it, pos, len(payload), payload=payload))
                pos += len(payload)
        for it in items:
            if it.type == WriteItemType.BYTE_IO:
                continue
            pos += (-pos) % _blob.RECORD_ALIGN
            td = it.tensor_data
            blob = _blob.plan_tensor_blob(td.properties.dtype, tuple(td.chunk.sizes), pos)
            entries.append(_Entry(it, pos, blob.length, blob=blob))
            pos += blob.length
        return entries, pos

    def _write_file(self, directory: Path, name: str, items: List[WriteItem], planner: SavePlanner,
                    stop: threading.Event, on_resolve=None) -> Tuple[List[WriteResult], Dict[str, Any]]:
        if self._transforms is not None:
            return self._write_transformed(directory, name, items, planner, stop, on_resolve)
        entries, total = self._layout(items, planner)
        w = AtomicFile(os.path.join(directory, name), total)
        try:
            for e, t, pieces in _host_tensors(entries, planner, on_resolve):
                if stop.is_set():
                    raise _Cancelled()
                if w.position < e.offset:
                    w.write_zeros(e.offset - w.position)
                if e.payload is not None:
                    w.write(e.payload)
                    continue
                td = e.item.tensor_data
                if t.dtype != td.properties.dtype or tuple(t.shape) != tuple(td.chunk.sizes):
                    raise ValueError(f"fastckpt.dcp: {e.item.index.fqn}: the planner resolved a {t.dtype} tensor "
                                     f"of shape {tuple(t.shape)}, the plan says {td.properties.dtype} "
                                     f"{tuple(td.chunk.sizes)}")
                w.write(e.blob.head)
                crc = 0
                # A tensor of stage()'s copy, whose buffers this save claims until it returns: the
                # engine writes it straight from them (its page-aligned body; no copy), with the
                # CRC-32 taken when it was copied (the writer reads none of its bytes).
                claim = self._stager.owner_of(t) if t.device.type == "cpu" else None
                lend = claim is not None
                known = claim.crc_of(t) if claim is not None and e.blob.nbytes else None
                for piece in pieces if e.blob.nbytes else ():
                    if known is None:
                        crc = w.write_crc(piece, crc, lend)
                    else:
                        w.write(piece, lend)
                w.write(e.blob.tail(crc if known is None else known))
            if w.position != total:
                raise RuntimeError(f"fastckpt.dcp: {name}: wrote {w.position} bytes, planned {total}")
            stats = w.commit()
        except BaseException:
            w.abort()
            raise
        stats["file"] = name
        results = [WriteResult(index=e.item.index, size_in_bytes=e.length,
                               storage_data=_StorageInfo(relative_path=name, offset=e.offset, length=e.length))
                   for e in entries]
        return results, stats

    def _write_transformed(self, directory: Path, name: str, items: List[WriteItem], planner: SavePlanner,
                           stop: threading.Event, on_resolve=None) -> Tuple[List[WriteResult], Dict[str, Any]]:
        """One data file whose records go through the stream transforms, one after
        the other (their transformed lengths are known only once written)."""
        entries: List[_Entry] = []
        for it in items:  # bytes first, then tensors in plan order (as _layout)
            if it.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(it)
                payload = bytes(data.getbuffer()) if hasattr(data, "getbuffer") else bytes(data)
                entries.append(_Entry(it, 0, 0, payload=payload))
        entries += [_Entry(it, 0, 0) for it in items if it.type != WriteItemType.BYTE_IO]
        w = AtomicFile(os.path.join(directory, name))
        sink = w.raw()
        results: List[WriteResult] = []
        try:
            for e, t, pieces in _host_tensors(entries, planner, on_resolve):
                if stop.is_set():
                    raise _Cancelled()
                offset = w.position
                out, descriptors = self._transforms.transform_save_stream(e.item, sink)
                if e.payload is not None:
                    out.write(e.payload)
                else:
                    td = e.item.tensor_data
                    if t.dtype != td.properties.dtype or tuple(t.shape) != tuple(td.chunk.sizes):
                        raise ValueError(f"fastckpt.dcp: {e.item.index.fqn}: the planner resolved a {t.dtype} "
                                         f"tensor of shape {tuple(t.shape)}, the plan says {td.properties.dtype} "
                                         f"{tuple(td.chunk.sizes)}")
                    # the same torch.save archive as an untransformed record (record-relative layout)
                    blob = _blob.plan_tensor_blob(td.properties.dtype, tuple(td.chunk.sizes), 0)
                    out.write(blob.head)
                    crc = _feed_tensor(out, pieces) if blob.nbytes else 0
                    out.write(blob.tail(crc))
                out.close()  # ends the transformed stream (e.g. the zstd frame); the file stays open
                length = w.position - offset
                # as torch records it: no descriptors field when no transform applied
                info = _StorageInfo(relative_path=name, offset=offset, length=length,
                                    transform_descriptors=descriptors if descriptors else None)
                results.append(WriteResult(index=e.item.index, size_in_bytes=length, storage_data=info))
            stats = w.commit()
        except BaseException:
            w.abort()
            raise
        stats["file"] = name
        return results, stats

    def _write_files(self, s: _Save, plan: SavePlan, planner: SavePlanner, on_resolve=None) -> List[WriteResult]:
        prefix = plan.storage_data.prefix if plan.storage_data is not None else f"__{s.rank or 0}_"
        where = Path(getattr(plan.storage_data, "directory", None) or s.path)
        if where != s.path and not where.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"cannot save DCP checkpoint {str(s.path)!r}: rank {s.rank} does "
                                    f"not see the coordinator's temporary directory {str(where)!r} beside it (every "
                                    "rank must see the same filesystem there)", str(s.path))
        if self.single_file_per_rank:
            buckets = [b for b in _split(self.thread_count, plan.items) if b]
        else:
            buckets = [[it] for it in plan.items]
        files = [(f"{prefix}{i}{SUFFIX}", b) for i, b in enumerate(buckets)]
        try:
            return self._write_files_in(s, where, files, planner, on_resolve)
        except OSError as e:  # an engine error names the temporary sibling: name the user's directory
            if where != s.path and e.filename and os.fspath(where) in os.fsdecode(e.filename):
                rel = os.path.relpath(os.fsdecode(e.filename), where).split(os.sep)[0]
                rel = rel if rel.endswith(SUFFIX) and not rel.startswith(".") else files[0][0]
                raise_named_after_target(e, os.path.join(s.path, rel))
            raise

    def _write_files_in(self, s: _Save, where: Path, files, planner: SavePlanner,
                        on_resolve=None) -> List[WriteResult]:
        stats: List[Dict[str, Any]] = []
        stop = threading.Event()
        results: List[WriteResult] = []
        if self.thread_count == 1 or len(files) <= 1:
            for name, b in files:
                r, st = self._write_file(where, name, b, planner, stop, on_resolve)
                results += r
                stats.append(st)
            self.last_write_stats = stats
            return results
        # Every concurrent Writer needs a staging buffer of its own to progress.
        workers = min(self.thread_count, len(files), get_engine().config.buffer_count)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fastckpt-dcp") as ex:
            futs = [ex.submit(self._write_file, where, name, b, planner, stop, on_resolve) for name, b in files]
            for f in futs:  # the first failure stops the others at their next item
                f.add_done_callback(lambda f: stop.set() if f.exception() is not None else None)
            first_error: Optional[BaseException] = None
            for f in futs:
                try:
                    r, st = f.result()
                    results += r
                    stats.append(st)
                except _Cancelled:
                    pass
                except BaseException as e:  # the others discard their files
                    if first_error is None:
                        first_error = e
        if first_error is not None:
            raise first_error
        self.last_write_stats = stats
        return results
