"""``fastckpt inspect`` and ``fastckpt verify``: what a checkpoint holds, and whether it is intact.

:func:`inspect` reads no tensor data: the zip directory and ``data.pkl`` of a
file (unpickled by the weights-only unpickler onto the meta device), the header
of a safetensors file, ``.metadata`` of a DCP directory.

:func:`verify` reads everything a load would read and checks it: every zip
record against its CRC-32 and the pickle against the records; every tensor of
a DCP checkpoint through :class:`fastckpt.dcp.FastReader` (CRC-checked),
every file and byte range named in ``.metadata``; the header and the byte
ranges of a safetensors file (which records no checksums). It reports every
problem it finds, not just the first.
"""

import json
import logging
import math
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..formats import zip as _zip
from ..formats.safetensors import dtype_name
from ..sources.source import LazyValue, Source, holds_structure, storage_of, walk
from ..sources import DcpSource, SafetensorsSource, ShardedSafetensorsSource, ZipSource, is_dcp_dir, open_source, \
    sniff
from ..formats.torch_rules import itemsize
from .._core.steps import split_step_name
from .._core.tempnames import is_temp
from .._core.units import human
from ..errors import FormatError

log = logging.getLogger("fastckpt")

Progress = Optional[Callable[[int], None]]


# ---------------------------------------------------------------- inspect

def _value_summary(v: Any, limit: int = 60) -> str:
    if isinstance(v, LazyValue):
        return f"(stored object, {human(v.nbytes)}, not read)"
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _jsonable(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, str)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if type(v) in (list, tuple):
        return len(v) <= 64 and all(_jsonable(x) for x in v)
    return False


def _device(t: torch.Tensor) -> Optional[str]:
    return storage_of(t).location if t.device.type == "meta" else str(t.device)


@dataclass
class Entry:
    path: Tuple
    display: str           # key as shown in the tree
    depth: int
    kind: str              # tensor | dict | list | tuple | value
    obj: Any


def _entries(tree: Any) -> List[Entry]:
    out: List[Entry] = []

    def rec(o: Any, path: Tuple, display: str, depth: int) -> None:
        if isinstance(o, torch.Tensor):
            out.append(Entry(path, display, depth, "tensor", o))
        elif isinstance(o, dict):
            out.append(Entry(path, display, depth, "dict", o))
            for k, v in o.items():
                rec(v, path + (k,), k if isinstance(k, str) else repr(k), depth + 1)
        elif type(o) in (list, tuple) and holds_structure(o):
            out.append(Entry(path, display, depth, type(o).__name__, o))
            for i, v in enumerate(o):
                rec(v, path + (i,), f"[{i}]", depth + 1)
        else:
            out.append(Entry(path, display, depth, "value", o))

    if isinstance(tree, dict):
        for k, v in tree.items():
            rec(v, (k,), k if isinstance(k, str) else repr(k), 0)
    else:
        rec(tree, (), "<root>", 0)
    return out


def _dotted(path: Tuple) -> str:
    return ".".join(str(k) for k in path) if path else "<root>"


