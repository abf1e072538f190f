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
  ``Replicate`` (``Shard(0)`` along several mesh dimensions included). Other
  placements (``Shard(d>0)``: a TP shard of a weight is a run of short rows,
  which would be as many small writes) are first moved to ``Shard(0)`` on those
  mesh dimensions, one tensor at a time and point to point: only the ranks that
  will write the new rows receive them, each block from one holder, so a rank
  holds at most its shard, its new rows and the blocks in flight (``Partial``
  goes through DTensor's reduce-scatter). ``_StridedShard`` (FSDP2 over TP) is
  refused with the tensor's name. Of the ranks holding the same range
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
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.serialization as ts

from .._core import engine as _engine
from .._core import paths as _paths
from ..formats import archive, pickler
from ..formats import torch_rules as _torch_rules
from ..formats.torch_rules import contiguous_stride, is_dtensor, itemsize, storage_ref
from . import stage as _collective_stage
from .group import Group
from .save import Runs, _digest, _write_share, open_temporary, write_records

_BLOCK = 4096


class _Full:
    """The storage record of a DTensor's full tensor (its bytes come from the ranks' shards)."""

    def __init__(self, dt: Any, name: str):
        self.dt, self.name = dt, name
        self.n = dt.numel() * itemsize(dt.dtype)

    def nbytes(self) -> int:
        return self.n


def dtensor_names(obj: Any, path: str = "", out: Optional[Dict[int, str]] = None, depth: int = 0) -> Dict[int, str]:
    """{id(DTensor): its key path ("model.layers.0.weight", "state.3.exp_avg")} for the DTensors in
    the dicts, lists and tuples of `obj`; empty when it holds none."""
    out = {} if out is None else out
    if depth > 64:
        return out
    if is_dtensor(obj):
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
    from torch.distributed.tensor.placement_types import _StridedShard
    for p in dt.placements:
        if isinstance(p, _StridedShard):
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
        if not is_dtensor(o):
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


def box(shape, mesh_shape, coord, placements) -> Tuple[List[int], List[int]]:
    """(global offset, size) per dimension of the local shard at mesh coordinate `coord` for
    Shard / Replicate placements: each ``Shard(d)`` on mesh dimension i splits the extent along d
    left so far into ``mesh_shape[i]`` chunks of ceil(extent / n) (torch.chunk's rule, as DTensor
    shards: the last ones may be short or empty)."""
    from torch.distributed.tensor import Shard
    off, size = [0] * len(shape), [int(s) for s in shape]
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            d, n, extent = p.dim, mesh_shape[i], size[p.dim]
            chunk = -(-extent // n)
            start = min(extent, coord[i] * chunk)
            off[d] += start
            size[d] = min(extent, start + chunk) - start
    return off, size


def _writer_coords(mesh_shape, placements, turn: int) -> List[Tuple[int, ...]]:
    """The mesh coordinates of the ranks that write `placements`' ranges: of the ranks holding the
    same one (differing only on Replicate mesh dimensions), the turn-th, in turn per tensor."""
    import itertools
    from torch.distributed.tensor import Replicate
    out = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        j, count = 0, 1
        for d, p in enumerate(placements):
            if isinstance(p, Replicate):
                j = j * mesh_shape[d] + coord[d]
                count *= mesh_shape[d]
        if j == turn % count:
            out.append(coord)
    return out


def _rows(dt: Any, turn: int) -> Optional[Tuple[torch.Tensor, int]]:
    """What this rank writes of DTensor `dt`: (a contiguous row range of the full tensor, its first
    byte in it), or None. Placements other than Shard(0) and Replicate are first moved to Shard(0)
    on their mesh dimensions, point to point: every writer receives the blocks of its new rows
    from the ranks holding them (one holder per block), so a rank holds at most its shard, its
    new rows and its blocks in flight (Partial placements through DTensor's own redistribute, a
    reduce-scatter)."""
    import itertools
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if any(isinstance(p, Partial) for p in dt.placements):
        dt = dt.redistribute(dt.device_mesh, [p if isinstance(p, Replicate) else Shard(0) for p in dt.placements])
    mesh, shape, placements = dt.device_mesh, tuple(dt.shape), tuple(dt.placements)
    mesh_shape = tuple(mesh.mesh.shape)
    me = tuple(mesh.get_coordinate())
    local = dt._local_tensor
    off, size = box(shape, mesh_shape, me, placements)
    if tuple(compute_local_shape_and_global_offset(dt.shape, mesh, placements)[1]) != tuple(off) or \
            tuple(local.shape) != tuple(size):
        raise RuntimeError(f"fastckpt: the shard at {me} of placements {placements} is not the box {off}+{size}")
    row = itemsize(dt.dtype)
    for n in shape[1:]:
        row *= n
    rows_only = all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in placements)
    target = placements if rows_only or not shape else tuple(Replicate() if isinstance(p, Replicate) else Shard(0)
                                                            for p in placements)
    writers = _writer_coords(mesh_shape, target, turn)
    if rows_only or not shape:
        if me not in writers or not local.numel():
            return None
        return local.contiguous(), (off[0] * row if shape else 0)
    # Point to point: the holders of each block (one per distinct box) to the writers of the new rows.
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    rank_of = {c: int(mesh.mesh[c].item()) for c in coords}
    holders: Dict[Tuple, Tuple[int, ...]] = {}  # distinct current box -> its first holder
    for c in coords:
        o, z = box(shape, mesh_shape, c, placements)
        holders.setdefault((tuple(o), tuple(z)), c)

    def meet(a, b):
        lo = [max(x, y) for x, y in zip(a[0], b[0])]
        hi = [min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1])]
        return None if any(h <= l for l, h in zip(lo, hi)) else (lo, [h - l for l, h in zip(lo, hi)])

    def part(t, origin, cut):
        return t[tuple(slice(lo - o, lo - o + n) for lo, n, o in zip(cut[0], cut[1], origin))]

    out = None
    works, inbox, sent = [], [], []
    for w in writers:
        tb = box(shape, mesh_shape, w, target)
        if w == me:
            out = torch.empty(tb[1], dtype=local.dtype, device=local.device)
        for held, c in holders.items():
            cut = meet((list(held[0]), list(held[1])), tb)
            if cut is None:
                continue
            if c == me and w == me:
                part(out, tb[0], cut).copy_(part(local, off, cut))
            elif c == me:
                sent.append(part(local, off, cut).contiguous())  # alive until its send is done
                works.append(dist.isend(sent[-1], dst=rank_of[w]))
            elif w == me:
                buf = torch.empty(cut[1], dtype=local.dtype, device=local.device)
                works.append(dist.irecv(buf, src=rank_of[c]))
                inbox.append((buf, cut))
    for wk in works:
        wk.wait()
    del sent
    if out is None:
        return None
    tb = box(shape, mesh_shape, me, target)
    for buf, cut in inbox:
        part(out, tb[0], cut).copy_(buf)
    return (out, tb[0][0] * row) if out.numel() else None


