"""Collective save of replicated state: ``fastckpt.save(obj, path, group=pg)``.

Every rank of ``pg`` calls it with the same object. The file is byte-identical
to what a single-process ``fastckpt.save(obj, path)`` writes (with the same
serialization id), so stock ``torch.load`` and ``fastckpt verify`` read it.

Who writes what. Every rank pickles ``obj`` and plans the layout
(fastckpt.formats.archive.plan_archive) with rank 0's serialization id. The 4 KiB-aligned
bodies of the large storage records (records of _zip.DIRECT_MIN bytes or more
start on 4 KiB) are concatenated in file order and cut into ``world``
4 KiB-aligned contiguous shares, balanced so that every rank writes about the
same number of bytes (rank 0's share is smaller by what it writes besides); rank r writes share r (O_DIRECT from the
engine's staging where the filesystem allows) and computes each piece's CRC-32
while copying it. Rank 0 writes everything else: local headers, small records,
the record tails under 4 KiB, data descriptors and the central directory, once
it has every rank's piece CRCs (each record's CRC is its pieces' combined with
_engine.crc32_combine, then its tail's).

Host memory. CPU storages are read in place. A rank brings to the host only
the device bytes it needs (fastckpt/collective/stage.py): the sampled blocks
(step 1), its own share and the next rank's (step 3) and, on a copy's lead,
the small records and record tails (step 4), each range through the staging
pool (fastckpt.staging.tohost.ToHost; the checker through a smaller pool of its
own), its copies running ahead of the writes. Host staging memory: the two
pools' buffers, whatever the state's size.

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

placement="node" (node-local disks, no shared filesystem): every node writes
one complete copy of the file to its own ``path`` (ranks may pass different
paths; the ranks of one node must pass the same one). A rank's node is
$FASTCKPT_NODE, else its host name; the ranks learn each other's in step 1.
Each node's ranks split its copy exactly as the shared placement splits the
file among all ranks (``_shares`` over the node's ranks), and the node's
lowest rank plays rank 0's part for that copy: it creates the temporary file,
writes the rest. Every copy is the same file (rank 0's serialization id), the
single-process save's bytes. Step 3 also compares the copies: each record's
CRC-32, combined from its node's piece CRCs, must be the same on every node
(ValueError otherwise). With more than one node, step 4 is two-phase:
4a. every node's lead writes the rest and fdatasyncs its temporary file (not
    renamed); all_gather: any failure raises on every rank, every lead removes
    its temporary file, and NO node's file has changed.
4b. only then every lead renames and fsyncs its directory; all_gather of the
    outcomes. All renamed: every rank returns. A lead whose rename (or
    directory fsync) fails, or a rank that dies in 4b, is a partial commit:
    every surviving rank raises OSError saying which nodes committed (the
    error's ``committed_nodes``); a node that did not commit keeps its
    previous file (if only its directory fsync failed, the rename may have
    happened), the others hold the new file, complete and durable.
"""

import errno
import hashlib
import pickletools
import os
import socket
import struct
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

from .._core import engine as _engine
from ..formats import archive, pickler
from . import stage as _collective_stage
from .group import Group, describe
from .._core import paths as _paths
from ..errors import RanksFailed
from ..formats import torch_rules as _torch_rules, zip as _zip

_BODY_ALIGN = 4096
# Rank 0's writes of small pieces are coalesced into runs of about this size.
_RUN_BYTES = 4 << 20
# Where the copies go: "shared" (one file on a filesystem every rank shares)
# or "node" (one copy per node on its local disk).
PLACEMENTS = ("shared", "node")


def node_name() -> str:
    """This process's node for placement="node": $FASTCKPT_NODE, else the host name."""
    return os.environ.get("FASTCKPT_NODE") or socket.gethostname()