def inspect_data(source: Source) -> Dict[str, Any]:
    """The machine-readable report of `source` (what ``inspect --json`` prints)."""
    tree = source.tree(values=False)
    entries = _entries(tree)
    users: Dict[int, int] = {}
    for e in entries:
        if e.kind == "tensor":
            s = storage_of(e.obj)
            users[id(s)] = users.get(id(s), 0) + 1
    rows: List[Dict[str, Any]] = []
    totals: Dict[str, Any] = {"tensors": 0, "tensor_bytes": 0, "storages": 0, "storage_bytes": 0,
                              "values": 0, "by_dtype": {}, "by_device": {}}
    storages_seen = set()
    for e in entries:
        row: Dict[str, Any] = {"key": _dotted(e.path), "name": e.display, "depth": e.depth,
                               "path": [k if isinstance(k, (str, int)) else repr(k) for k in e.path], "type": e.kind}
        if e.kind == "tensor":
            t = e.obj
            s = storage_of(t)
            n = t.numel() * t.element_size()
            dev = _device(t)
            row.update({"dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": n, "device": dev,
                        "storage": s.key, "storage_offset": t.storage_offset(), "stride": list(t.stride()),
                        "requires_grad": bool(t.requires_grad)})
            if isinstance(t, torch.nn.Parameter):
                row["parameter"] = True
            if users[id(s)] > 1:
                row["shared"] = users[id(s)]
            if isinstance(source, DcpSource):
                row["chunks"] = len(source.items[s.key].chunks)
            totals["tensors"] += 1
            totals["tensor_bytes"] += n
            d = totals["by_dtype"].setdefault(row["dtype"], {"tensors": 0, "bytes": 0})
            d["tensors"] += 1
            d["bytes"] += n
            dv = totals["by_device"].setdefault(dev or "unrecorded", {"tensors": 0, "bytes": 0})
            dv["tensors"] += 1
            dv["bytes"] += n
            if id(s) not in storages_seen:
                storages_seen.add(id(s))
                totals["storages"] += 1
                totals["storage_bytes"] += s.nbytes
        elif e.kind == "value":
            v = e.obj
            totals["values"] += 1
            row["type"] = "object" if isinstance(v, LazyValue) else type(v).__name__
            if isinstance(v, LazyValue):
                row["nbytes"] = v.nbytes
            elif _jsonable(v):
                row["value"] = list(v) if isinstance(v, tuple) else v
            else:
                row["repr"] = _value_summary(v, 200)
        else:
            row["length"] = len(e.obj)
        rows.append(row)
    report: Dict[str, Any] = {"path": source.path, "format": source.kind, "description": source.description(),
                              "entries": rows, "totals": totals}
    if os.path.isfile(source.path):
        report["file_size"] = os.path.getsize(source.path)
    if isinstance(source, ZipSource):
        unused = [n for n in source.storages if n not in source._used]
        report["archive"] = {"alignment": source.alignment, "large_alignment": source.large_alignment,
                             "large_min": _zip.DIRECT_MIN if source.kind == "fastckpt" else None,
                             "records": len(source.archive.records),
                             "top_folder": source.archive.prefix, "byteorder": source.byteorder,
                             "unreferenced_records": unused}
    elif isinstance(source, SafetensorsSource):
        report["safetensors"] = {"header_bytes": source.header_size, "metadata": source.metadata,
                                 "problems": source.problems}
    elif isinstance(source, DcpSource):
        files = {}
        for rel, fqns in source.data_files().items():
            p = os.path.join(source.path, rel) if isinstance(rel, str) else None
            files[str(rel)] = {"items": len(fqns),
                               "size": os.path.getsize(p) if p and os.path.isfile(p) else None}
        report["dcp"] = {"version": getattr(source.md, "version", None), "files": files,
                         "total_size": sum(f["size"] or 0 for f in files.values())}
    return report


