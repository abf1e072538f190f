"""Full-size files from sharded state: ``fastckpt.save(state, path, group=pg)``
where ``state`` holds DTensors (FSDP2, tensor parallelism, 2-D meshes).

The file holds full tensors: stock ``torch.load`` returns plain tensors equal to
``DTensor.full_tensor()``, and the file is byte-identical to what a
single-process ``fastckpt.save`` of the gathered state writes (with the same
serialization id). No rank gathers anything: the archive's layout depends only
on the tensors' global shapes and dtypes, which every rank knows, so each rank
writes the bytes of its own shards into one temporary file.

Who writes what.
* A DTensor becomes one storage record of its full size. A rank's local shard is
  one contiguous range of it when every placement is ``Shard(0)`` or
  ``Replicate`` (``Shard(0)`` along several mesh dimensions included); other
  placements (``Shard(d>0)``, ``Partial``) are first redistributed, one tensor
  at a time, to ``Shard(0)`` on those mesh dimensions (an all-to-all or
  reduce-scatter over the mesh: a TP shard of a weight is a run of short rows,
  which would otherwise be as many small writes). ``_StridedShard`` (FSDP2 over
  TP) is refused with the tensor's name. Of the ranks holding the same range
  (``Replicate`` mesh dimensions), one writes it, chosen in turn per tensor.
* Plain tensors (replicated state: buffers, an optimizer's step) are written
  whole, each by one rank, chosen to balance the bytes; like every non-tensor
  value they must be the same on every rank (checked as in the replicated
  collective save: the pickles' digest and sampled CRC-32s).
* A rank writes the 4 KiB blocks of the file that lie wholly inside its ranges
  (O_DIRECT from its memory, through the staging pool for device tensors); the
  bytes of blocks it shares with another rank's range or with the archive's
  headers go to rank 0, which writes them with the headers, the small records,
  the data descriptors and the central directory: no block is written by two
  processes. Each record's CRC-32 is combined from its pieces' (every rank
  reports those of its writes).

Flow, each step a collective over ``pg`` (fastckpt.collective.group: a failure
anywhere raises on every rank, and nothing is committed):
1. pickle (DTensors as full-size tensors), plan the layout, agree (digest,
   sampled CRC-32s of the plain storages, rank 0's serialization id and pickle);
2. redistribute what needs it; rank 0 creates the temporary file;
3. every rank writes its blocks and fdatasyncs; all_gather of the pieces'
   CRC-32s and the shared blocks' bytes; the pieces must cover every record
   exactly once (else ValueError: e.g. a mesh that does not span the group);
4. rank 0 writes the rest, fdatasyncs, renames, fsyncs the directory.
"""

import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.serialization as ts

from .._core import engine as _engine
from .._core import paths as _paths
from ..formats import archive, pickler
from ..formats import torch_rules as _torch_rules
from ..formats.torch_rules import contiguous_stride, itemsize, storage_ref
from . import stage as _collective_stage
from .group import Group
from .save import _digest, _write_records, _write_share

_BLOCK = 4096


class _Full:
    """The storage record of a DTensor's full tensor (its bytes come from the ranks' shards)."""

    def __init__(self, dt: Any, name: str):
        self.dt, self.name = dt, name
        self.n = dt.numel() * itemsize(dt.dtype)

    def nbytes(self) -> int:
        return self.n


def _is_dtensor(o: Any) -> bool:
    DTensor = _dtensor_class()
    return DTensor is not None and isinstance(o, DTensor)


def _dtensor_class():
    mod = sys.modules.get("torch.distributed.tensor")  # loaded by whoever made a DTensor
    return getattr(mod, "DTensor", None) if mod is not None else None


