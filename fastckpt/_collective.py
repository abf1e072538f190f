"""Collective save of replicated state: ``fastckpt.save(obj, path, group=pg)``.

Every rank of ``pg`` calls it with the same object. The file is byte-identical
to what a single-process ``fastckpt.save(obj, path)`` writes (with the same
serialization id), so stock ``torch.load`` and ``fastckpt verify`` read it.

Who writes what. Every rank pickles ``obj`` and plans the layout
(serialization._plan_archive) with rank 0's serialization id. The 4 KiB-aligned
bodies of the large storage records (records of _zip.DIRECT_MIN bytes or more
start on 4 KiB) are concatenated in file order and cut into ``world``
4 KiB-aligned contiguous shares, balanced so that every rank writes about the
same number of bytes (rank 0's share is smaller by what it writes besides); rank r writes share r (O_DIRECT from the
engine's staging where the filesystem allows) and computes each piece's CRC-32
while copying it. Rank 0 writes everything else: local headers, small records,
the record tails under 4 KiB, data descriptors and the central directory, once
it has every rank's piece CRCs (each record's CRC is its pieces' combined with
_C.crc32_combine, then its tail's).

Flow (each step a collective over ``pg``, so a failure anywhere reaches every rank):
1. agree: all_gather of (error, digest of data.pkl + storage sizes + settings,
   sampled CRC-32s of every storage, rank 0's serialization id). A digest or
   sample that differs raises ValueError on every rank: no mixed file.
2. rank 0 creates the temporary file next to ``path`` (the engine's temp-name
   rules, sized to the final length) and shares its name.
3. every rank writes its share and fdatasyncs, and checksums the next rank's
   share without writing it; all_gather of (error | piece CRCs): a share whose
   writer's CRCs differ from its checker's raises ValueError on every rank.
4. rank 0 writes the rest, fdatasyncs, renames, fsyncs the directory; all_gather
   of its result: every rank returns only after the commit, or raises.
On any error every rank raises, rank 0 removes the temporary file, and the
previous file at ``path`` is untouched. A rank that dies makes the others'
next collective fail (the group's timeout at the latest).
"""

import errno
import hashlib
import os
import struct
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _C, _paths, _torch_rules, _zip
from .engine import get_engine

# Sampled CRCs: a storage of up to _SAMPLE_WHOLE bytes is checksummed whole,
# a larger one in _SAMPLE_BLOCKS blocks of _SAMPLE_BLOCK bytes spread evenly
# (first and last included): at most 64 KiB read per storage.
_SAMPLE_WHOLE = 64 << 10
_SAMPLE_BLOCK = 4096
_SAMPLE_BLOCKS = 16
_BODY_ALIGN = 4096
# Rank 0's writes of small pieces are coalesced into runs of about this size.
_RUN_BYTES = 4 << 20


class _RemoteError(Exception):
    """Another rank's failure, as that rank described it."""


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage) if storage.nbytes() else torch.empty(0, dtype=torch.uint8)


def _record_bytes(tensors: List[torch.Tensor], plan, i: int) -> torch.Tensor:
    """The host bytes of storage record plan[i] ("archive/data/<k>")."""
    return tensors[int(plan[i][2].name.rsplit("/", 1)[1])]


def _sample_crcs(tensors: List[torch.Tensor]) -> List[int]:
    out = []
    for t in tensors:
        n = t.numel()
        if n <= _SAMPLE_WHOLE:
            out.append(_C.crc32(t) if n else 0)
            continue
        c = 0
        last = n - _SAMPLE_BLOCK
        for k in range(_SAMPLE_BLOCKS):
            off = last * k // (_SAMPLE_BLOCKS - 1)
            c = _C.crc32(t[off:off + _SAMPLE_BLOCK], c)
        out.append(c)
    return out