def check_meshes(dtensors: List[Tuple[str, Any]], g: Group, path: str) -> None:
    """Every DTensor ([(name, DTensor)]) on a mesh over exactly the group's ranks (ValueError)."""
    import torch.distributed as dist
    ranks = sorted(dist.get_process_group_ranks(g.group))
    for name, dt in dtensors:
        mesh_ranks = sorted(int(r) for r in dt.device_mesh.mesh.flatten().tolist())
        if mesh_ranks != ranks:
            raise ValueError(f"cannot save {name!r} to {path!r}: its device mesh spans ranks {mesh_ranks}, the "
                             f"group ranks {ranks}; a full-size save needs every DTensor on a mesh over exactly the "
                             "group's ranks (pass that group); nothing was written")


def balance(sizes: List[int], world: int) -> List[int]:
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


Piece = Tuple[Any, int, int, Any, int]  # (record key, start in the record, length, source storage, its first byte)


def my_pieces(items: List[Tuple[Any, Any]], rank: int, world: int) -> List[Piece]:
    """What this rank writes of the records `items` ([(record key, DTensor or plain tensor)] in the
    same order on every rank): its DTensors' shards (redistributed where needed: collectives over
    their meshes, in this order on every rank; a replica's range by one rank in turn), and the
    plain tensors (whole, their bytes from their storage) assigned to it by :func:`balance`."""
    plain = [(key, t) for key, t in items if not is_dtensor(t)]
    writers = balance([_nbytes(t) for _k, t in plain], world)
    out: List[Piece] = []
    for (key, t), w in zip(plain, writers):
        n = _nbytes(t)
        if w == rank and n:
            if isinstance(t, torch.Tensor):
                out.append((key, 0, n, t.untyped_storage(), t.storage_offset() * t.element_size()))
            else:
                out.append((key, 0, n, t, 0))
    turn = 0
    for key, t in items:
        if not is_dtensor(t):
            continue
        turn += 1
        got = _rows(t, turn)
        if got is not None:
            local, start = got
            out.append((key, start, local.numel() * local.element_size(), local.untyped_storage(),
                        local.storage_offset() * local.element_size()))
    return out


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes()


