"""FastReader: a torch.distributed.checkpoint StorageReader that reads through fastckpt's engine.

It loads any checkpoint in the stock filesystem layout (written by
``FileSystemWriter`` or :class:`~fastckpt.dcp.FastWriter`). For each data file
that the rank's load plan touches, it reads, with parallel ``read_ranges``
calls of the engine:

1. the first and the last 4 KiB of every tensor record (its ``data.pkl``,
   the local header of its storage record, its zip central directory), and
   the whole of a record of at most 72 KiB (a bias, a norm's weight, a step
   count; the engine reads through a gap of up to 64 KiB between a head
   and a tail anyway): its data comes from this read, copied with its CRC-32
   taken in the same pass;
2. what the first read did not hold (a ``data.pkl`` longer than its head, a
   central directory longer than its tail), which the usual archives never need;
3. only the bytes of the storage that the plan asks for (the byte span of
   the requested hyper-rectangle), straight into the destination tensor when
   it is a contiguous CPU tensor laid out like the stored one, else into a
   buffer that is then copied (and cast) into the destination.

The layout ``data.pkl`` describes is kept by its bytes (``parse_pickle``'s
results: a model's tensors repeat a few dtypes and shapes).

A record read whole is checked against the CRC-32 of its zip entry
(``verify=True``, the default): the engine computes the CRC-32 while it reads
the record, in parallel with the other reads, not in a pass after them.
Records this fast path does not recognise (another pickle,
big-endian data, stream transforms) are read whole and given to
``torch.load``, as the stock reader does. Every ``relative_path``, offset and
length from ``.metadata`` is checked against the checkpoint directory and the
file before anything is read: a bad one raises ``fastckpt.FormatError``.
"""

import errno
import io
import os
import stat
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._core import dist_exit as _dist_exit
from .._core.gcpause import gc_paused
from .._core.dircommit import resolve
from ..formats import unpickler as _unpickle
from .._core.owner import check_directory_owner
from ..errors import FormatError
from .records import FileJob, Req, check_value, item_name

__all__ = ["FastReader"]

METADATA = ".metadata"


