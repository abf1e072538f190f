"""Replicas: each rank's snapshots copied to ranks on other nodes, over a gloo group reserved for it.

:func:`plan_peers` decides, the same way on every rank, where each rank's
replicas go: nodes are ordered by their key (torchrun's ``GROUP_RANK``, else
the host name), and rank r (local index i on node n) sends to local index i
of nodes n+1 .. n+replicas (wrapping; at most the other nodes). A one-node
job has no peer: no replica.

:func:`exchange` runs in every rank's background thread after a snapshot is
committed, every rank in the same order of snapshots: a header to each peer
(step, length, CRC-32, whether this rank has a snapshot to give), then the
commit record and the archive, received straight into a slot of the
receiver's ``replica<r>`` directory (space reserved first). The receiver
checks the CRC-32 of what arrived before it writes the replica's commit
record: a replica that fails it is dropped, with a warning, and never used.
Last, each receiver tells each sender whether it committed the replica: a
sender's round ends only once its replicas are committed on every peer (or
known dropped), so a round that ended is a replica a lost node can restore.
:func:`send_slot` / :func:`recv_slot` move one snapshot the same way for a
restore (a replaced node's ranks fetching theirs from the peer that holds it).
"""

import json
import logging
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._core import engine as _engine
from ..errors import FormatError
from .slots import Record, SlotDir, _check_record

log = logging.getLogger("fastckpt")

__all__ = ["Peers", "node_key", "plan_peers", "exchange", "send_slot", "recv_slot"]

_HEADER, _RECORD, _DATA, _ACK = 71, 72, 73, 74   # message tags


class Peers(NamedTuple):
    """Where this rank's replicas go (`sends`) and whose it keeps (`receives`): ranks of the manager's group."""
    sends: Tuple[int, ...] = ()
    receives: Tuple[int, ...] = ()


def node_key() -> str:
    """This process's node: torchrun's GROUP_RANK (the node rank), else the host name."""
    g = os.environ.get("GROUP_RANK")
    if g is not None and g.strip().isdigit():
        return f"node{int(g):08d}"
    import socket
    return f"host:{socket.gethostname()}"


def plan_peers(keys: Sequence[str], rank: int, replicas: int) -> Peers:
    """Peers of `rank` given every rank's node key (see the module's docstring)."""
    nodes = sorted(set(keys))
    members: Dict[str, List[int]] = {n: [r for r, k in enumerate(keys) if k == n] for n in nodes}

    def sends_of(r: int) -> List[int]:
        n = nodes.index(keys[r])
        i = members[keys[r]].index(r)
        out = []
        for j in range(1, min(replicas, len(nodes) - 1) + 1):
            m = members[nodes[(n + j) % len(nodes)]]
            out.append(m[i % len(m)])
        return out

    return Peers(tuple(sends_of(rank)), tuple(r for r in range(len(keys)) if rank in sends_of(r)))


def _wait(works) -> None:
    for w in works:
        w.wait()


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _receive_into(d: SlotDir, step: int, nbytes: int) -> Tuple[int, torch.Tensor]:
    """A replica slot of `d` for `step` (nothing of `d` is busy: one thread receives into it), mapped."""
    k = d.take_for(step)
    return k, d.mapping(k, nbytes)


def _accept(d: SlotDir, k: int, buf: torch.Tensor, raw: bytes, crc: int, origin: int, what: str) -> Optional[Record]:
    """Check what arrived in slot k of `d`; commit it, or drop it with a warning."""
    try:
        rec = _check_record(json.loads(bytes(raw)), what)
        got = _engine.crc32(buf) if buf.numel() else 0
        if got != crc or rec["crc"] != crc or rec["nbytes"] != buf.numel() or rec["rank"] != origin:
            raise FormatError(f"{what}: CRC-32 mismatch or wrong record (expected {crc:#010x}, got {got:#010x})")
    except (ValueError, KeyError) as e:
        d.remove(k)
        log.warning("fastckpt.MemoryTier: dropped a replica of rank %d that failed its check: %s", origin, e)
        return None
    rec["slot"] = k
    d.write_record(rec)
    return Record(rec)