class SharedFile:
    """One file that every rank of a group writes its pieces of (records at offsets known to all),
    rank 0 creating the temporary file, writing what lies outside the ranks' whole blocks and
    committing: the steps 2-4 of the module's docstring. Each method is a collective."""

    def __init__(self, g: Group, path: str, size: int):
        self.g, self.path, self.size = g, path, size
        self.writer: Any = None
        self.committed = False

    def open(self, err: Optional[BaseException]) -> None:
        """Rank 0 creates the temporary file (unless `err`, this rank's error so far, which the
        exchange raises on every rank); every rank opens it."""
        tmp = None
        if err is None and self.g.rank == 0:
            try:
                self.writer = _engine.region_file(self.path, create=True, size=self.size)
                tmp = os.path.abspath(self.writer.tmp_path)
            except Exception as e:
                err = e
        tmp = self.g.exchange(tmp, err, "to prepare its shards and the temporary file")[0]
        try:
            if self.writer is None:
                self.writer = open_temporary(self.g, self.path, tmp, 0)
        except Exception as e:
            err = e
        self._open_error = err

    def write(self, pieces: List[Piece], data_offset: Dict[Any, int], sizes: Dict[Any, int],
              names: Callable[[Any], str]) -> Dict[Any, List[Tuple[int, int, Optional[int], Optional[bytes]]]]:
        """Write this rank's whole blocks (fdatasync'd), hand the rest to rank 0; returns, on every
        rank, {record key: [(start, length, CRC-32 of a written piece or None, bytes for rank 0 or
        None)] in order}, checked to cover each record of `sizes` exactly once."""
        return self.write_each([pieces] if pieces else [], data_offset, sizes, names)

    def write_each(self, batches: Iterable[List[Piece]], data_offset: Dict[Any, int], sizes: Dict[Any, int],
                   names: Callable[[Any], str]) -> Dict[Any, List[Tuple[int, int, Optional[int], Optional[bytes]]]]:
        """:meth:`write` of the pieces that `batches` yields a list at a time (e.g. one tensor read
        from a source at a time): each batch is written before the next is asked for, so that a rank
        holds one batch's storages at once; an error raised by the iterator fails the write on
        every rank like any other."""
        err = self._open_error
        report: Any = None
        if err is None:
            try:
                direct: List[Any] = []
                shared: List[Any] = []
                for pieces in batches:
                    d, s = self._write_batch(pieces, data_offset)
                    direct += d
                    shared += s
                    del pieces  # this batch's storages go before the next batch is read
                if self.g.rank != 0:
                    self.writer.finish()
                report = (direct, shared)
            except Exception as e:
                err = e
        if err is not None and self.writer is not None and self.g.rank != 0:
            self.writer.abort()
        written = self.g.exchange(report, err, "to write its shards")
        return _pieces_by_record(written, sizes, names, self.path)

    def _write_batch(self, pieces: List[Piece], data_offset: Dict[Any, int]):
        """Write the whole blocks of `pieces`; ([(key, start, length, CRC-32)] of the written parts,
        [(key, start, bytes)] of the parts for rank 0)."""
        src = _collective_stage.Storages([p[3] for p in pieces], self.path)
        direct, shared = [], []  # ((source, start in it, length, file offset), piece, start in the piece)
        for j, (key, start, n, _s, first) in enumerate(pieces):
            base = data_offset[key]
            whole, rest = _split(base, start, n)
            if whole is not None:
                direct.append(((j, first + whole[0], whole[1], base + start + whole[0]), j, whole[0]))
            shared += [((j, first + a, m, base + start + a), j, a) for a, m in rest]
        crcs = _write_share(self.writer, src, [d[0] for d in direct])
        out = []
        it = src.ranges([x[0] for x in shared])
        try:
            for _r, views in it:
                out.append(b"".join(v.numpy().tobytes() for v in views))
        finally:
            it.close()
        return ([(pieces[j][0], pieces[j][1] + a, r[2], c) for (r, j, a), c in zip(direct, crcs)],
                [(pieces[j][0], pieces[j][1] + a, b) for (_r, j, a), b in zip(shared, out)])

    def commit(self, rest: Callable[[Any], None]) -> None:
        """Rank 0 writes the rest (``rest(writer)``) and commits; every rank returns after it."""
        err = None
        if self.g.rank == 0:
            try:
                rest(self.writer)
                self.writer.commit()
                self.committed = True
            except Exception as e:
                err = e
        self.g.exchange(None, err, "to commit")

    def abort(self) -> None:
        if self.writer is not None and not self.committed and self.g.rank == 0:
            self.writer.abort()  # removes the temporary file


