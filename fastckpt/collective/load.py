"""Collective load: ``fastckpt.load(path, group=pg, map_location=...)``.

Every rank of ``pg`` calls it and ends with the whole object, while the file is
read from disk once in total: each rank that has the file reads about 1/R of
its storage bytes (R: the ranks that have it) and the pieces are exchanged over
the process group. A rank whose path does not exist (a node without its
node-local copy, see ``save(..., placement="node")``) reads nothing and gets
every byte from its peers.

Flow (each step a collective over ``pg``, so a failure anywhere reaches every rank):
0. the group's backend (``torch.distributed.get_backend``) says which tensors
   it carries; a map_location (string or torch.device) it cannot carry is an
   error before the file is opened (reported in step 1's exchange, so every
   rank raises).
1. every rank opens ``path``, parses the zip directory and reads the small
   records (data.pkl and the few others torch reads); all_gather of (error,
   whether it has the file, a digest of its records table and small records).
   No rank has it: FileNotFoundError everywhere. Holders whose files differ:
   ValueError everywhere (no mix of two checkpoints).
2. if some rank lacks the file, the first holder broadcasts the parsed
   directory and the small records to all.
3. every rank decides where the result's storages go. Host result (no
   device map_location): it allocates them in host memory. Device result: it
   unpickles now (as ``fastckpt.load`` onto a device does) and gets empty
   device storages (fastckpt.torchsave.device.DeviceRecords). all_gather of (error,
   host/device, whether the backend carries every destination): the
   transport, the same on every rank, or an error on every rank.
4. the storage records' bytes, in file order, are cut into R contiguous shares
   balanced by bytes (cuts on 4 KiB inside a record, so that O_DIRECT reads
   stay aligned), each share into rounds. Round by round, every holder reads
   its part of the round with the engine (the CRC-32 of each piece computed
   while reading), then every holder's part is broadcast asynchronously; the
   next round is read while they run. A holder whose read failed still takes
   part in every broadcast (its bytes are then garbage) and says so in the
   exchange after them: all_gather of (error | the pieces' CRC-32s).
   The transports (fastckpt/_collective_exchange.py):
   * host (every rank's result on the host; needs a backend that carries CPU
     tensors): straight into the result's storages, a piece of 1 MiB or more
     broadcast in place, smaller ones packed (HostExchange).
   * staged through host memory (some rank's result on a device, and a
     backend that carries CPU tensors, e.g. gloo): every rank receives each
     round into host buffers of the staging pool (fastckpt.staging.todevice.RoundRing, a
     region per holder) and copies the pieces to its device storages through
     the device's copier (copy stream, events), while the next round is read
     and broadcast. Host memory: the ring (a few pool chunks), not the state.
   * device collectives (every rank's storages on one device the backend
     carries, e.g. NCCL and CUDA): each holder reads its part into the ring,
     copies it to its own device storages through the copier, and the large
     pieces are broadcast device-to-device straight into every rank's device
     storages; small ones go packed in a device buffer and are copied out on
     the device. Only holders use host memory (the ring).
5. every rank combines the pieces' CRCs into each record's (the same verdict on
   every rank: a damaged record is a FormatError naming the tensor everywhere),
   then (host result) unpickles locally as ``fastckpt.load`` does
   (weights-only rules, map_location).
"""

import contextlib
import hashlib
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._core import engine as _engine
from . import exchange as xch
from .._core import paths as _paths
from ..staging import device as _staging
from ..formats import zip as _zip
from ..formats import pickle_scan
from ..torchsave import device, load as tload, reader
from .group import Group
from .save import cut_runs

_CUT_ALIGN = 4096
# Each holder reads its share in rounds of about this many bytes; a round's
# broadcasts run (gloo's threads) while the next round is read.
_ROUND_BYTES = 32 << 20
# Staged (device result): a round is about one pool chunk in all, every
# holder's part at least _PART_MIN bytes (or the chunk). Pieces of _BIG_PIECE
# bytes or more start on 4 KiB in their region.
_PART_MIN = 1 << 20
_BIG_PIECE = 64 << 10


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
    recs = archive.records
    names = [n for n in recs if n.startswith("data/") and n not in reader.SMALL_RECORDS]
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