class _Copies:
    """Which ranks write which copy of the file: one copy written by every
    rank ("shared": every rank's node is ""), or one per node. Copies are
    ordered by their lowest rank, their lead (copy 0: rank 0's)."""

    def __init__(self, rank: int, nodes: List[str]):
        self.names: List[str] = []
        self.members: List[List[int]] = []  # per copy, its ranks ascending
        index: Dict[str, int] = {}
        for r, n in enumerate(nodes):
            if n not in index:
                index[n] = len(self.names)
                self.names.append(n)
                self.members.append([])
            self.members[index[n]].append(r)
        self.mine = index[nodes[rank]]
        self.ranks = self.members[self.mine]
        self.local = self.ranks.index(rank)  # this rank's share of its copy
        self.lead = self.local == 0


def _storage_of(plan, i: int) -> int:
    """The storage index k of storage record plan[i] ("archive/data/<k>")."""
    return int(plan[i][2].name.rsplit("/", 1)[1])


def _share_ranges(plan, share) -> List[Tuple[int, int, int, int]]:
    """A share's pieces as ranges of the storages: (k, start, length, file offset)."""
    return [(_storage_of(plan, i), start, n, off) for i, start, n, off in share]


def _shares(plan, world: int, plan_size: int) -> Tuple[Dict[int, Tuple[int, int]], List[List[Tuple[int, int, int, int]]]]:
    """The aligned bodies and their split: ({plan index: (offset of the body in
    the record's data, body length)}, per rank [(plan index, offset in the
    record's data, length, file offset)]). A body is the part of a large
    record between its first and last 4 KiB boundaries in the file (all of it
    less the tail where the record starts on one, as on fastckpt's 4 KiB
    layout; records of torch's 64-byte layout have a head too). `plan_size`
    is the file's size."""
    bodies = []  # (plan index, body length)
    heads: Dict[int, int] = {}
    for i, (payload, _header, entry) in enumerate(plan):
        if isinstance(payload, (bytes, bytearray)) or entry.size < _zip.DIRECT_MIN:
            continue
        head = -entry.data_offset % _BODY_ALIGN
        body = (entry.size - head) // _BODY_ALIGN * _BODY_ALIGN
        if body > 0:
            bodies.append((i, body))
            heads[i] = head
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
    shares = [[(i, heads[i] + off, n, plan[i][2].data_offset + heads[i] + off) for i, off, n in run]
              for run in cut_runs(bodies, bounds)]
    return {i: (heads[i], b) for i, b in bodies}, shares


def cut_runs(items, bounds: List[int]) -> List[List[Tuple[Any, int, int]]]:
    """Items [(key, size)] laid end to end, cut at `bounds` (increasing,
    bounds[0] == 0, bounds[-1] == the total): per run, [(key, offset in the
    item, length)] in order. The splitter of the collective save's shares and
    the collective load's."""
    runs: List[List[Tuple[Any, int, int]]] = [[] for _ in range(len(bounds) - 1)]
    start = 0  # of the current item in the concatenation
    for key, size in items:
        end = start + size
        for r in range(len(runs)):
            lo, hi = max(start, bounds[r]), min(end, bounds[r + 1])
            if lo < hi:
                runs[r].append((key, lo - start, hi - lo))
        start = end
    return runs


def _digest(data_pkl: bytes, sizes: List[int], settings: Tuple) -> bytes:
    """What the ranks compare to agree that they hold the same object: the pickle with its storages'
    device indices left out (:func:`device_blind`), the storages' sizes and the save settings."""
    h = hashlib.sha256()
    h.update(repr(settings).encode())
    h.update(struct.pack(f"<{len(sizes)}Q", *sizes))
    h.update(device_blind(data_pkl))
    return h.digest()


_PUTS = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}