def save(obj: Any, path: str, g: Group, names: Dict[int, str], pickle_module: Any, pickle_protocol: int,
         byteorder: bool) -> None:
    """The full-size save (see the module's docstring); `names` from :func:`dtensor_names`."""
    out: Optional[SharedFile] = None
    try:
        # 1. pickle, plan, agree.
        err: Optional[BaseException] = None
        mine: Any = None
        storages: List[Any] = []
        plain: List[int] = []
        try:
            path = _paths.check_save_target(path)
            if ts._serialization_tls.skip_data:
                raise ValueError(f"cannot save to {path!r} with group=: torch.serialization.skip_data "
                                 "is not supported by collective saves")
            data_pkl, storages = _pickle(obj, names, pickle_module, pickle_protocol, path)
            check_meshes([(s.name, s.dt) for s in storages if isinstance(s, _Full)], g, path)
            plain = [k for k, s in enumerate(storages) if not isinstance(s, _Full)]
            alignment = _torch_rules.storage_alignment()
            crc_on = bool(_torch_rules.compute_crc32())
            settings = ("full", alignment, crc_on, byteorder, sys.byteorder)
            mine = (_digest(data_pkl, [s.nbytes() for s in storages], settings),
                    _collective_stage.sample_crcs(_collective_stage.Storages([storages[k] for k in plain], path)),
                    archive.new_serialization_id() if g.rank == 0 else None, data_pkl if g.rank == 0 else None)
        except Exception as e:
            err = e
        agreed = g.exchange(mine, err, "to prepare (check the path, pickle the object)")
        check_agreed(agreed, path, lambda bad: f"the plain (not DTensor) storage data/{plain[bad]}")
        plan, entries, cd_offset, size = archive.plan_archive(agreed[0][3], storages, alignment, byteorder,
                                                              serialization_id=agreed[0][2])
        record = storage_records(plan)  # storage key -> plan index

        # 2. this rank's pieces (redistributing where needed), the temporary file.
        out = SharedFile(g, path, size)
        err, pieces = None, []
        try:
            pieces = my_pieces([(record[k], s.dt if isinstance(s, _Full) else s) for k, s in enumerate(storages)],
                               g.rank, g.world)
        except Exception as e:
            err = e
        out.open(err)

        # 3. every rank writes its whole blocks.
        layout = out.write(pieces, {i: plan[i][2].data_offset for i in record.values()},
                           {i: plan[i][2].size for i in record.values()},
                           lambda i: repr(getattr(plan[i][0], "name", None) or plan[i][2].name))

        # 4. rank 0 writes the rest and commits.
        out.commit(lambda w: write_records(w, plan, entries, cd_offset, record_pieces(layout, crc_on), crc_on))
    except BaseException as e:
        failed_write(e, out, path)
        raise