def _by_round(per: List[List[List[Any]]]) -> List[List[List[Any]]]:
    """Per holder its runs -> rounds[j][k] (empty where holder k has no run j)."""
    count = max((len(r) for r in per), default=0)
    return [[per[k][j] if j < len(per[k]) else [] for k in range(len(per))] for j in range(count)]


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
    return _by_round(per)


def _staged_rounds(shares: List[List[Tuple[str, int, int]]], part: int) -> List[List[List[Tuple[str, int, int, int]]]]:
    """As :func:`_rounds` for the staged transports: rounds[j][k] is holder
    k's part of round j, [(record, offset in the record, length, at)], `at`
    the piece's place in the part's host region (64-byte aligned, 4 KiB for
    pieces of _BIG_PIECE bytes or more); every region ends within `part`
    bytes (a multiple of 4 KiB), a piece cut where a region is full, on a
    4 KiB multiple of its offset."""
    per: List[List[List[Tuple[str, int, int, int]]]] = []
    for share in shares:
        runs: List[List[Tuple[str, int, int, int]]] = []
        cur: List[Tuple[str, int, int, int]] = []
        used = 0
        for n, off, ln in share:
            while ln > 0:
                a = _staging.ALIGN if ln >= _BIG_PIECE else _staging.PACK_ALIGN
                at = -(-used // a) * a
                room = part - at
                take = ln if ln <= room else max(room, 0) // _CUT_ALIGN * _CUT_ALIGN
                if take == 0:  # the region is full (it holds something: an empty one has `part` bytes of room)
                    runs.append(cur)
                    cur, used = [], 0
                    continue
                cur.append((n, off, take, at))
                used, off, ln = at + take, off + take, ln - take
                if used >= part:
                    runs.append(cur)
                    cur, used = [], 0
        if cur:
            runs.append(cur)
        per.append(runs)
    return _by_round(per)


def _staged_records(flow: "_Load", map_location):
    """fastckpt.torchsave.device.DeviceRecords whose finish() (called when torch's
    unpickling is done, the destinations known) is the collective exchange."""

    class Staged(device.DeviceRecords):
        agreed = False  # this rank joined step 3's agreement

        def finish(self, verify):
            dests = {j.name: xch.Dest(j.dst, j.copier) for j in self.jobs}
            dests.update((n, xch.Dest(u, None)) for n, u in self.host_jobs)
            return flow.exchange_staged(dests, self)

    return Staged(flow.path, flow.archive, reader.Records(flow.path, flow.archive, -1, flow.verify), map_location)


def _device_bound(map_location, small: Dict[str, bytes]) -> bool:
    """Whether this rank's result goes (in part) to a device the staging
    knows, as fastckpt.load decides it (the byte order this machine's)."""
    if small.get("byteorder", sys.byteorder.encode()).decode("ascii", "replace") != sys.byteorder:
        return False
    if map_location is None:
        tags = pickle_scan.location_tags(small.get("data.pkl", b""))
        return any(_staging.copier_for_location(t) is not None for t in tags)
    return device.moves_off_cpu(map_location)


class _Load:
    """One collective load (see the module's docstring)."""

    def __init__(self, path: str, group, verify: Optional[bool]):
        import torch.distributed as dist
        self.path, self.group, self.verify = path, group, verify
        self.g = Group(group, path, action="load", outcome="nothing was loaded")
        self.backend = xch.backend_name(dist, group)
        self.backends = xch.backends_of(self.backend)
        self.archive: Any = None
        self.holders: List[int] = []
        self.names: List[str] = []
        self.reader: Any = None  # a fastckpt.torchsave.reader.Records on the open file (holders)
        self.k_mine = -1
        self.rounds: List[List[List[Any]]] = []
        self.got: List[Any] = []
        self.chunk = 0  # the staged rounds' pool chunk, agreed

    # -- step 3's agreement and step 5's CRCs

    def agree(self, mine: Tuple[bool, bool, str], err: Optional[BaseException]) -> str:
        """all_gather of (error, (device result, device collectives fit, where,
        pool chunk)); returns the transport: "host", "staged" or "device", and
        sets the staged rounds' chunk (the smallest rank's: the same rounds everywhere)."""
        agreed = self.g.exchange(mine + (_staging.default_chunk(),), err, "to allocate the result's storages")
        self.chunk = min(m[3] for m in agreed)
        if not any(m[0] for m in agreed):
            if "cpu" not in self.backends:  # a host result everywhere: the ranks' own checks raised already
                raise xch.cannot_carry(self.path, self.backend, "CPU tensors")
            return "host"
        if all(m[1] for m in agreed):
            return "device"
        if "cpu" in self.backends:
            return "staged"
        r = next(r for r, m in enumerate(agreed) if not m[1])
        raise xch.cannot_carry(self.path, self.backend, f"the tensors of rank {r}'s result ({agreed[r][2]})")

    def crcs(self, rounds) -> Dict[str, int]:
        """Each record's CRC-32, combined from its pieces' (gathered in `got`)."""
        out: Dict[str, int] = {}
        for k, src in enumerate(self.holders):
            for p, c in zip([p for rnd in rounds for p in rnd[k]], self.got[src]):
                n, off, ln = p[0], p[1], p[2]
                out[n] = _engine.crc32_combine(out.get(n, 0), c or 0, ln) if off else (c or 0)
        for n in self.names:
            if self.archive.records[n].size == 0:
                out[n] = 0
        return out

    def checked(self, rounds) -> List[str]:
        """The records whose CRC-32 fails (fastckpt.torchsave.reader.check_storages' verdict)."""
        chk = reader.Records(self.path, self.archive, -1, self.verify)
        chk.update(dict.fromkeys(self.names))
        if self.verify is not False:
            chk.crcs = self.crcs(rounds)
        return reader.check_storages(self.path, self.archive, chk, self.verify)

    # -- step 4, host result

    def exchange_host(self, storages) -> Tuple[Optional[List[Any]], Optional[BaseException]]:
        rounds = self.rounds = _rounds(_pieces(self.archive, self.names, len(self.holders)))
        ex = xch.HostExchange(self.g)
        crcs: Optional[List[Any]] = [] if self.k_mine >= 0 else None
        err = None
        for rnd in rounds:
            if self.k_mine >= 0 and err is None and rnd[self.k_mine]:
                try:
                    crcs += self.reader.read_into([(n, off, storages[n][off:off + ln], self.verify is not False)
                                                   for n, off, ln in rnd[self.k_mine]])
                except Exception as e:
                    err = e
            for k, src in enumerate(self.holders):
                batch: List[torch.Tensor] = []
                size = 0
                for n, off, ln in rnd[k]:
                    view = storages[n][off:off + ln]
                    if ln >= xch._INPLACE_MIN:
                        ex.send(src, [view])
                        continue
                    batch.append(view)
                    size += ln
                    if size >= xch._PACK_BYTES:
                        ex.send(src, batch)
                        batch, size = [], 0
                if batch:
                    ex.send(src, batch)
        ex.wait()
        return crcs, err

    # -- step 4, staged

    def exchange_staged(self, dests: Dict[str, "xch.Dest"], records=None) -> List[str]:
        """Steps 3 (agreement) to 5 for a rank whose result is `dests`; returns
        the records that fail their CRC-32. `records`: the _DeviceRecords
        being finished (its ``agreed`` set once this rank joined the agreement)."""
        devices = {(d.copier, d.copier.device_key(d.view)) for n, d in dests.items()
                   if d.copier is not None and d.view.numel()}
        nonempty = [n for n in self.names if self.archive.records[n].size]
        ops = None
        if len(devices) == 1 and all(n in dests and dests[n].copier is not None for n in nonempty):
            ops = xch.device_ops(self.backends, *next(iter(devices)))
        where = ", ".join(sorted({str(k) for _, k in devices} | ({"cpu"} if any(
            d.copier is None for d in dests.values()) else set()))) or "cpu"
        if records is not None:
            records.agreed = True
        transport = self.agree((True, ops is not None, where), None)
        copier = next(iter(devices))[0] if devices else xch.HOST_COPIER
        crcs, err = self.run_staged(dests, copier, ops if transport == "device" else None)
        self.got = self.g.exchange(crcs, err, "to read its share")
        return self.checked(self.rounds)

    def run_staged(self, dests: Dict[str, "xch.Dest"], copier, ops: Optional["xch.DeviceOps"]):
        """Step 4, staged: every rank cuts the same rounds (from the agreed
        chunk), then the rounds run (xch.StagedRun)."""
        H = len(self.holders)
        part = max(_CUT_ALIGN, min(self.chunk, max(_PART_MIN, self.chunk // H)) // _CUT_ALIGN * _CUT_ALIGN)
        self.rounds = _staged_rounds(_pieces(self.archive, self.names, H), part)
        return xch.StagedRun(self.g, self.path, self.holders, self.k_mine, self.reader, self.verify, self.rounds,
                             part, self.chunk).run(dests, copier, ops)


def load(f, group, map_location, weights_only: bool, pickle_module, verify: Optional[bool],
         pickle_load_args: Dict[str, Any]):
    """serialization.load with ``group`` (see the module's docstring)."""

    path = os.fsdecode(os.fspath(f))
    flow = _Load(path, group, verify)
    g = flow.g
    with contextlib.ExitStack() as stack:
        # 0-1. what the backend carries; open, parse, read the small records; agree on the file.
        err: Optional[BaseException] = xch.unfit(path, flow.backend, flow.backends, map_location)
        archive, small, fd, mine = None, None, -1, None
        if err is None:
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
                    if pickle_scan.is_legacy(head):
                        mine = (True, b"legacy", True)
                    else:
                        archive = reader.parse_checkpoint(path, fh)
                        recs = archive.records
                        small = reader.Records(path, archive, fd, True).read(
                            [n for n in reader.SMALL_RECORDS if n in recs], [])
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
            try:
                g.broadcast_objects(box, src=xch.global_rank(g, holders[0]), group=group)
            except Exception as e:
                raise g.lost(e, "the broadcast of the file's directory") from e
            archive, small = box

        flow.archive, flow.holders = archive, holders
        flow.names = _storage_records(archive)
        flow.k_mine = holders.index(g.rank) if g.rank in holders else -1
        flow.reader = reader.Records(path, archive, fd, verify)

        # 3-5 for a result on a device: unpickle now (device storages made
        # empty), the exchange when torch's unpickling is done (finish).
        if _device_bound(map_location, small):
            records = _staged_records(flow, map_location)
            try:
                return tload.unpickle_records(path, small, archive, records, [], map_location, weights_only, pickle_module,
                                      verify, pickle_load_args)
            except Exception as e:
                if not records.agreed:  # failed before the agreement: the others learn it there
                    records.agreed = True
                    flow.agree((True, False, ""), e)
                raise

        # 3. a result in host memory: every rank makes the result's storages.
        storages = reader.Records(path, archive, fd, verify)
        err = None
        try:
            if "cpu" not in flow.backends:
                raise xch.cannot_carry(path, flow.backend, "CPU tensors (the result's storages stay on the host)")
            storages.update(storages.allocate(flow.names))
        except Exception as e:
            err = e
        if flow.agree((False, False, "cpu"), err) == "host":
            crcs, err = flow.exchange_host(storages)
        else:  # another rank's result is on a device: staged, into these storages
            crcs, err = flow.run_staged({n: xch.Dest(storages[n], None) for n in flow.names}, xch.HOST_COPIER, None)
        flow.got = g.exchange(crcs, err, "to read its share")
        stack.close()  # the file: later reads (records torch asks for late) open it again
        storages.fd = -1
        if verify is not False:
            storages.crcs.update(flow.crcs(flow.rounds))
        bad = reader.check_storages(path, archive, storages, verify)
    return tload.unpickle_records(path, small, archive, storages, bad, map_location, weights_only, pickle_module,
                          verify, pickle_load_args)
