"""Scans of pickle bytes (no unpickling): the storage keys a data.pkl names,
whether its unpickling reads storage bytes, device location tags, torch's
legacy format."""

import re
import sys
from typing import Dict, List

import torch


# torch's legacy (non-zip) format starts with this pickled magic number.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


# A string in a pickle: BINUNICODE (X, 4-byte length) or SHORT_BINUNICODE
# (0x8c, 1-byte length). Zero-width matches: every position is tried.
_PICKLED_STR = re.compile(rb"(?=(X[\x00-\xff]{4}|\x8c[\x00-\xff]))")


def pickled_strings(pkl: bytes, lengths: List[int]) -> set:
    """The strings of the byte lengths `lengths` written as BINUNICODE or
    SHORT_BINUNICODE in `pkl` (and any bytes that look like one)."""
    found: set = set()
    if len(lengths) <= 8:  # a few scans in C, no Python work per match (1 ms a MB)
        for n in lengths:
            for head in [b"X" + n.to_bytes(4, "little")] + ([b"\x8c" + bytes([n])] if n < 256 else []):
                found.update(re.findall(re.escape(head) + b"([\\x00-\\xff]{%d})" % n, pkl))
        return found
    longest = max(lengths)
    for m in _PICKLED_STR.finditer(pkl):
        p = m.start()
        if pkl[p] == 0x58:  # X
            n, p = int.from_bytes(pkl[p + 1:p + 5], "little"), p + 5
        else:
            n, p = pkl[p + 1], p + 2
        if n <= longest:
            found.add(pkl[p:p + n])
    return found


def referenced_storages(pkl: bytes, names) -> List[str]:
    """The storage records among `names` ("data/<key>") whose key occurs as a
    string in the pickle `pkl`: every storage data.pkl refers to, as torch.save
    writes a storage's key as a string at its first use (later uses may be memo
    references; protocol 0 cannot be loaded by torch), and at most a few
    others. A record the unpickler asks for that is not in this list (a key
    that a scan missed or that the pickle computes) is read on demand."""
    keys = {n[5:].encode("utf-8"): n for n in names if n.startswith("data/")}
    if not keys:
        return []
    found = pickled_strings(pkl, sorted({len(k) for k in keys}))
    return [n for k, n in keys.items() if k in found]


# Globals (module, name) whose calls during torch's weights-only unpickling
# read no storage bytes: what a state dict of plain tensors, parameters,
# optimizer and scheduler state pickles to (storage types and dtypes are
# matched by name below). A pickle naming any other global is unpickled only
# after its storages have been read.
_DATA_BLIND_GLOBALS = frozenset([
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"), ("torch", "Size"), ("torch", "device"),
    ("__builtin__", "set"), ("__builtin__", "frozenset"), ("builtins", "set"), ("builtins", "frozenset"),
    ("_codecs", "encode"),
])


_PICKLE_GLOBAL = re.compile(rb"c([A-Za-z_][\w.]*)\n([A-Za-z_][\w.]*)\n")


def unpickling_reads_no_data(small: Dict[str, bytes]) -> bool:
    """Whether torch.serialization._load with the weights-only unpickler can
    run on the archive whose small records are `small` before the storages'
    bytes are in (they are read meanwhile): the file's byte order is this
    machine's (else torch byteswaps each storage as it is unpickled), and
    data.pkl is a pickle of protocol 3 or less (torch.save writes 2;
    STACK_GLOBAL exists from 4 on) whose every GLOBAL is data-blind
    (_DATA_BLIND_GLOBALS, torch dtypes, torch storage types). Conservative:
    bytes inside strings that look like a GLOBAL only make it say no. (A
    crafted pickle that hides a global from this scan still meets torch's
    weights-only allowlist; the worst it can do is build a value from bytes
    not yet read, in memory of the right size.) Restoring a storage to a
    location other than the CPU waits for the reads (see load)."""
    if small.get("byteorder") != sys.byteorder.encode():
        return False
    pkl = small.get("data.pkl", b"")
    if len(pkl) < 2 or pkl[0] != 0x80 or pkl[1] > 3:
        return False
    for mod, name in set(_PICKLE_GLOBAL.findall(pkl)):
        m, n = mod.decode(), name.decode()
        if (m, n) in _DATA_BLIND_GLOBALS:
            continue
        if m == "torch" and (n.endswith("Storage") or isinstance(getattr(torch, n, None), torch.dtype)):
            continue
        return False
    return True


# A short string in a pickle (BINUNICODE with a length < 256, or
# SHORT_BINUNICODE) that looks like a device location tag ("cuda", "cuda:1").
_LOCATION_TAG = re.compile(rb"(?:X[\x00-\xff]\x00\x00\x00|\x8c[\x00-\xff])([a-z_]+:[0-9]+|cuda)")


def location_tags(head: bytes) -> set:
    """The strings in pickle bytes `head` that look like device location tags."""
    return {m.group(1).decode("ascii") for m in _LOCATION_TAG.finditer(head)}


def is_legacy(head: bytes) -> bool:
    """torch's pre-1.6 format: a pickle (protocol 2..5, maybe framed) that
    starts with torch's magic number."""
    if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        return False
    rest = head[2:]
    if rest[:1] == b"\x95":  # FRAME + 8-byte length (protocol 4+)
        rest = rest[9:]
    return rest.startswith(LEGACY_MAGIC[2:])

