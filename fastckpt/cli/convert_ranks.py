"""``fastckpt convert DCP_DIR FILE`` under torchrun: every rank converts a share.

The target file's layout depends only on the DCP metadata (names, global shapes,
dtypes) and, for a torch.save file, on the pickle of the object tree, so every
rank plans it alike: the safetensors header of :func:`fastckpt.cli.convert.plan_safetensors`,
or the archive of :func:`fastckpt.formats.archive.plan_archive` over the pickle of
:func:`fastckpt.cli.convert.pickle_tree` (rank 0's serialization id). The tensors
(storages) are assigned to the ranks balanced by bytes
(:func:`fastckpt.collective.full.balance`); each rank reads only its own from
the DCP directory, one at a time, and writes their bytes at their offsets into one
temporary file (:class:`fastckpt.collective.full.SharedFile`); rank 0 writes the
header or the zip records (:func:`fastckpt.collective.save.write_records`, each
record's CRC-32 combined from its pieces') and commits. Each step is an exchange of
:class:`fastckpt.collective.group.Group`: a failure on any rank raises on every rank,
and the target is left as it was. The file is byte-identical to the single-process
conversion's.

Memory per rank: one tensor of the checkpoint (plus the engine's buffers). The
non-tensor values of a DCP checkpoint (small) are read by every rank, since the
torch.save pickle holds them.
"""

import hashlib
import os
from typing import Any, Dict, Iterator, List, Optional

import torch

from .._core import paths as _paths
from ..collective import full as _full
from ..collective.group import Group
from ..collective.save import write_records
from ..formats import archive as _archive
from ..formats import torch_rules as _torch_rules
from ..sources.source import Source, Storage, storage_of
from . import convert as _convert

__all__ = ["under_torchrun", "convert_ranks"]