def device_blind(data_pkl: bytes) -> bytes:
    """``data_pkl`` (a torch.save pickle) as every DDP rank pickles the same state: each storage's
    location ("cuda:3", the 4th element of its persistent id) replaced by its device type ("cuda"),
    and FRAME headers (whose lengths follow the locations') left out. Rank r's copy of a replicated
    model is on cuda:r, so the ranks' pickles differ in exactly these bytes; everything else must
    match. Walks the opcodes (pickletools; nothing is executed) with a model of the stack that is
    exact for the persistent ids torch writes (MARK, 'storage', GLOBAL or STACK_GLOBAL, key,
    location, numel, TUPLE, BINPERSID) and ignores the rest."""
    ops = list(pickletools.genops(data_pkl))
    out: List[bytes] = []
    cut = 0                              # data_pkl[cut:pos] not yet copied to out
    marks: List[List[Tuple]] = []        # elements pushed since each open MARK: (kind, value, start, end)
    memo: Dict[int, Tuple] = {}
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data_pkl)
        if op.name == "FRAME":
            out.append(data_pkl[cut:pos])
            cut = end
            continue
        if op.name == "MARK":
            marks.append([])
            continue
        if op.name in _PUTS:
            top = marks[-1][-1] if marks and marks[-1] else ("other", None, pos, end)
            memo[len(memo) if op.name == "MEMOIZE" else arg] = top
            continue
        if pickletools.markobject in op.stack_before:
            elems = marks.pop() if marks else []
            j = i + 1
            while j < len(ops) and ops[j][0].name in _PUTS:
                j += 1
            if (op.name == "TUPLE" and j < len(ops) and ops[j][0].name == "BINPERSID" and len(elems) == 5
                    and elems[0][:2] == ("str", "storage") and elems[3][0] == "str"):
                _, loc, a, b = elems[3]
                out.append(data_pkl[cut:a])
                out.append(b"<" + str(loc).split(":")[0].encode() + b">")
                cut = b
            pushed = [("other", None, pos, end)] * len(op.stack_after)
        else:
            if op.name in ("BINGET", "LONG_BINGET", "GET"):
                kind, value = memo.get(arg, ("other", None))[:2]
                pushed = [(kind, value, pos, end)]
            elif isinstance(arg, str) and op.stack_after and not op.stack_before:
                pushed = [("str", arg, pos, end)]
            else:
                pushed = [("other", None, pos, end)] * len(op.stack_after)
            if marks:
                del marks[-1][len(marks[-1]) - min(len(op.stack_before), len(marks[-1])):]
        if marks:
            marks[-1].extend(pushed)
    out.append(data_pkl[cut:])
    return b"".join(out)