def storage_records(plan) -> Dict[int, int]:
    """{storage key k: index in `plan` of its record "data/k"} of a plan of
    :func:`fastckpt.formats.archive.plan_archive`."""
    return {int(entry.name.rsplit("/", 1)[1]): i for i, (p, _h, entry) in enumerate(plan)
            if not isinstance(p, (bytes, bytearray))}


def record_pieces(layout, crc_on: bool) -> Callable[[int], Tuple[List[Tuple[int, bytes]], int]]:
    """The ``pieces_of`` of :func:`fastckpt.collective.save.write_records` for the `layout` that
    :meth:`SharedFile.write` returned: record i's (bytes for rank 0 as [(offset, bytes)], CRC-32
    combined from every piece's)."""
    def pieces_of(i: int):
        ps = layout.get(i, [])
        crc = 0
        if crc_on:
            for start, n, c, b in ps:
                c = _engine.crc32(b) if c is None else c
                crc = _engine.crc32_combine(crc, c, n) if start else c
        return [(start, b) for start, _n, _c, b in ps if b is not None], crc
    return pieces_of


def write_safetensors_rest(w, head: bytes, offsets: Dict[str, int], layout) -> None:
    """Rank 0's bytes of a safetensors file that the ranks write: the header, and the parts of the
    tensors' bytes that :meth:`SharedFile.write` handed to it (`layout`)."""
    runs = Runs(w)
    runs.put(0, head)
    for n, at in offsets.items():
        for start, _n, _c, b in layout.get(n, []):
            if b is not None:
                runs.put(at + start, b)
    runs.flush()


def data_offsets(head: bytes, sizes: List[Tuple[Any, int]]) -> Tuple[Dict[Any, int], Dict[Any, int], int]:
    """A safetensors file's layout after its header `head`, the tensors' bytes end to end in the
    order of `sizes` ([(name, bytes)]): ({name: file offset}, {name: bytes}, the file's size)."""
    offsets: Dict[Any, int] = {}
    at = len(head)
    for n, size in sizes:
        offsets[n] = at
        at += size
    return offsets, dict(sizes), at


def failed_write(e: BaseException, out: Optional["SharedFile"], path: str) -> None:
    """What a failed full-size save does before raising `e`: rank 0 removes the temporary file; an
    OSError is raised named after the user's path."""
    if out is not None:
        out.abort()
    if isinstance(e, OSError):
        _paths.raise_named_after_target(e, path)


