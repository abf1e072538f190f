"""Collective load: ``fastckpt.load(path, group=pg, map_location=...)``.

Every rank of ``pg`` calls it and ends with the whole object, while the file is
read from disk once in total: each rank that has the file reads about 1/R of
its storage bytes (R: the ranks that have it) and the pieces are exchanged over
the process group. A rank whose path does not exist (a node without its
node-local copy, see ``save(..., placement="node")``) reads nothing and gets
every byte from its peers.

Flow (each step a collective over ``pg``, so a failure anywhere reaches every rank):
1. every rank opens ``path``, parses the zip directory and reads the small
   records (data.pkl and the few others torch reads); all_gather of (error,
   whether it has the file, a digest of its records table and small records).
   No rank has it: FileNotFoundError everywhere. Holders whose files differ:
   ValueError everywhere (no mix of two checkpoints).
2. if some rank lacks the file, the first holder broadcasts the parsed
   directory and the small records to all.
3. every rank allocates the result's storages; all_gather of errors.
4. the storage records' bytes, in file order, are cut into R contiguous shares
   balanced by bytes (cuts on 4 KiB inside a record, so that O_DIRECT reads
   stay aligned), each share into rounds of about _ROUND_BYTES. Round by
   round, every holder reads its part straight into the result's storages
   with the engine (the CRC-32 of each piece computed while reading), then
   every holder's part of the round is broadcast asynchronously, overlapping
   the next round's reads: a piece of _INPLACE_MIN bytes or more in place (the
   receivers' storages are its destination), smaller ones packed into one
   buffer per _PACK_BYTES. After the last broadcast: all_gather of (error |
   the pieces' CRC-32s).
5. every rank combines the pieces' CRCs into each record's (the same verdict on
   every rank: a damaged record is a FormatError naming the tensor everywhere),
   then unpickles locally as ``fastckpt.load`` does (weights-only rules,
   map_location).

Transport: a group whose backend handles CPU tensors (gloo, or a default group
with "cpu:gloo,cuda:nccl") exchanges host memory; a CUDA-only backend (nccl)
exchanges through a device buffer of the current CUDA device (a copy in and
out per piece).
"""

import contextlib
import hashlib
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _C, _paths, _zip
from ._collective import _Group, cut_runs

# A piece of at least this many bytes is broadcast in place; smaller ones are
# packed into buffers of about _PACK_BYTES (one collective each).
_INPLACE_MIN = 1 << 20
_PACK_BYTES = 16 << 20
_CUT_ALIGN = 4096
# Each holder reads its share in rounds of about this many bytes; a round's
# broadcasts run (gloo's threads) while the next round is read.
_ROUND_BYTES = 32 << 20


def _identity(archive: "_zip.Archive", small: Dict[str, bytes]) -> bytes:
    """A digest of what a file holds: its size, every record's name, place,
    size and CRC-32, and the small records' bytes."""
    h = hashlib.sha256()
    h.update(str(archive.file_size).encode())
    for name in sorted(archive.records):
        e = archive.records[name]
        h.update(f"\0{name}\0{e.data_offset}\0{e.size}\0{e.crc}".encode())
    for name in sorted(small):
        h.update(f"\0{name}\0{len(small[name])}\0".encode())
        h.update(small[name])
    return h.digest()


def _storage_records(archive: "_zip.Archive") -> List[str]:
    """Every storage record ("data/<key>"), in file order."""
    from .serialization import _SMALL_RECORDS
    recs = archive.records
    names = [n for n in recs if n.startswith("data/") and n not in _SMALL_RECORDS]
    return sorted(names, key=lambda n: recs[n].data_offset)