def _shares(plan, world: int, plan_size: int) -> Tuple[Dict[int, int], List[List[Tuple[int, int, int, int]]]]:
    """The aligned bodies and their split: ({plan index: body length},
    per rank [(plan index, offset in the record's data, length, file offset)]).
    `plan_size` is the file's size."""
    bodies = []  # (plan index, body length)
    for i, (payload, _header, entry) in enumerate(plan):
        if isinstance(payload, (bytes, bytearray)) or entry.size < _zip.DIRECT_MIN:
            continue
        if entry.data_offset % _BODY_ALIGN:
            continue  # not aligned (cannot happen with fastckpt's layout): rank 0 writes it
        body = entry.size // _BODY_ALIGN * _BODY_ALIGN
        if body:
            bodies.append((i, body))
    total = sum(b for _, b in bodies)
    blocks = total // _BODY_ALIGN
    if world == 1:
        bounds = [0, total]
    else:
        # Rank 0 also writes everything outside the bodies (`rest` bytes): its
        # share of the bodies is smaller by that much, so that every rank
        # writes about the same number of bytes.
        rest = plan_size - total
        first = max(0, min(blocks, ((total + rest) // world - rest) // _BODY_ALIGN))
        bounds = [0] + [(first + (blocks - first) * r // (world - 1)) * _BODY_ALIGN for r in range(world)]
    shares: List[List[Tuple[int, int, int, int]]] = [[] for _ in range(world)]
    start = 0  # of the current body in the concatenation
    for i, body in bodies:
        end = start + body
        for r in range(world):
            lo, hi = max(start, bounds[r]), min(end, bounds[r + 1])
            if lo < hi:
                data_offset = plan[i][2].data_offset
                shares[r].append((i, lo - start, hi - lo, data_offset + lo - start))
        start = end
    return dict(bodies), shares


def _digest(data_pkl: bytes, sizes: List[int], settings: Tuple) -> bytes:
    h = hashlib.sha256()
    h.update(repr(settings).encode())
    h.update(struct.pack(f"<{len(sizes)}Q", *sizes))
    h.update(data_pkl)
    return h.digest()


def _describe(e: BaseException) -> Tuple[Optional[int], str]:
    return (e.errno if isinstance(e, OSError) else None), f"{type(e).__name__}: {e}"


class _Group:
    """The collectives of one save; every exchange is an all_gather_object,
    so every rank learns every other rank's failure."""

    def __init__(self, group, path: str, action: str = "save to", outcome: str = "nothing was committed"):
        import torch.distributed as dist
        self.dist, self.group, self.path = dist, group, path
        self.action, self.outcome = action, outcome  # for the messages: "cannot <action> <path>: ...; <outcome>"
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def exchange(self, mine: Any, local_error: Optional[BaseException], what: str) -> List[Any]:
        """all_gather (error description | None, mine); raises on every rank
        when any rank failed: the local error itself on the rank that had it."""
        out: List[Any] = [None] * self.world
        payload = (_describe(local_error) if local_error is not None else None, mine)
        try:
            self.dist.all_gather_object(out, payload, group=self.group)
        except Exception as e:
            if local_error is not None:
                raise local_error
            # A rank died, or did not arrive within the group's timeout.
            raise self.lost(e, f"the group's exchange after each rank's attempt {what}") from e
        if local_error is not None:
            raise local_error
        for r, (err, _) in enumerate(out):
            if err is not None:
                code, msg = err
                raise OSError(code if code else errno.EIO,
                              f"cannot {self.action} {self.path!r}: rank {r} of the group failed {what} "
                              f"({msg}); {self.outcome}", self.path)
        return [m for _, m in out]

    def lost(self, e: BaseException, during: str) -> OSError:
        """The error for a collective that failed: a rank died, or did not
        arrive within the group's timeout."""
        return OSError(errno.EIO, f"cannot {self.action} {self.path!r}: a rank died or did not answer in time "
                                  f"({during} failed: {type(e).__name__}: {e}); {self.outcome}", self.path)


def save(obj: Any, f, group, pickle_module, pickle_protocol: int, byteorder: bool = True) -> None:
    """serialization.save with ``group`` (see the module's docstring)."""
    from . import serialization as ser
    import torch.serialization as ts

    if not isinstance(f, (str, os.PathLike)):
        # The same mistake on every rank: raised before any collective.
        raise ValueError("fastckpt.save(..., group=...) needs a path that every rank can write "
                         "(a shared filesystem), not a file object")
    path = os.fsdecode(os.fspath(f))
    g = _Group(group, path)
    writer = None
    committed = False
    try:
        # 1. pickle, plan, agree.
        err: Optional[BaseException] = None
        mine: Any = None
        try:
            path = _paths.check_save_target(path)
            if ts._serialization_tls.skip_data:
                raise ValueError(f"cannot save to {path!r} with group=: torch.serialization.skip_data "
                                 "is not supported by collective saves")
            data_pkl, storages = ser._pickle(obj, pickle_module, pickle_protocol)
            # Host bytes of every storage (a device storage: one host copy).
            tensors = [_bytes_of(s if s.device.type == "cpu" else s.cpu()) for s in storages]
            alignment = _torch_rules.storage_alignment()
            crc_on = bool(_torch_rules.compute_crc32())
            settings = (alignment, crc_on, byteorder, sys.byteorder)
            mine = (_digest(data_pkl, [t.numel() for t in tensors], settings), _sample_crcs(tensors),
                    ser._new_serialization_id() if g.rank == 0 else None)
        except Exception as e:
            err = e
        agreed = g.exchange(mine, err, "to prepare (check the path, pickle the object)")
        for r in range(1, g.world):
            if agreed[r][0] != agreed[0][0]:
                raise ValueError(f"cannot save to {path!r}: ranks hold different objects: the pickle or the "
                                 f"storage sizes of rank {r} differ from rank 0's; nothing was written")
            if agreed[r][1] != agreed[0][1]:
                bad = next(i for i, (a, b) in enumerate(zip(agreed[r][1], agreed[0][1])) if a != b)
                raise ValueError(f"cannot save to {path!r}: ranks hold different data: storage data/{bad} "
                                 f"of rank {r} differs from rank 0's (sampled CRC-32); nothing was written")
        plan, entries, cd_offset, size = ser._plan_archive(data_pkl, storages, alignment, byteorder,
                                                           serialization_id=agreed[0][2])
        bodies, shares = _shares(plan, g.world, size)

        # 2. rank 0 creates the temporary file.
        err, tmp = None, None
        if g.rank == 0:
            try:
                writer = _C.RegionWriter(get_engine(), path, create=True, size=size)
                tmp = writer.tmp_path
            except Exception as e:
                err = e
        tmp = g.exchange(tmp, err, "to create the temporary file")[0]

        # 3. every rank writes its share and makes it durable; it also checksums
        # the next rank's share (read only), so that a rank whose data differs
        # inside the share it writes is found even where the samples missed it.
        err, crcs, check = None, [], []
        try:
            if writer is None:
                writer = _C.RegionWriter(get_engine(), path, tmp)
            for i, start, n, off in shares[g.rank]:
                crcs.append(writer.write_at(_record_bytes(tensors, plan, i)[start:start + n], off, True))
            if g.rank != 0:
                writer.finish()
            if g.world > 1:
                for i, start, n, _off in shares[(g.rank + 1) % g.world]:
                    check.append(_C.crc32(_record_bytes(tensors, plan, i)[start:start + n]))
        except Exception as e:
            err = e
            if writer is not None:
                writer.abort()
        written = g.exchange((crcs, check), err, "to write its share")
        all_crcs = [w[0] for w in written]
        for s in range(g.world):
            v = (s - 1) % g.world
            if v != s and written[v][1] != all_crcs[s]:
                bad = next(k for k, (a, b) in enumerate(zip(written[v][1], all_crcs[s])) if a != b)
                i = shares[s][bad][0]
                raise ValueError(f"cannot save to {path!r}: ranks hold different data: {plan[i][2].name} "
                                 f"of rank {s} differs from rank {v}'s (CRC-32 of the share rank {s} wrote); "
                                 "nothing was committed")

        # 4. rank 0 writes the rest and commits.
        err = None
        if g.rank == 0:
            try:
                _write_rest(writer, plan, entries, cd_offset, tensors, bodies, shares, all_crcs, crc_on)
                writer.commit()
                committed = True
            except Exception as e:
                err = e
        g.exchange(None, err, "to commit")
    except BaseException as e:
        if writer is not None and not committed:
            writer.abort()  # rank 0: removes the temporary file
        if isinstance(e, OSError):
            _paths.raise_named_after_target(e, path)
        raise


def _write_rest(writer, plan, entries, cd_offset: int, tensors, bodies: Dict[int, int], shares, all_crcs,
                crc_on: bool) -> None:
    """Rank 0's part: every byte outside the shares, with each record's CRC
    combined from the ranks' piece CRCs."""
    piece_crcs: Dict[int, List[Tuple[int, int, int]]] = {}  # plan index -> [(start, len, crc)]
    for r, pieces in enumerate(shares):
        for (i, start, n, _off), c in zip(pieces, all_crcs[r]):
            piece_crcs.setdefault(i, []).append((start, n, c))
    run: List[bytes] = []
    run_off = 0
    run_len = 0

    def put(off: int, b) -> None:
        nonlocal run, run_off, run_len
        if run and (off != run_off + run_len or run_len >= _RUN_BYTES):
            writer.write_at(b"".join(run), run_off)
            run, run_len = [], 0
        if not run:
            run_off = off
        run.append(b)
        run_len += len(b)

    for i, (payload, header, entry) in enumerate(plan):
        put(entry.header_offset, header)
        size = entry.size
        if isinstance(payload, (bytes, bytearray)):
            put(entry.data_offset, bytes(payload))
            crc = _C.crc32(payload) if crc_on and size else 0
        else:
            t = _record_bytes(tensors, plan, i)
            body = bodies.get(i, 0)
            tail = t[body:].numpy().tobytes() if size > body else b""
            if tail:
                put(entry.data_offset + body, tail)
            crc = 0
            if crc_on:
                for start, n, c in sorted(piece_crcs.get(i, [])):
                    crc = _C.crc32_combine(crc, c, n) if start else c
                if tail:
                    crc = _C.crc32_combine(crc, _C.crc32(tail), len(tail)) if body else _C.crc32(tail)
        entry.crc = crc
        d = _zip.descriptor(crc, size, entry.header_offset)
        if d:
            put(entry.data_offset + size, d)
    put(cd_offset, _zip.central_directory(entries, cd_offset))
    if run:
        writer.write_at(b"".join(run), run_off)