def save(obj: Any, f, group, pickle_module, pickle_protocol: int, byteorder: bool = True,
         placement: str = "shared") -> None:
    """serialization.save with ``group`` (see the module's docstring)."""
    import torch.serialization as ts

    if placement not in PLACEMENTS:
        raise ValueError(f"fastckpt.save: placement={placement!r} is not one of {PLACEMENTS}")
    if not isinstance(f, (str, os.PathLike)):
        # The same mistake on every rank: raised before any collective.
        raise ValueError("fastckpt.save(..., group=...) needs a path that every rank can write "
                         "(a shared filesystem), not a file object" if placement == "shared" else
                         "fastckpt.save(..., group=..., placement='node') needs a path on each node's disk, "
                         "not a file object")
    path = os.fsdecode(os.fspath(f))
    g = Group(group, path)
    from . import full as _full  # (it imports this module's pieces)
    names = _full.dtensor_names(obj)
    if names:
        if placement != "shared":
            raise ValueError(f"cannot save to {path!r}: DTensors are saved as full-size tensors into one shared "
                             "file; placement='node' is for replicated state")
        _full.save(obj, path, g, names, pickle_module, pickle_protocol, byteorder)
        return
    node = node_name() if placement == "node" else ""
    writer = None
    committed = False
    try:
        # 1. pickle, plan, agree (and learn every rank's node and path).
        err: Optional[BaseException] = None
        mine: Any = None
        try:
            path = _paths.check_save_target(path)
            if ts._serialization_tls.skip_data:
                raise ValueError(f"cannot save to {path!r} with group=: torch.serialization.skip_data "
                                 "is not supported by collective saves")
            data_pkl, storages = pickler.pickle_with_storages(obj, pickle_module, pickle_protocol)
            # The storages' bytes: CPU ones in place, device ones staged range
            # by range when needed (_collective_stage).
            src = _collective_stage.Storages(storages, path)
            alignment = _torch_rules.storage_alignment()
            crc_on = bool(_torch_rules.compute_crc32())
            settings = (alignment, crc_on, byteorder, sys.byteorder)
            # rank 0's pickle is the file's (the others' differ in their storages' device indices)
            mine = (_digest(data_pkl, src.sizes, settings), _collective_stage.sample_crcs(src),
                    archive.new_serialization_id() if g.rank == 0 else None, node, os.path.abspath(path),
                    data_pkl if g.rank == 0 else None)
        except Exception as e:
            err = e
        agreed = g.exchange(mine, err, "to prepare (check the path, pickle the object)")
        copies = _Copies(g.rank, [a[3] for a in agreed])
        for c, ranks in enumerate(copies.members if placement == "node" else []):
            for r in ranks[1:]:
                if agreed[r][4] != agreed[ranks[0]][4]:
                    raise ValueError(f"cannot save to {path!r} with placement='node': ranks {ranks[0]} and {r} "
                                     f"of node {copies.names[c]!r} pass different paths ({agreed[ranks[0]][4]!r} "
                                     f"and {agreed[r][4]!r}); the ranks of one node must pass the same path; "
                                     "nothing was written")
        for r in range(1, g.world):
            if agreed[r][0] != agreed[0][0]:
                raise ValueError(f"cannot save to {path!r}: ranks hold different objects: the pickle or the "
                                 f"storage sizes of rank {r} differ from rank 0's; nothing was written")
            if agreed[r][1] != agreed[0][1]:
                bad = next(i for i, (a, b) in enumerate(zip(agreed[r][1], agreed[0][1])) if a != b)
                raise ValueError(f"cannot save to {path!r}: ranks hold different data: storage data/{bad} "
                                 f"of rank {r} differs from rank 0's (sampled CRC-32); nothing was written")
        data_pkl = agreed[0][5]
        plan, entries, cd_offset, size = archive.plan_archive(data_pkl, storages, alignment, byteorder,
                                                           serialization_id=agreed[0][2])
        split: Dict[int, Any] = {}  # ranks per copy -> (bodies, shares)
        for ranks in copies.members:
            if len(ranks) not in split:
                split[len(ranks)] = _shares(plan, len(ranks), size)
        bodies, shares = split[len(copies.ranks)]

        # 2. each copy's lead (rank 0 for the shared file) creates its temporary file.
        err, tmp = None, None
        if copies.lead:
            try:
                writer = _engine.region_file(path, create=True, size=size)
                tmp = os.path.abspath(writer.tmp_path)
            except Exception as e:
                err = e
        tmp = g.exchange(tmp, err, "to create the temporary file")[copies.ranks[0]]

        # 3. every rank writes its share and makes it durable; it also checksums
        # the next rank's share (read only), so that a rank whose data differs
        # inside the share it writes is found even where the samples missed it.
        err, crcs = None, []
        # The check runs on a thread of its own while this rank's writes wait
        # for the disk (_engine.crc32 releases the GIL).
        checker = _Checker(src, _share_ranges(plan, shares[(copies.local + 1) % len(copies.ranks)])
                           if len(copies.ranks) > 1 else [])
        try:
            if writer is None:
                writer = open_temporary(g, path, tmp, copies.ranks[0])
            crcs = _write_share(writer, src, _share_ranges(plan, shares[copies.local]))
            if not copies.lead:
                writer.finish()
        except Exception as e:
            err = e
            if writer is not None:
                writer.abort()
        try:
            check = checker.result()
        except Exception as e:
            check, err = [], err or e
        written = g.exchange((crcs, check), err, "to write its share")
        _check_shares(path, plan, copies, split, written)
        all_crcs = [written[r][0] for r in copies.ranks]

        # 4. each lead writes the rest and commits (two-phase with several copies).
        many = len(copies.members) > 1
        err = None
        if copies.lead:
            try:
                _write_rest(writer, plan, entries, cd_offset, src, bodies, shares, all_crcs, crc_on)
                if many:
                    writer.finish()
                else:
                    writer.commit()
                    committed = True
            except Exception as e:
                err = e
        if not many:
            g.exchange(None, err, "to commit")
            return
        g.exchange(None, err, "to write the rest of its node's copy and make it durable")
        status: Any = None
        if copies.lead:
            try:
                writer.commit()
                committed = True
                status = True
            except Exception as e:
                status = describe(e)
        _check_commits(g, copies, path, status, committed)
    except BaseException as e:
        if writer is not None and not committed:
            writer.abort()  # a lead: removes the temporary file
        if isinstance(e, OSError):
            _paths.raise_named_after_target(e, path)
        raise