def _pieces(archive: "_zip.Archive", names: List[str], readers: int) -> List[List[Tuple[str, int, int]]]:
    """Per reader, its share: [(record, offset in the record, length)], the
    records' bytes concatenated in file order and cut into `readers`
    contiguous runs of about the same size (each cut moved up to the next
    4 KiB of its record)."""
    recs = archive.records
    sizes = [recs[n].size for n in names]
    total = sum(sizes)
    starts, s = [], 0
    for n in sizes:
        starts.append(s)
        s += n
    bounds = [0]
    k = 0
    for r in range(1, readers):
        b = total * r // readers
        while k < len(names) and starts[k] + sizes[k] <= b:
            k += 1
        if k < len(names):
            into = b - starts[k]
            b = starts[k] + min(sizes[k], -(-into // _CUT_ALIGN) * _CUT_ALIGN)
        bounds.append(max(b, bounds[-1]))
    bounds.append(total)
    return cut_runs(list(zip(names, sizes)), bounds)


def _rounds(shares: List[List[Tuple[str, int, int]]], round_bytes: int = _ROUND_BYTES
            ) -> List[List[List[Tuple[str, int, int]]]]:
    """rounds[j][k]: the pieces holder k reads and broadcasts in round j: its
    share, in order, cut into runs of about `round_bytes` (a piece cut where a
    run ends, on a 4 KiB multiple of its offset). Every rank computes the same
    rounds, so every rank issues the same broadcasts in the same order."""
    per: List[List[List[Tuple[str, int, int]]]] = []
    for share in shares:
        runs: List[List[Tuple[str, int, int]]] = []
        cur: List[Tuple[str, int, int]] = []
        size = 0
        for n, off, ln in share:
            while ln > 0:
                take = ln
                if size + ln > round_bytes:
                    take = min(ln, max(_CUT_ALIGN, (round_bytes - size) // _CUT_ALIGN * _CUT_ALIGN))
                cur.append((n, off, take))
                size, off, ln = size + take, off + take, ln - take
                if size >= round_bytes:
                    runs.append(cur)
                    cur, size = [], 0
        if cur:
            runs.append(cur)
        per.append(runs)
    count = max((len(r) for r in per), default=0)
    return [[per[k][j] if j < len(per[k]) else [] for k in range(len(shares))] for j in range(count)]


def _transport_device(dist, group) -> Optional[torch.device]:
    """None: the group's backend exchanges CPU tensors; else the CUDA device to
    exchange through (a CUDA-only backend)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or "ucc" in backend:
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"fastckpt.load(..., group=...): the group's backend {backend!r} exchanges neither CPU "
                         "tensors nor, on this process, CUDA tensors; use a gloo group")
    return torch.device("cuda", torch.cuda.current_device())


class _Exchange:
    """The broadcasts of step 4, issued asynchronously and waited for together."""

    def __init__(self, g: _Group, device: Optional[torch.device]):
        self.g, self.device = g, device
        self.works: List[Any] = []
        self.after: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []  # (received, destinations) to copy out

    def send(self, src: int, parts: List[torch.Tensor]) -> None:
        """Broadcast from group rank `src` the concatenation of `parts` (uint8
        views of the destinations, on every rank)."""
        mine = self.g.rank == src
        if self.device is None and len(parts) == 1:
            buf = parts[0]  # in place, on every rank
        elif mine:
            buf = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(self.device or "cpu")
        else:
            buf = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8, device=self.device or "cpu")
            self.after.append((buf, parts))
        src_global = self.g.dist.get_global_rank(self.g.group, src) if self.g.group is not None else src
        self.works.append(self.g.dist.broadcast(buf, src=src_global, group=self.g.group, async_op=True))

    def wait(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except Exception as e:
            raise self.g.lost(e, "the exchange of the shares") from e
        for buf, parts in self.after:
            buf = buf.cpu()
            off = 0
            for p in parts:
                p.copy_(buf[off:off + p.numel()])
                off += p.numel()


def load(f, group, map_location, weights_only: bool, pickle_module, verify: Optional[bool],
         pickle_load_args: Dict[str, Any]):
    """serialization.load with ``group`` (see the module's docstring)."""
    from . import serialization as ser

    path = os.fsdecode(os.fspath(f))
    g = _Group(group, path, action="load", outcome="nothing was loaded")
    with contextlib.ExitStack() as stack:
        # 1. open, parse, read the small records; agree on the file.
        err: Optional[BaseException] = None
        archive, small, fd, mine = None, None, -1, None
        try:
            try:
                fh = stack.enter_context(_paths.open_for_reading(path))
            except FileNotFoundError as e:
                err = e
                mine = (False, None, False)
            else:
                fd = fh.fileno()
                head = fh.read(32)
                fh.seek(0)
                if ser._is_legacy(head):
                    mine = (True, b"legacy", True)
                else:
                    archive = ser._parse_checkpoint(path, fh)
                    recs = archive.records
                    small = ser._Records(path, archive, fd, True).read(
                        [n for n in ser._SMALL_RECORDS if n in recs], [])
                    mine = (True, _identity(archive, small), False)
        except Exception as e:
            err, mine = e, None
        missing = err if isinstance(err, FileNotFoundError) else None
        agreed = g.exchange(mine, None if missing is not None else err, "to open and parse the file")
        holders = [r for r, m in enumerate(agreed) if m[0]]
        if not holders:
            assert missing is not None
            raise missing  # every rank's own FileNotFoundError
        first = agreed[holders[0]]
        for r in holders[1:]:
            if agreed[r][1] != first[1]:
                raise ValueError(f"cannot load {path!r}: ranks {holders[0]} and {r} have different files under "
                                 "that path (their records or metadata differ); nothing was loaded")
        if first[2]:  # torch's legacy format: no directory to share the reading by
            if len(holders) < g.world:
                lacking = [r for r in range(g.world) if r not in holders]
                raise ValueError(f"cannot load {path!r} with group=: it is in torch's legacy format, which is "
                                 f"not shared between ranks; ranks {lacking} do not have the file")
            stack.close()
            return torch.load(path, map_location=map_location, weights_only=weights_only,
                              **({} if weights_only else {"pickle_module": pickle_module}), **pickle_load_args)

        # 2. ranks without the file get the directory and the small records.
        if len(holders) < g.world:
            box = [archive, small] if g.rank == holders[0] else [None, None]
            src = g.dist.get_global_rank(group, holders[0]) if group is not None else holders[0]
            try:
                g.dist.broadcast_object_list(box, src=src, group=group)
            except Exception as e:
                raise g.lost(e, "the broadcast of the file's directory") from e
            archive, small = box

        # 3. every rank makes the result's storages (and learns how to exchange).
        names = _storage_records(archive)
        rounds = _rounds(_pieces(archive, names, len(holders)))
        storages = ser._Records(path, archive, fd, verify)
        err, device = None, None
        try:
            storages.claim(names)
            for n in names:
                storages[n] = ser._host_storage(archive.records[n].size)
            device = _transport_device(g.dist, group)
        except Exception as e:
            err = e
        g.exchange(None, err, "to allocate the result's storages")

        # 4. round by round, every holder reads its part of the round (the
        # engine, straight into the storages, a CRC-32 per piece) and then the
        # round's pieces of every holder are broadcast, asynchronously: the
        # next round's reads overlap them. A holder whose read failed still
        # takes part in every broadcast (its bytes are then garbage) and says
        # so in the exchange after them, where every rank raises.
        ex = _Exchange(g, device)
        k_mine = holders.index(g.rank) if g.rank in holders else -1
        crcs: Optional[List[Any]] = [] if k_mine >= 0 else None
        for rnd in rounds:
            if k_mine >= 0 and err is None and rnd[k_mine]:
                try:
                    crcs += storages.read_into([(n, off, storages[n][off:off + ln], verify is not False)
                                                for n, off, ln in rnd[k_mine]])
                except Exception as e:
                    err = e
            for k, src in enumerate(holders):
                batch: List[torch.Tensor] = []
                size = 0
                for n, off, ln in rnd[k]:
                    view = storages[n][off:off + ln]
                    if ln >= _INPLACE_MIN:
                        ex.send(src, [view])
                        continue
                    batch.append(view)
                    size += ln
                    if size >= _PACK_BYTES:
                        ex.send(src, batch)
                        batch, size = [], 0
                if batch:
                    ex.send(src, batch)
        ex.wait()
        got = g.exchange(crcs, err, "to read its share")
        stack.close()  # the file: later reads (records torch asks for late) open it again
        storages.fd = -1

    # 5. each record's CRC-32 from its pieces', then unpickle as a local load.
    if verify is not False:
        for k, src in enumerate(holders):
            for (n, off, ln), c in zip([p for rnd in rounds for p in rnd[k]], got[src]):
                storages.crcs[n] = _C.crc32_combine(storages.crcs[n], c or 0, ln) if off else (c or 0)
        for n in names:
            if archive.records[n].size == 0:
                storages.crcs[n] = 0
    bad = ser._check_storages(path, archive, storages, verify)
    return ser._load_read(path, small, archive, storages, bad, map_location, weights_only, pickle_module,
                          verify, pickle_load_args)