def check_agreed(agreed, path: str, plain_name: Callable[[int], str]) -> None:
    """Step 1's checks: every rank's (digest, sampled CRC-32s of the plain tensors, ...) like rank 0's."""
    for r in range(1, len(agreed)):
        if agreed[r][0] != agreed[0][0]:
            raise ValueError(f"cannot save to {path!r}: ranks hold different objects: the names, the tensors' "
                             f"global shapes and dtypes or the other values of rank {r} differ from rank 0's; "
                             "nothing was written")
        if agreed[r][1] != agreed[0][1]:
            bad = next(i for i, (a, b) in enumerate(zip(agreed[r][1], agreed[0][1])) if a != b)
            raise ValueError(f"cannot save to {path!r}: ranks hold different data: {plain_name(bad)} of rank "
                             f"{r} differs from rank 0's (sampled CRC-32); nothing was written")


def _pieces_by_record(written, sizes: Dict[Any, int], names: Callable[[Any], str], path: str
                      ) -> Dict[Any, List[Tuple[int, int, Optional[int], Optional[bytes]]]]:
    out: Dict[Any, List[Tuple[int, int, Optional[int], Optional[bytes]]]] = {}
    for direct, shared in written:
        for i, start, n, c in direct:
            out.setdefault(i, []).append((start, n, c, None))
        for i, start, b in shared:
            out.setdefault(i, []).append((start, len(b), None, b))
    for i, size in sizes.items():
        ps = sorted(out.get(i, []), key=lambda p: p[0])
        out[i] = ps
        at = 0
        for start, n, _c, _b in ps:
            if start != at:
                break
            at += n
        if at != size or sum(p[1] for p in ps) != size:
            raise ValueError(f"cannot save to {path!r}: the ranks' shards of {names(i)} do not cover it exactly "
                             f"once (its {size} bytes; the ranks hold {sum(p[1] for p in ps)}); do the DTensors' "
                             "meshes span the group? nothing was committed")
    return out


def save_safetensors(tensors: Dict[str, Any], path: str, g: Group, head: bytes, order: List[str]) -> None:
    """A safetensors file (the layout `head`, `order` of :func:`fastckpt.formats.safetensors.plan`, from
    the tensors' global shapes) that every rank of `g` writes its shards of: each DTensor's full tensor,
    each plain tensor once (they must agree across ranks); the steps of the module's docstring."""
    import hashlib
    out: Optional[SharedFile] = None
    try:
        err: Optional[BaseException] = None
        mine: Any = None
        plain = [n for n in order if not is_dtensor(tensors[n])]
        try:
            path = _paths.check_save_target(path)
            check_meshes([(n, tensors[n]) for n in order if is_dtensor(tensors[n])], g, path)
            for n in order:
                if is_dtensor(tensors[n]):
                    bad = _placement_error(n, tensors[n], path)
                    if bad:
                        raise ValueError(bad)
            digest = hashlib.sha256(head + repr(("safetensors", sys.byteorder)).encode()).digest()
            mine = (digest, _collective_stage.sample_crcs(_collective_stage.Storages(
                [_bytes_storage(tensors[n]) for n in plain], path)))
        except Exception as e:
            err = e
        agreed = g.exchange(mine, err, "to prepare (check the path and the tensors)")
        check_agreed(agreed, path, lambda bad: f"the plain (not DTensor) tensor {plain[bad]!r}")
        offsets, sizes, at = data_offsets(head, [(n, tensors[n].numel() * tensors[n].element_size()) for n in order])
        out = SharedFile(g, path, at)
        err, pieces = None, []
        try:
            pieces = my_pieces([(n, tensors[n]) for n in order], g.rank, g.world)
        except Exception as e:
            err = e
        out.open(err)
        layout = out.write(pieces, offsets, sizes, repr)
        out.commit(lambda w: write_safetensors_rest(w, head, offsets, layout))
    except BaseException as e:
        failed_write(e, out, path)
        raise


def _bytes_storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The bytes of contiguous `t` alone, as a storage (a view's storage may be larger)."""
    n = t.numel() * t.element_size()
    s = t.untyped_storage()
    first = t.storage_offset() * t.element_size()
    return s if first == 0 and n == s.nbytes() else s[first:first + n]