def open_temporary(g: Group, path: str, tmp: str, creator: int):
    """A RegionWriter on the temporary file `tmp` of a save of `path` that rank `creator` created.
    Every rank learned its name in an exchange, and only its creator removes it, when it gives up:
    gone, the group broke before this rank opened it (a rank died or did not answer; a failure
    reported by a rank needs this rank in the exchange), and without this rank's part nothing can
    have been committed: that is the error, as the group's other ranks raise it."""
    try:
        return _engine.region_file(path, tmp)
    except FileNotFoundError as e:
        raise g.lost(e, f"opening the temporary file {tmp!r}, which rank {creator} had created and has "
                        "removed since") from e


def _write_share(writer, src: "_collective_stage.Storages", ranges) -> List[int]:
    """Write this rank's share (ranges (k, start, length, file offset)) and
    return each range's CRC-32. A device range arrives in pieces of the
    staging pool, written while the next pieces are copied to the host."""
    crcs: List[int] = []
    it = src.ranges(ranges)
    try:
        for (_k, _start, _n, off), views in it:
            crc = at = 0
            for v in views:
                c = writer.write_at(v, off + at, True)
                crc = _engine.crc32_combine(crc, c, v.numel()) if at else c
                at += v.numel()
            crcs.append(crc)
    finally:
        it.close()
    return crcs


class _Checker:
    """The CRC-32s of another rank's share (without writing it), computed on a
    thread while this rank writes its own; result() joins it (an error there
    is raised by result()). Device bytes are staged through a pool of their
    own (_collective_stage.check_chunk), so the writes' copies never wait for
    the checker's buffers nor the checker for theirs. Its copies are ordered
    after this thread's current stream only (on CUDA, the thread's default
    stream), yet they see the caller's data: step 1 copied a sample of every
    device storage, each copy ordered after the caller's current stream of its
    device, and waited for them, so what the caller had queued is done."""

    def __init__(self, src: "_collective_stage.Storages", ranges):
        self.crcs: List[int] = []
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(src, ranges), name="fastckpt-check", daemon=True)
        self.thread.start()

    def _run(self, src, ranges) -> None:
        try:
            it = src.ranges(ranges, _collective_stage.check_chunk() if src.staged else None)
            try:
                for _r, views in it:
                    crc = 0
                    for v in views:
                        crc = _engine.crc32(v, crc)
                    self.crcs.append(crc)
            finally:
                it.close()
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self.error = e

    def result(self) -> List[int]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.crcs