def exchange(tier: Any, rec: Optional[Record]) -> None:
    """This rank's part of one replication round (see the module's docstring); `rec`
    None: this rank's snapshot failed (its peers learn it and keep what they had)."""
    g = tier.group
    mine = json.dumps(rec).encode() if rec is not None else b""
    hdr = torch.tensor([rec.step if rec else -1, rec["nbytes"] if rec else 0, rec["crc"] if rec else 0,
                        1 if rec else 0, len(mine)], dtype=torch.int64)
    heads = {s: torch.zeros(5, dtype=torch.int64) for s in tier.peers.receives}
    works = [torch.distributed.isend(hdr, group=g, group_dst=p, tag=_HEADER) for p in tier.peers.sends]
    works += [torch.distributed.irecv(heads[s], group=g, group_src=s, tag=_HEADER) for s in tier.peers.receives]
    _wait(works)
    works, incoming = [], []
    if rec is not None:
        data = tier.own.view(rec["slot"], rec["nbytes"])
        for p in tier.peers.sends:
            works.append(torch.distributed.isend(_u8(mine), group=g, group_dst=p, tag=_RECORD))
            if rec["nbytes"]:
                works.append(torch.distributed.isend(data, group=g, group_dst=p, tag=_DATA))
    for s, h in heads.items():
        step, nbytes, crc, ok, rlen = h.tolist()
        if not ok:
            continue
        d = tier.replica_dirs[s]
        k, buf = _receive_into(d, step, nbytes)
        raw = torch.empty(rlen, dtype=torch.uint8)
        works.append(torch.distributed.irecv(raw, group=g, group_src=s, tag=_RECORD))
        if nbytes:
            works.append(torch.distributed.irecv(buf, group=g, group_src=s, tag=_DATA))
        incoming.append((s, d, k, buf, raw, crc))
    _wait(works)
    works = []
    for s, d, k, buf, raw, crc in incoming:
        kept = _accept(d, k, buf, raw.numpy().tobytes(), crc, s, f"{d.archive(k)} (replica of rank {s})")
        ack = torch.tensor([kept.step if kept is not None else -1, 1 if kept is not None else 0], dtype=torch.int64)
        works.append(torch.distributed.isend(ack, group=g, group_dst=s, tag=_ACK))
    acks = {p: torch.zeros(2, dtype=torch.int64) for p in (tier.peers.sends if rec is not None else ())}
    works += [torch.distributed.irecv(a, group=g, group_src=p, tag=_ACK) for p, a in acks.items()]
    _wait(works)
    for p, a in acks.items():
        if a[1].item() != 1:
            log.warning("fastckpt.MemoryTier: rank %d dropped the replica of step %d of rank %d (see its log)",
                        p, rec.step, tier.rank)


def send_slot(group: Any, dst: int, slots: SlotDir, rec: Optional[Record]) -> None:
    """Send one complete snapshot (its record, then its archive) to rank `dst`;
    `rec` None (the sender found it damaged): only a header saying so (see :func:`recv_slot`)."""
    raw = json.dumps(rec).encode() if rec is not None else b""
    hdr = torch.tensor([rec.step, rec["nbytes"], rec["crc"], 1, len(raw)] if rec is not None else [-1, 0, 0, 0, 0],
                       dtype=torch.int64)
    torch.distributed.send(hdr, group=group, group_dst=dst, tag=_HEADER)
    if rec is None:
        return
    torch.distributed.send(_u8(raw), group=group, group_dst=dst, tag=_RECORD)
    if rec["nbytes"]:
        torch.distributed.send(slots.map(rec["slot"], rec["nbytes"]), group=group, group_dst=dst, tag=_DATA)


def recv_slot(group: Any, src: int, slots: SlotDir, origin: int) -> Optional[Record]:
    """Receive the snapshot :func:`send_slot` sends into a slot of `slots`; its record
    (committed) once its CRC-32 checks, else None (dropped, with a warning)."""
    hdr = torch.zeros(5, dtype=torch.int64)
    torch.distributed.recv(hdr, group=group, group_src=src, tag=_HEADER)
    step, nbytes, crc, ok, rlen = hdr.tolist()
    if not ok:
        return None
    raw = torch.empty(rlen, dtype=torch.uint8)
    torch.distributed.recv(raw, group=group, group_src=src, tag=_RECORD)
    k, buf = _receive_into(slots, step, nbytes)
    if nbytes:
        torch.distributed.recv(buf, group=group, group_src=src, tag=_DATA)
    return _accept(slots, k, buf, raw.numpy().tobytes(), crc, origin, f"{slots.archive(k)} (from rank {src})")