def inspect_text(report: Dict[str, Any]) -> str:
    lines = []
    size = report.get("file_size", report.get("dcp", {}).get("total_size"))
    lines.append(f"{report['path']}: {report['description']}, {human(size)}")
    rows = report["entries"]
    keyw = min(max([2 * r["depth"] + len(r["name"]) for r in rows] + [3]), 60)
    dtw = max([len(r.get("dtype", "" if "length" in r else r["type"])) for r in rows] + [5])
    shw = max([len(str(r.get("shape", ""))) for r in rows] + [5])
    lines.append(f"{'KEY':<{keyw}}  {'DTYPE':<{dtw}}  {'SHAPE':<{shw}}  {'SIZE':>10}  DEVICE")
    for r in rows:
        key = "  " * r["depth"] + r["name"]
        if len(key) > keyw:
            key = key[:keyw - 3] + "..."
        if r["type"] == "tensor":
            note = []
            if r.get("shared"):
                note.append(f"storage shared by {r['shared']} tensors")
            if r.get("chunks", 1) > 1:
                note.append(f"{r['chunks']} chunks")
            if r.get("parameter"):
                note.append("Parameter")
            lines.append(f"{key:<{keyw}}  {r['dtype']:<{dtw}}  {str(r['shape']):<{shw}}  {human(r['nbytes']):>10}  "
                         f"{r['device'] or '-'}" + (f"  ({', '.join(note)})" if note else ""))
        elif "length" in r:
            n = r["length"]
            lines.append(f"{key:<{keyw}}  {r['type']}, {n} item{'s' if n != 1 else ''}")
        else:
            if "value" in r:
                val = json.dumps(r["value"]) if isinstance(r["value"], str) else repr(
                    tuple(r["value"]) if r["type"] == "tuple" else r["value"])
                val = val if len(val) <= 60 else val[:57] + "..."
            elif "repr" in r:
                val = r["repr"] if len(r["repr"]) <= 60 else r["repr"][:57] + "..."
            else:
                val = f"(stored object, {human(r.get('nbytes'))}, not read)"
            lines.append(f"{key:<{keyw}}  {r['type']:<{dtw}}  {val}")
    t = report["totals"]
    lines.append("")
    lines.append(f"{t['tensors']} tensor{'s' if t['tensors'] != 1 else ''}, {human(t['tensor_bytes'])} "
                 f"({t['storages']} storage{'s' if t['storages'] != 1 else ''}, {human(t['storage_bytes'])}); "
                 f"{t['values']} other value{'s' if t['values'] != 1 else ''}")
    for name, d in sorted(t["by_dtype"].items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(f"  {name:<{dtw}}  {d['tensors']:>6} tensor{'s' if d['tensors'] != 1 else ' '}  "
                     f"{human(d['bytes']):>10}")
    if t["by_device"]:
        lines.append("devices: " + ", ".join(f"{k} ({v['tensors']})" for k, v in sorted(t["by_device"].items())))
    for p in report.get("safetensors", {}).get("problems", []):
        lines.append(f"warning: {p}")
    unused = report.get("archive", {}).get("unreferenced_records")
    if unused:
        lines.append(f"note: {len(unused)} storage record(s) that data.pkl does not use: {', '.join(unused[:5])}")
    return "\n".join(lines)


# ---------------------------------------------------------------- verify

@dataclass
class Report:
    path: str
    format: str = "?"
    description: str = ""
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    checked: List[str] = field(default_factory=list)
    unverified: List[str] = field(default_factory=list)   # data that no checksum covers
    children: List["Report"] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.children)

    def as_dict(self) -> Dict[str, Any]:
        return {"path": self.path, "format": self.format, "ok": self.ok, "problems": self.problems,
                "checked": self.checked, "unverified": self.unverified, "notes": self.notes,
                **({"checkpoints": [c.as_dict() for c in self.children]} if self.children else {})}