def _check_shares(path: str, plan, copies: _Copies, split, written) -> None:
    """Step 3's checks: within each copy, a share's CRCs from its writer and
    from its checker; across copies, each record's body CRC."""
    for ranks in copies.members:
        m = len(ranks)
        for s in range(m):
            v = (s - 1) % m
            if v != s and written[ranks[v]][1] != written[ranks[s]][0]:
                bad = next(k for k, (a, b) in enumerate(zip(written[ranks[v]][1], written[ranks[s]][0])) if a != b)
                i = split[m][1][s][bad][0]
                raise ValueError(f"cannot save to {path!r}: ranks hold different data: {plan[i][2].name} "
                                 f"of rank {ranks[s]} differs from rank {ranks[v]}'s (CRC-32 of the share rank "
                                 f"{ranks[s]} wrote); nothing was committed")
    if len(copies.members) < 2:
        return
    first = None
    for c, ranks in enumerate(copies.members):
        body = _body_crcs(split[len(ranks)][1], [written[r][0] for r in ranks])
        if first is None:
            first = body
            continue
        for i in sorted(first):
            if body.get(i) != first[i]:
                raise ValueError(f"cannot save to {path!r}: ranks hold different data: {plan[i][2].name} of "
                                 f"node {copies.names[c]!r} (ranks {ranks}) differs from that of node "
                                 f"{copies.names[0]!r} (ranks {copies.members[0]}) (CRC-32 of the copies); "
                                 "nothing was committed")


def _check_commits(g: Group, copies: _Copies, path: str, status: Any, committed: bool) -> None:
    """Step 4b's outcome: every lead's (True | error description) gathered;
    returns when every node renamed, else raises OSError naming the nodes
    that hold the new file (``committed_nodes``)."""
    here = copies.names[copies.mine]
    try:
        results = g.exchange(status, None, "to commit")
    except OSError as e:
        state = "renamed its copy" if committed else "did not rename its copy" if copies.lead else \
            "unknown to this rank"
        raise RanksFailed(errno.EIO, f"cannot save to {path!r}: partial commit: a rank died or did not answer in "
                                     f"time while the nodes renamed their durable copies ({e.__cause__}); each "
                                     f"node's path holds either the new or its previous file (this rank's node "
                                     f"{here!r}: {state})", path, getattr(e, "failures", None)) from e
    done = [copies.names[c] for c, ranks in enumerate(copies.members) if results[ranks[0]] is True]
    failed = [(copies.names[c], ranks[0], results[ranks[0]]) for c, ranks in enumerate(copies.members)
              if results[ranks[0]] is not True]
    if not failed:
        return
    why = "; ".join(f"node {n!r} (rank {r}): {msg}" for n, r, (_code, msg) in failed)
    e = RanksFailed(failed[0][2][0] or errno.EIO,
                    f"cannot save to {path!r}: partial commit: every node's copy was durable, but renaming it "
                    f"failed on {why}; those nodes keep their previous file (unless the rename was done and only "
                    f"the directory fsync failed); nodes {done} hold the new file", path,
                    {r: msg for _n, r, (_code, msg) in failed})
    e.committed_nodes = done
    raise e


def _body_crcs(shares, all_crcs) -> Dict[int, int]:
    """{plan index: CRC-32 of the record's aligned body}, combined from the
    pieces' CRCs (``all_crcs[r]``: those of ``shares[r]``)."""
    pieces: Dict[int, List[Tuple[int, int, int]]] = {}  # plan index -> [(start, len, crc)]
    for r, share in enumerate(shares):
        for (i, start, n, _off), c in zip(share, all_crcs[r]):
            pieces.setdefault(i, []).append((start, n, c))
    out = {}
    for i, ps in pieces.items():
        crc = 0
        for start, n, c in sorted(ps):
            crc = _engine.crc32_combine(crc, c, n) if start else c
        out[i] = crc
    return out