def dtensor_names(obj: Any, path: str = "", out: Optional[Dict[int, str]] = None, depth: int = 0) -> Dict[int, str]:
    """{id(DTensor): its key path ("model.layers.0.weight", "state.3.exp_avg")} for the DTensors in
    the dicts, lists and tuples of `obj`; empty when it holds none."""
    out = {} if out is None else out
    if depth > 64:
        return out
    if _is_dtensor(obj):
        out.setdefault(id(obj), path or "<root>")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            dtensor_names(v, f"{path}.{k}" if path else str(k), out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            dtensor_names(v, f"{path}.{i}" if path else str(i), out, depth + 1)
    return out


def _placement_error(name: str, dt: Any, path: str) -> Optional[str]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    strided = getattr(__import__("torch.distributed.tensor.placement_types", fromlist=["x"]), "_StridedShard", ())
    for p in dt.placements:
        if strided and isinstance(p, strided):
            return (f"cannot save {name!r} to {path!r} as a full-size tensor: its placement {p} "
                    f"(placements {tuple(dt.placements)}, FSDP2 over tensor parallelism) is not supported; "
                    "redistribute it (e.g. to Shard(0) on each mesh dimension) or save it sharded "
                    "(CheckpointManager(sharded=True), dcp.save with FastWriter); nothing was written")
        if not isinstance(p, (Shard, Replicate, Partial)):
            return f"cannot save {name!r} to {path!r}: unknown placement {p!r}; nothing was written"
    return None


def _pickle(obj: Any, names: Dict[int, str], pickle_module: Any, protocol: int, path: str):
    """(data.pkl with each DTensor as its full tensor, the storages in key order: live
    UntypedStorages of the plain tensors and :class:`_Full` records)."""
    def reduce(o):
        if not _is_dtensor(o):
            return NotImplemented
        name = names.get(id(o), "<a DTensor inside an object>")
        bad = _placement_error(name, o, path)
        if bad:
            raise ValueError(bad)
        local = o._local_tensor
        full = _Full(o, name)
        ref, untyped = storage_ref(o.dtype, full.n, ts.location_tag(local.untyped_storage()), payload=full)
        return pickler.tensor_reduce(ref, untyped, o.dtype, 0, tuple(o.shape), contiguous_stride(o.shape),
                                     o.requires_grad)
    return pickler.pickle_with_storages(obj, pickle_module, protocol, reducer_override=reduce)


def _contiguous_local(dt: Any) -> Tuple[Any, torch.Tensor, int]:
    """(the DTensor whose local shard is one row range of the full tensor, that shard contiguous,
    its first byte in the full tensor). Redistributes (a collective over the mesh) when needed."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if any(not isinstance(p, Replicate) and not (isinstance(p, Shard) and p.dim == 0) for p in dt.placements):
        if dt.dim() == 0:
            dt = dt.redistribute(dt.device_mesh, [Replicate()] * len(dt.placements))
        else:
            dt = dt.redistribute(dt.device_mesh, [p if isinstance(p, Replicate) else Shard(0) for p in dt.placements])
    local = dt._local_tensor
    if not local.is_contiguous():
        local = local.contiguous()
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"a local shard of shape {tuple(local.shape)} where the placements "
                           f"{tuple(dt.placements)} give {tuple(shape)}")
    row = itemsize(dt.dtype)
    for s in dt.shape[1:]:
        row *= s
    return dt, local, (offset[0] * row if dt.dim() else 0)


def _writes_replica(dt: Any, turn: int) -> bool:
    """Whether this rank writes its range of `dt` among the ranks holding the same one (those that
    differ only in their coordinates on Replicate mesh dimensions): the turn-th of them, in turn."""
    from torch.distributed.tensor import Replicate
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    j, count = 0, 1
    for d, p in enumerate(dt.placements):
        if isinstance(p, Replicate):
            j = j * mesh.size(d) + coord[d]
            count *= mesh.size(d)
    return j == turn % count


def _check_meshes(fulls: List[_Full], g: Group, path: str) -> None:
    import torch.distributed as dist
    ranks = sorted(dist.get_process_group_ranks(g.group)) if g.group is not None and \
        g.group is not dist.group.WORLD else list(range(dist.get_world_size()))
    for f in fulls:
        mesh_ranks = sorted(int(r) for r in f.dt.device_mesh.mesh.flatten().tolist())
        if mesh_ranks != ranks:
            raise ValueError(f"cannot save {f.name!r} to {path!r}: its device mesh spans ranks {mesh_ranks}, the "
                             f"group ranks {ranks}; a full-size save needs every DTensor on a mesh over exactly the "
                             "group's ranks (pass that group); nothing was written")


def _balance(sizes: List[int], world: int) -> List[int]:
    """A writer for each plain storage: the least loaded rank so far, largest storages first."""
    load = [0] * world
    out = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[k] = r
        load[r] += sizes[k]
    return out


def _split(entry_offset: int, start: int, n: int) -> Tuple[Optional[Tuple[int, int]], List[Tuple[int, int]]]:
    """A piece [start, start + n) of a record whose data starts at file offset `entry_offset`:
    (its whole 4 KiB blocks as (offset in the piece, length) or None, its other parts likewise)."""
    lo = entry_offset + start
    hi = lo + n
    a = -(-lo // _BLOCK) * _BLOCK
    b = hi // _BLOCK * _BLOCK
    if b <= a:
        return None, [(0, n)]
    rest = [(0, a - lo)] if a > lo else []
    if hi > b:
        rest.append((b - lo, hi - b))
    return (a - lo, b - a), rest


def save(obj: Any, path: str, g: Group, names: Dict[int, str], pickle_module: Any, pickle_protocol: int,
         byteorder: bool) -> None:
    """The full-size save (see the module's docstring); `names` from :func:`dtensor_names`."""
    writer = None
    committed = False
    try:
        # 1. pickle, plan, agree.
        err: Optional[BaseException] = None
        mine: Any = None
        storages: List[Any] = []
        try:
            path = _paths.check_save_target(path)
            if ts._serialization_tls.skip_data:
                raise ValueError(f"cannot save to {path!r} with group=: torch.serialization.skip_data "
                                 "is not supported by collective saves")
            data_pkl, storages = _pickle(obj, names, pickle_module, pickle_protocol, path)
            fulls = [s for s in storages if isinstance(s, _Full)]
            _check_meshes(fulls, g, path)
            plain = [k for k, s in enumerate(storages) if not isinstance(s, _Full)]
            plain_src = _collective_stage.Storages([storages[k] for k in plain], path)
            alignment = _torch_rules.storage_alignment()
            crc_on = bool(_torch_rules.compute_crc32())
            settings = ("full", alignment, crc_on, byteorder, sys.byteorder)
            mine = (_digest(data_pkl, [s.nbytes() for s in storages], settings),
                    _collective_stage.sample_crcs(plain_src),
                    archive.new_serialization_id() if g.rank == 0 else None, data_pkl if g.rank == 0 else None)
        except Exception as e:
            err = e
        agreed = g.exchange(mine, err, "to prepare (check the path, pickle the object)")
        for r in range(1, g.world):
            if agreed[r][0] != agreed[0][0]:
                raise ValueError(f"cannot save to {path!r}: ranks hold different objects: the pickle, the "
                                 f"tensors' global shapes or the storage sizes of rank {r} differ from rank 0's; "
                                 "nothing was written")
            if agreed[r][1] != agreed[0][1]:
                bad = next(i for i, (a, b) in enumerate(zip(agreed[r][1], agreed[0][1])) if a != b)
                raise ValueError(f"cannot save to {path!r}: ranks hold different data: the plain (not DTensor) "
                                 f"storage data/{plain[bad]} of rank {r} differs from rank 0's (sampled CRC-32); "
                                 "nothing was written")
        plan, entries, cd_offset, size = archive.plan_archive(agreed[0][3], storages, alignment, byteorder,
                                                              serialization_id=agreed[0][2])
        record = {int(entry.name.rsplit("/", 1)[1]): i for i, (p, _h, entry) in enumerate(plan)
                  if not isinstance(p, (bytes, bytearray))}  # storage key -> plan index

        # 2. this rank's pieces (redistributing where needed: collectives in the same order on
        # every rank), and the temporary file.
        err, tmp = None, None
        sources: List[torch.UntypedStorage] = []
        pieces: List[Tuple[int, int, int, int]] = []  # (plan index, start in the record, length, source index)
        offsets: List[int] = []                       # each source's first byte in its storage
        try:
            writers = _balance([storages[k].nbytes() for k in plain], g.world)
            for j, k in enumerate(plain):
                if writers[j] == g.rank and storages[k].nbytes():
                    pieces.append((record[k], 0, storages[k].nbytes(), len(sources)))
                    sources.append(storages[k])
                    offsets.append(0)
            turn = 0
            for k, s in enumerate(storages):
                if not isinstance(s, _Full):
                    continue
                dt, local, start = _contiguous_local(s.dt)
                turn += 1
                if local.numel() and _writes_replica(dt, turn):
                    pieces.append((record[k], start, local.numel() * local.element_size(), len(sources)))
                    sources.append(local.untyped_storage())
                    offsets.append(local.storage_offset() * local.element_size())
            if g.rank == 0:
                writer = _engine.region_file(path, create=True, size=size)
                tmp = os.path.abspath(writer.tmp_path)
        except Exception as e:
            err = e
        tmp = g.exchange(tmp, err, "to prepare its shards and the temporary file")[0]

        # 3. every rank writes its whole blocks, reads the rest for rank 0.
        err = None
        report: Any = None
        try:
            src = _collective_stage.Storages(sources, path)
            direct, shared = [], []  # (source, start in it, length, file offset), and which piece each is
            for p, (i, start, n, j) in enumerate(pieces):
                base = plan[i][2].data_offset
                whole, rest = _split(base, start, n)
                if whole is not None:
                    direct.append(((j, offsets[j] + whole[0], whole[1], base + start + whole[0]), p, whole[0]))
                shared += [((j, offsets[j] + a, m, base + start + a), p, a) for a, m in rest]
            if writer is None:
                writer = _engine.region_file(path, tmp)
            crcs = _write_share(writer, src, [d[0] for d in direct])
            if g.rank != 0:
                writer.finish()
            out = []
            it = src.ranges([s[0] for s in shared])
            try:
                for (_r, views) in it:
                    out.append(b"".join(v.numpy().tobytes() for v in views))
            finally:
                it.close()
            report = ([(pieces[p][0], pieces[p][1] + a, r[2], c) for (r, p, a), c in zip(direct, crcs)],
                      [(pieces[p][0], pieces[p][1] + a, b) for (_r, p, a), b in zip(shared, out)])
        except Exception as e:
            err = e
            if writer is not None and g.rank != 0:
                writer.abort()
        written = g.exchange(report, err, "to write its shards")
        layout = _pieces_by_record(plan, written, path)

        # 4. rank 0 writes the rest and commits.
        err = None
        if g.rank == 0:
            try:
                def pieces_of(i: int):
                    ps = layout.get(i, [])
                    crc = 0
                    if crc_on:
                        for start, n, c, _b in ps:
                            c = _engine.crc32(_b) if c is None else c
                            crc = _engine.crc32_combine(crc, c, n) if start else c
                    return [(start, b) for start, n, c, b in ps if b is not None], crc
                _write_records(writer, plan, entries, cd_offset, pieces_of, crc_on)
                writer.commit()
                committed = True
            except Exception as e:
                err = e
        g.exchange(None, err, "to commit")
    except BaseException as e:
        if writer is not None and not committed and g.rank == 0:
            writer.abort()  # removes the temporary file
        if isinstance(e, OSError):
            _paths.raise_named_after_target(e, path)
        raise


def _pieces_by_record(plan, written, path: str) -> Dict[int, List[Tuple[int, int, Optional[int], Optional[bytes]]]]:
    """{plan index: [(start, length, CRC-32 or None, bytes for rank 0 or None)] in order}, checked to
    cover each storage record exactly once (ValueError naming the record otherwise)."""
    out: Dict[int, List[Tuple[int, int, Optional[int], Optional[bytes]]]] = {}
    for direct, shared in written:
        for i, start, n, c in direct:
            out.setdefault(i, []).append((start, n, c, None))
        for i, start, b in shared:
            out.setdefault(i, []).append((start, len(b), None, b))
    for i, (payload, _h, entry) in enumerate(plan):
        if isinstance(payload, (bytes, bytearray)):
            continue
        ps = sorted(out.get(i, []), key=lambda p: p[0])
        out[i] = ps
        at = 0
        for start, n, _c, _b in ps:
            if start != at:
                break
            at += n
        if at != entry.size or sum(p[1] for p in ps) != entry.size:
            what = getattr(payload, "name", None)
            raise ValueError(f"cannot save to {path!r}: the ranks' shards of "
                             f"{repr(what) if what else entry.name} do not cover it exactly once (its "
                             f"{entry.size} bytes; the ranks hold {sum(p[1] for p in ps)}); do the DTensors' "
                             "meshes span the group? nothing was committed")
    return out