def error_text(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        msg = e.strerror
        if e.filename is not None and str(e.filename) not in msg:
            msg = f"{e.filename}: {msg}"
        return msg
    return str(e) if isinstance(e, (FormatError, OSError, pickle.UnpicklingError)) else f"{type(e).__name__}: {e}"


def verify(path: str, progress_factory=None) -> Report:
    """Check the checkpoint at `path` (a file, DCP directory or CheckpointManager directory)."""
    if os.path.isdir(path) and not is_dcp_dir(path) and is_manager_dir(path):
        return _verify_manager(path, progress_factory)
    rep = Report(path)
    if os.path.isfile(path):
        try:
            rep.format = {"zip": "zip archive (torch.save / fastckpt)", "torch-legacy": "torch-legacy",
                          "safetensors": "safetensors", "unknown": "unknown format"}[sniff(path)]
        except OSError:
            pass
    elif os.path.isdir(path):
        rep.format = "dcp"
    try:
        src = open_source(path)
    except (FormatError, OSError, pickle.UnpicklingError) as e:
        rep.problems.append(error_text(e))
        return rep
    with src:
        rep.format, rep.description = src.kind, src.description()
        try:
            if isinstance(src, ZipSource):
                _verify_zip(src, rep, progress_factory)
            elif isinstance(src, SafetensorsSource):
                _verify_safetensors(src, rep, progress_factory)
            elif isinstance(src, ShardedSafetensorsSource):
                rep.checked.append(f"index {src.index_path}: {len(src.weight_map)} tensors in {len(src.shards)} "
                                   "shards, each held by the shard it names")
                for shard in src.shards.values():
                    _verify_safetensors(shard, rep, progress_factory)
                rep.unverified[:] = list(dict.fromkeys(rep.unverified))
            elif isinstance(src, DcpSource):
                _verify_dcp(src, rep, progress_factory)
            else:
                src.tree()
                rep.checked.append("loaded whole with weights_only=True")
                rep.unverified.append(f"{src.description()}: the format records no checksums")
        except (FormatError, OSError, pickle.UnpicklingError) as e:
            rep.problems.append(error_text(e))
    return rep


def _progress(progress_factory, total: int, desc: str):
    return progress_factory(total, desc) if progress_factory else None


def _verify_zip(src: ZipSource, rep: Report, progress_factory) -> None:
    recs = src.archive.records
    rep.checked.append(f"zip structure: {len(recs)} records, central directory and local headers")
    for n in src.bad_small:
        rep.problems.append(f"{src.path}: checksum mismatch in record {n!r} (corrupt data)")
    if not src.bad_small:
        rep.checked.append(f"{len(src.small)} metadata records (data.pkl, ...) match their CRC-32")
    # which tensors live in which record, from the pickle (no data read)
    users: Dict[str, List[str]] = {}
    pickle_ok = False
    if "data.pkl" not in src.bad_small:
        try:
            tree = src.tree(values=False)
            pickle_ok = True
            for p, t, kind in walk(tree):
                if kind == "tensor":
                    users.setdefault(storage_of(t).key, []).append(".".join(str(k) for k in p) or "<root>")
            rep.checked.append(f"data.pkl: {sum(len(v) for v in users.values())} tensors in {len(users)} "
                               "storage records, every view inside its record")
        except pickle.UnpicklingError as e:
            rep.notes.append(f"{e} (the records' checksums are still checked)")
        except (FormatError, OSError) as e:
            rep.problems.append(error_text(e))
    if pickle_ok:
        unused = [n for n in src.storages if n not in users]
        if unused:
            rep.notes.append(f"{len(unused)} storage record(s) not used by data.pkl: {', '.join(unused[:5])}")
    storages = list(src.storages.values())
    with_crc = [s for s in storages if s.crc]
    if storages and not with_crc and any(s.nbytes for s in storages):
        rep.unverified.append(f"{src.path}: the file records no checksums (saved with torch's compute_crc32 "
                              "disabled): the data could not be checked")
        return
    total = sum(s.nbytes for s in with_crc)
    bar = _progress(progress_factory, total, "verify")
    bad = 0
    problems_before = len(rep.problems)
    try:
        checked = []
        for s in storages:
            if s.nbytes == 0:
                continue
            if not s.crc:
                rep.unverified.append(f"record {s.key!r}: no checksum recorded")
                continue
            checked.append(s)
        # small records many per read, large ones streamed; CRC-32s computed by the engine's reads
        for s, e in src.check_crcs(checked, bar):
            if e is None:
                continue
            if isinstance(e, FormatError) and "checksum mismatch" in str(e):
                bad += 1
                who = users.get(s.key)
                what = f" (tensor{'s' if who and len(who) > 1 else ''} {', '.join(who[:5])})" if who else ""
                rep.problems.append(f"{src.path}: checksum mismatch in record {s.key!r}{what}: the data is corrupt")
            else:
                rep.problems.append(f"record {s.key!r}: {error_text(e)}")
    finally:
        if bar:
            bar(None)
    if not bad and len(rep.problems) == problems_before:
        empty = sum(1 for s in storages if s.nbytes == 0)
        rep.checked.append(f"{len(with_crc)} storage records ({human(total)}) match their CRC-32"
                           + (f" ({empty} empty record{'s hold' if empty != 1 else ' holds'} nothing to check)"
                              if empty else ""))


def _verify_safetensors(src: SafetensorsSource, rep: Report, progress_factory) -> None:
    rep.checked.append(f"header: {len(src.entries)} tensors, dtypes, shapes and byte ranges consistent")
    rep.problems += src.problems
    total = sum(e.end - e.begin for e in src.entries)
    bar = _progress(progress_factory, total, "verify")
    try:
        for e in src.entries:
            s = src.storages[e.name]
            try:
                src.stream(s, 0, s.nbytes, lambda piece: bar(piece.numel()) if bar else None)
            except (FormatError, OSError) as ex:
                rep.problems.append(f"tensor {e.name!r}: {error_text(ex)}")
    finally:
        if bar:
            bar(None)
    rep.checked.append(f"all {human(total)} of tensor data readable")
    if src.metadata.get("fastckpt.layout"):
        try:
            src.tree(values=False)
        except Exception as ex:  # noqa: BLE001 - reported, not raised
            rep.problems.append(f"{src.path}: fastckpt.layout metadata: {ex}")
    rep.unverified.append("safetensors records no checksums: the bytes could be read, not checked")


def _verify_dcp(src: DcpSource, rep: Report, progress_factory) -> None:
    root = src.path
    rep.checked.append(f".metadata: {len(src.items)} items, {len(src.md.storage_data)} storage entries")
    reader = src.fast_reader()
    bad_files = set()
    for rel, fqns in sorted(src.data_files().items(), key=lambda kv: str(kv[0])):
        try:
            full, size = reader._resolve(rel)
        except (FormatError, OSError) as e:
            shown = ", ".join(sorted(set(fqns))[:5]) + (", ..." if len(set(fqns)) > 5 else "")
            rep.problems.append(f"{error_text(e)} (holds {len(set(fqns))} item(s): {shown})")
            bad_files.add(rel)
            continue
        for index, info in src.md.storage_data.items():
            if getattr(info, "relative_path", None) != rel:
                continue
            off, ln = getattr(info, "offset", None), getattr(info, "length", None)
            if not (isinstance(off, int) and isinstance(ln, int) and off >= 0 and ln >= 0) or off + ln > size:
                rep.problems.append(f"{full}: {getattr(index, 'fqn', index)} lies at bytes {off}..{off + ln if isinstance(off, int) and isinstance(ln, int) else '?'} "
                                    f"according to .metadata, but the file has {size} bytes (truncated data file)")
                bad_files.add(rel)
    by_fqn_files = {fqn: {getattr(i, "relative_path", None) for _, i in src.by_fqn.get(fqn, [])}
                    for fqn in src.items}
    total = 0
    for fqn in src.items:
        if src.is_tensor(fqn):
            m = src.items[fqn]
            n = 1
            for s in m.size:
                n *= s
            total += n * itemsize(m.properties.dtype)
    bar = _progress(progress_factory, total, "verify")
    checked_t = checked_v = 0
    try:
        for fqn in src.items:
            if not src.by_fqn.get(fqn):
                rep.problems.append(f"{root}/.metadata: {fqn} has no storage entry")
                continue
            if by_fqn_files[fqn] & bad_files:
                continue  # already reported with its file
            try:
                if src.is_tensor(fqn):
                    t = src.load_tensor(fqn)
                    checked_t += 1
                    if bar:
                        bar(t.numel() * t.element_size())
                    del t
                else:
                    try:
                        src.load_value(fqn)
                    except pickle.UnpicklingError as e:
                        rep.notes.append(str(e))
                    checked_v += 1
            except (FormatError, OSError) as e:
                rep.problems.append(f"{fqn}: {error_text(e)}")
            except Exception as e:  # noqa: BLE001 - a damaged record can fail in torch.load in many ways
                rep.problems.append(f"{fqn}: {type(e).__name__}: {e}")
    finally:
        if bar:
            bar(None)
    rep.checked.append(f"{checked_t} tensors ({human(total)}) and {checked_v} values read through FastReader, "
                       "every whole record checked against its CRC-32")


# ---------------------------------------------------------------- CheckpointManager directories

def is_manager_dir(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return "latest" in names or any(split_step_name(n) for n in names)


def _verify_manager(path: str, progress_factory) -> Report:
    rep = Report(path, format="manager", description="CheckpointManager directory")
    names = sorted(os.listdir(path))
    steps = []
    for n in names:
        parsed = split_step_name(n)
        if parsed is None:
            continue
        p = os.path.join(path, n)
        if parsed[1] and os.path.isfile(p):
            steps.append(n)
        elif not parsed[1] and os.path.isdir(p):
            if os.path.isfile(os.path.join(p, ".metadata")):
                steps.append(n)
            else:
                rep.notes.append(f"{n}: no .metadata (an unfinished sharded save); not a checkpoint")
    temps = [n for n in names if is_temp(n)]
    if temps:
        rep.notes.append(f"{len(temps)} leftover temporary file(s) of interrupted saves: {', '.join(temps[:3])}")
    latest_path = os.path.join(path, "latest")
    latest = None
    if os.path.exists(latest_path):
        try:
            with open(latest_path) as f:
                latest = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            rep.problems.append(f"{latest_path}: unreadable: {e}")
        if latest is not None:
            if split_step_name(latest) is None:
                rep.problems.append(f"{latest_path} holds {latest[:80]!r}, which is not a checkpoint name")
            elif latest not in steps:
                rep.problems.append(f"{latest_path} names {latest}, which is missing or incomplete")
            else:
                rep.checked.append(f"latest names {latest}")
    elif steps:
        rep.notes.append("no latest pointer (CheckpointManager.load_latest would try the newest checkpoint)")
    if not steps:
        rep.problems.append(f"{path}: no complete checkpoint (step_<N>.pt or step_<N>/ with .metadata)")
    for n in steps:
        child = verify(os.path.join(path, n), progress_factory)
        if n == latest:
            child.notes.insert(0, "named by latest")
        rep.children.append(child)
    return rep


def verify_text(rep: Report, strict: bool = False) -> str:
    lines: List[str] = []

    def one(r: Report, indent: str) -> None:
        status = "OK" if r.ok and not (strict and r.unverified) else "FAILED"
        lines.append(f"{indent}{r.path}: {r.description or r.format}")
        for c in r.checked:
            lines.append(f"{indent}  ok: {c}")
        for u in r.unverified:
            lines.append(f"{indent}  not checked: {u}")
        for n in r.notes:
            lines.append(f"{indent}  note: {n}")
        for p in r.problems:
            lines.append(f"{indent}  PROBLEM: {p}")
        for c in r.children:
            one(c, indent + "  ")
        if indent:
            lines.append(f"{indent}  {status}")

    one(rep, "")
    n = count_problems(rep)
    lines.append("OK" if n == 0 and not (strict and has_unverified(rep)) else
                 f"FAILED: {n} problem{'s' if n != 1 else ''}" if n else "FAILED (--strict): data without checksums")
    return "\n".join(lines)


def count_problems(rep: Report) -> int:
    return len(rep.problems) + sum(count_problems(c) for c in rep.children)


def has_unverified(rep: Report) -> bool:
    return bool(rep.unverified) or any(has_unverified(c) for c in rep.children)