def _write_rest(writer, plan, entries, cd_offset: int, src: "_collective_stage.Storages", bodies: Dict[int, int],
                shares, all_crcs, crc_on: bool) -> None:
    """Rank 0's part: every byte outside the shares, with each record's CRC
    combined from the ranks' piece CRCs. Of the storages it reads only the
    records' bytes after their bodies (small records whole, tails)."""
    body_crcs = _body_crcs(shares, all_crcs) if crc_on else {}
    tails = []  # per storage record in plan order: its head (before the body), then its tail (after it)
    for i, (payload, _h, entry) in enumerate(plan):
        if isinstance(payload, (bytes, bytearray)):
            continue
        head, body = bodies.get(i, (0, 0))
        if head:
            tails.append((_storage_of(plan, i), 0, head, i))
        if entry.size > head + body:
            tails.append((_storage_of(plan, i), head + body, entry.size - head - body, i))
    it = src.ranges(tails)
    try:
        _write_rest_from(writer, plan, entries, cd_offset, it, bodies, body_crcs, crc_on)
    finally:
        it.close()


def _write_rest_from(writer, plan, entries, cd_offset: int, tails, bodies: Dict[int, int], body_crcs: Dict[int, int],
                     crc_on: bool) -> None:
    """_write_rest with the records' tails from `tails` ((range, host views) in plan order)."""
    def pieces_of(i: int):
        head, body = bodies.get(i, (0, 0))
        size = plan[i][2].size

        def piece(n: int) -> bytes:
            if not n:
                return b""
            r, views = next(tails)
            if r[3] != i:
                raise RuntimeError("fastckpt: record heads and tails out of order")
            return b"".join(v.numpy().tobytes() for v in views)
        first = piece(head)
        tail = piece(size - head - body)
        crc = 0
        if crc_on:
            crc = _engine.crc32(first) if first else 0
            if body:
                crc = _engine.crc32_combine(crc, body_crcs.get(i, 0), body)
            if tail:
                crc = _engine.crc32_combine(crc, _engine.crc32(tail), len(tail))
        return [p for p in ((0, first), (head + body, tail)) if p[1]], crc
    write_records(writer, plan, entries, cd_offset, pieces_of, crc_on)


def write_records(writer, plan, entries, cd_offset: int, pieces_of, crc_on: bool) -> None:
    """Rank 0's bytes of an archive whose storage records the ranks write: every local header, the
    small records that are bytes, of each storage record i the pieces ``pieces_of(i)`` returns
    (([(offset in the record, bytes)], the record's CRC-32), called in plan order), the data
    descriptors and the central directory; small writes coalesced into runs."""
    runs = Runs(writer)
    put = runs.put
    for i, (payload, header, entry) in enumerate(plan):
        put(entry.header_offset, header)
        size = entry.size
        if isinstance(payload, (bytes, bytearray)):
            put(entry.data_offset, bytes(payload))
            crc = _engine.crc32(payload) if crc_on and size else 0
        else:
            pieces, crc = pieces_of(i)
            for off, b in pieces:
                put(entry.data_offset + off, b)
        entry.crc = crc if crc_on else 0
        d = _zip.descriptor(entry.crc, size, entry.header_offset)
        if d:
            put(entry.data_offset + size, d)
    put(cd_offset, _zip.central_directory(entries, cd_offset))
    runs.flush()


class Runs:
    """Small writes at offsets of a region writer, coalesced: adjacent pieces go out as one write
    of up to about _RUN_BYTES; call :meth:`flush` at the end."""

    def __init__(self, writer):
        self.writer = writer
        self.run: List[bytes] = []
        self.off = 0
        self.len = 0

    def put(self, off: int, b) -> None:
        if self.run and (off != self.off + self.len or self.len >= _RUN_BYTES):
            self.flush()
        if not self.run:
            self.off = off
        self.run.append(b)
        self.len += len(b)

    def flush(self) -> None:
        if self.run:
            self.writer.write_at(b"".join(self.run), self.off)
            self.run, self.len = [], 0