def under_torchrun(environ=os.environ) -> bool:
    """Whether this process is one rank of several (torchrun's WORLD_SIZE > 1)."""
    try:
        return int(environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _storage_bytes(source: Source, s: Storage) -> torch.Tensor:
    """The bytes of storage `s` of a DCP source (a tensor's, by its fqn) as a 1-D uint8 tensor."""
    if s.data is not None:  # a tensor inside a non-tensor value, already in memory
        return s.data
    t = source.load_tensor(s.key)
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _my_batches(source: Source, items: List[Any], owner: List[int], rank: int,
                stats: Dict[str, int]) -> Iterator[List[_full.Piece]]:
    """One batch per storage this rank owns: [(record key, 0, length, its bytes' storage, 0)], each
    read when asked for and dropped before the next is read."""
    for (key, s), w in zip(items, owner):
        if w != rank or not s.nbytes:
            continue
        data = _storage_bytes(source, s)
        if data.numel() != s.nbytes:
            raise RuntimeError(f"{source.path}: {s.key}: read {data.numel()} bytes, the metadata says {s.nbytes}")
        batch = [(key, 0, s.nbytes, data.untyped_storage(), data.storage_offset())]
        del data
        stats["tensors"] += 1
        stats["bytes"] += s.nbytes
        yield batch
        del batch


def convert_ranks(source: Source, dst: str, to: str, drop_non_tensors: bool = False,
                  group: Any = None) -> Dict[str, Any]:
    """Every rank of `group` (default: the default process group, initialised here over gloo from
    torchrun's environment if none is) writes its share of `source` (a DCP directory) to the file
    `dst` in format `to` ("safetensors", "torch" or "fastckpt"). Returns this rank's statistics:
    {"tensors", "bytes"} it converted, "total" tensor bytes of the file, "rank", "world"."""
    import torch.distributed as dist
    if source.kind != "dcp":
        raise _convert.ConvertError(f"{source.path}: converting with several ranks reads a DCP directory; "
                                    f"this is a {source.kind} checkpoint (convert it in one process)")
    if to not in ("safetensors", "torch", "fastckpt"):
        raise _convert.ConvertError(f"converting with several ranks writes one file (safetensors, torch or "
                                    f"fastckpt), not {to}")
    own = group is None and not dist.is_initialized()
    if own:
        dist.init_process_group("gloo")
    try:
        with _convert.engine_for_streaming():
            return _convert_in(source, dst, to, drop_non_tensors, Group(group, dst))
    finally:
        if own:
            dist.destroy_process_group()


def _convert_in(source: Source, dst: str, to: str, drop_non_tensors: bool, g: Group) -> Dict[str, Any]:
    stats = {"tensors": 0, "bytes": 0, "rank": g.rank, "world": g.world}
    out: Optional[_full.SharedFile] = None
    path = dst
    try:
        # 1. plan the file on every rank; agree on it (and on rank 0's serialization id).
        err: Optional[BaseException] = None
        mine: Any = None
        planned: Any = None
        try:
            path = _paths.check_save_target(dst)
            if to == "safetensors":
                head, entries, total, _dropped = _convert.plan_safetensors(source, drop_non_tensors)
                planned = (head, entries, total)
                digest = hashlib.sha256(head).digest()
                sid = None
            else:
                data_pkl, streamed = _convert.pickle_tree(source.tree(values=True), source)
                alignment, direct_min = _convert.archive_options(to == "torch")
                alignment = _torch_rules.storage_alignment() if alignment is None else alignment
                crc_on = bool(_torch_rules.compute_crc32())
                planned = (data_pkl, streamed, alignment, direct_min, crc_on)
                digest = hashlib.sha256(repr((alignment, direct_min, crc_on, [st.nbytes() for st in streamed]))
                                        .encode() + data_pkl).digest()
                sid = _archive.new_serialization_id() if g.rank == 0 else None
            mine = (digest, sid)
        except Exception as e:
            err = e
        agreed = g.exchange(mine, err, "to plan the file")
        for r in range(1, g.world):
            if agreed[r][0] != agreed[0][0]:
                raise ValueError(f"cannot convert to {path!r}: rank {r} planned another file than rank 0 "
                                 f"(do all ranks read the same {source.path!r} with the same settings?); "
                                 "nothing was written")

        # 2. the records (key, storage), their offsets; who writes which.
        if to == "safetensors":
            head, entries, total = planned
            items = [(name, storage_of(t)) for name, t in entries]
            offsets, sizes, at = _full.data_offsets(head, [(name, s.nbytes) for name, s in items])
            if at != total:
                raise RuntimeError(f"cannot convert to {path!r}: the header plans {total} bytes, the tensors "
                                   f"{at}")
            names = repr
        else:
            data_pkl, streamed, alignment, direct_min, crc_on = planned
            plan, zentries, cd_offset, total = _archive.plan_archive(data_pkl, streamed, alignment, True, direct_min,
                                                                     serialization_id=agreed[0][1])
            record = _full.storage_records(plan)
            items = [(record[k], st.storage) for k, st in enumerate(streamed)]
            offsets = {i: plan[i][2].data_offset for i, _s in items}
            sizes = {i: plan[i][2].size for i, _s in items}

            def names(i: int) -> str:
                return repr(plan[i][2].name)
        owner = _full.balance([s.nbytes for _k, s in items], g.world)
        stats["total"] = sum(s.nbytes for _k, s in items)

        # 3. every rank writes its storages' bytes, one storage at a time; 4. rank 0 the rest, commits.
        out = _full.SharedFile(g, path, total)
        out.open(None)
        layout = out.write_each(_my_batches(source, items, owner, g.rank, stats), offsets, sizes, names)
        if to == "safetensors":
            out.commit(lambda w: _full.write_safetensors_rest(w, head, offsets, layout))
        else:
            out.commit(lambda w: write_records(w, plan, zentries, cd_offset, _full.record_pieces(layout, crc_on),
                                               crc_on))
    except BaseException as e:
        _full.failed_write(e, out, path)
        raise
    return stats