class FastReader(StorageReader):
    """Read DCP checkpoints through fastckpt's engine (drop-in for ``FileSystemReader``).

    Args:
        path: the checkpoint directory. ``dcp.load(..., checkpoint_id=...)`` replaces it.
        verify: check every tensor record that is read whole against the
            CRC-32 of its zip entry (default True; a mismatch is a
            ``FormatError`` naming the file, offset and tensor). The engine
            computes the CRC-32s during the reads, in parallel with them.
            Records written with CRCs disabled (CRC 0) are not checked.
            Partial reads (resharding) cannot be checked. ``False`` opts out.
        thread_count: data files read concurrently.
        weights_only: load non-tensor values (DCP's BYTE_IO records, which
            ``DefaultLoadPlanner.load_bytes`` hands to ``torch.load`` with
            ``weights_only=False``) only when torch's weights-only unpickler
            accepts them, so that nothing from the checkpoint can run code
            (default). ``False`` keeps the stock behaviour, for checkpoints you
            trust; ``torch.serialization.add_safe_globals`` allows more classes.
            ``.metadata`` is always read by fastckpt's restricted unpickler
            (:mod:`fastckpt.formats.unpickler`), whatever this says.

    Raises (from ``dcp.load``, possibly wrapped by it):
        FileNotFoundError: no ``.metadata`` (not a checkpoint, or a save that
            did not finish), or a data file named in it is missing.
        pickle.UnpicklingError: ``.metadata`` names a class that DCP metadata
            does not use, or (``weights_only=True``) a value the weights-only
            unpickler refuses. Nothing from the checkpoint was run.
        fastckpt.FormatError: corrupt ``.metadata`` (or one that would take far
            more memory than its size: huge memo indices or counted sizes, deep
            nesting), a data file shorter than
            ``.metadata`` says, a ``relative_path`` outside the checkpoint
            directory, a corrupt record or a checksum mismatch.

    Example:
        >>> dcp.load(state_dict, storage_reader=fastckpt.dcp.FastReader("/ckpt/step_100"))
    """

    def __init__(self, path: Union[str, os.PathLike], verify: bool = True, thread_count: int = 2,
                 _extension_registry: Any = None, *, weights_only: bool = True):
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1 (got {thread_count})")
        self.path = Path(path)
        self.verify = verify
        self.weights_only = bool(weights_only)
        self.thread_count = thread_count
        self.storage_data: Dict[Any, Any] = {}
        self.load_id = str(uuid.uuid4())
        self.rank: Optional[int] = None
        self.use_collectives = True
        self._extension_registry = _extension_registry
        self.last_read_stats: Dict[str, Any] = {}

    # ---------------------------------------------------------------- StorageReader

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with gc_paused():  # thousands of metadata objects, all kept (fastckpt._core.gcpause)
            return self._read_metadata(*args, **kwargs)

    def _read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        root = resolve(self.path)  # or the complete copy an interrupted directory commit left aside
        p = os.path.join(root, name)
        check_directory_owner(root, "DCP checkpoint directory")
        md = load_metadata(p, self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise FormatError(f"{self.path}: checkpoint metadata has no storage table")
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        _dist_exit.register()  # a destroyed group torch still references must not live into finalization

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike]:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        if isinstance(checkpoint_id, Path):
            return True
        if "://" in str(checkpoint_id):
            return False
        return os.path.isdir(checkpoint_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        with gc_paused():  # a few objects per record, all kept until the load ends
            return self._read_data(plan, planner)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        t0 = time.perf_counter()
        per_file: Dict[str, List[Req]] = {}
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if info is None:
                raise FormatError(f"{self.path}: .metadata has no storage entry for {item_name(req.storage_index)}")
            rel = getattr(info, "relative_path", None)
            if not isinstance(rel, str):  # before it is used as a key: a damaged one may not be hashable
                raise FormatError(f"{self.path}: .metadata names an invalid data file {rel!r} for "
                                  f"{item_name(req.storage_index)}")
            per_file.setdefault(rel, []).append(Req(req, info))
        jobs = []
        for rel, reqs in per_file.items():
            full, size = self._resolve(rel)
            for r in reqs:
                off, ln = getattr(r.info, "offset", None), getattr(r.info, "length", None)
                if not (isinstance(off, int) and isinstance(ln, int) and off >= 0 and ln >= 0):
                    raise FormatError(f"{self.path}: .metadata gives {item_name(r.req.storage_index)} an invalid "
                                      f"range (offset {off!r}, length {ln!r})")
                if off + ln > size:
                    raise FormatError(f"{full}: {item_name(r.req.storage_index)} lies at bytes {off}..{off + ln} "
                                      f"according to .metadata, but the file has only {size} bytes "
                                      "(truncated data file)")
                if r.req.type != LoadItemType.BYTE_IO:
                    r.target = planner.resolve_tensor(r.req).detach()
            jobs.append(FileJob(self, full, rel, reqs))
        if self.thread_count == 1 or len(jobs) <= 1:
            for j in jobs:
                j.run()
        else:
            with ThreadPoolExecutor(max_workers=min(self.thread_count, len(jobs)),
                                    thread_name_prefix="fastckpt-dcp-read") as ex:
                for f in [ex.submit(j.run) for j in jobs]:
                    f.result()
        stats = {"files": len(jobs), "items": len(plan.items), "fast": 0, "slow": 0, "verified": 0,
                 "bytes_requested": 0, "bytes_read": 0}
        for j in jobs:
            for k in ("fast", "slow", "verified", "bytes_requested", "bytes_read"):
                stats[k] += j.stats[k]
            for r in j.reqs:
                if r.req.type == LoadItemType.BYTE_IO:
                    if self.weights_only:
                        check_value(r, j.path)
                    # The planner torch.loads the record: unchecked (verify=False), a damaged one
                    # raises whatever torch's zip reader or unpickler raises.
                    try:
                        planner.load_bytes(r.req, io.BytesIO(r.data))
                    except (FormatError, OSError):
                        raise
                    except Exception as e:
                        raise FormatError(f"{j.path} @{r.info.offset}+{r.info.length} "
                                          f"({item_name(r.req.storage_index)}): cannot load the record "
                                          f"({type(e).__name__}: {e})") from e
                else:
                    planner.commit_tensor(r.req, r.target)
        stats["seconds"] = time.perf_counter() - t0
        self.last_read_stats = stats
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # ---------------------------------------------------------------- helpers

    def _resolve(self, rel: Any) -> Tuple[str, int]:
        """The real path and size of a data file named in .metadata, which must be
        a regular file inside the checkpoint directory."""
        root = resolve(self.path)
        if not isinstance(rel, str) or not rel or "\0" in rel:
            raise FormatError(f"{root}: .metadata names an invalid data file {rel!r}")
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise FormatError(f"{root}: .metadata names data file {rel!r}, which is outside the checkpoint "
                              "directory (absolute paths and '..' are refused)")
        full = os.path.join(root, rel)
        real, root_real = os.path.realpath(full), os.path.realpath(root)
        if os.path.commonpath([real, root_real]) != root_real or real == root_real:
            raise FormatError(f"{root}: data file {rel!r} resolves to {real}, outside the checkpoint directory "
                              "(a symbolic link?)")
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{full}: data file named in .metadata is missing", full) from None
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{full}: data file named in .metadata is not a regular file")
        return real, st.st_size

    def _transforms(self):
        from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
        return _StorageReaderTransforms(self._extension_registry)


def load_metadata(p: str, directory: Union[str, os.PathLike]) -> Metadata:
    """The Metadata in file `p` of DCP checkpoint `directory`, unpickled by
    fastckpt's restricted unpickler (:mod:`fastckpt.formats.unpickler`): only DCP's
    metadata classes, nothing from the file run, nothing allocated that its
    size cannot account for. `p` must be a regular file.

    Raises FileNotFoundError, PermissionError (and other OSErrors, naming `p`),
    pickle.UnpicklingError (a refused class; nothing was run), FormatError."""
    try:
        with open(p, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{p}: not a regular file (DCP checkpoint metadata is one)")
            data = f.read(st.st_size)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{p} does not exist: {directory} is not a complete DCP "
                                "checkpoint (no save has finished there, or one was interrupted)", p) from None
    md = _unpickle.loads(data, p, _unpickle.dcp_metadata_class)
    if not isinstance(md, Metadata):
        raise FormatError(f"{p}: not DCP checkpoint metadata (it holds a {type(md).__name__})")
    if (not isinstance(getattr(md, "storage_data", None), dict)
            or not isinstance(getattr(md, "state_dict_metadata", None), dict)):
        raise FormatError(f"{p}: corrupt checkpoint metadata (no storage table)")
    return md
