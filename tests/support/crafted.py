"""Hostile torch.save archives built byte by byte, and a memory probe that
loads a file in a separate process and reports the peak RSS growth of that one
load (tests/python/formats/test_zip_bounds.py, torchsave/test_fuzz_load.py).

The archives follow PyTorch's layout (docs/FORMAT.md 1.1-1.4) unless a case
breaks it on purpose: records whose data overlap (several central directory
entries over one blob), a central directory out of file order, declared sizes
and counts far beyond the file, pickles nested deeply or with huge memo indices.
"""
import collections
import ctypes
import io
import json
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import traceback
import zlib
from typing import List, Optional, Sequence, Tuple

import torch

import fastckpt
from fastckpt.formats import zip as _zip

# What a damaged or hostile file may raise from fastckpt.load: FormatError, an
# OSError, or the weights-only unpickler's refusal.
ALLOWED = (fastckpt.FormatError, OSError, pickle.UnpicklingError)

# A storage's location tag damaged into another device's name ("cpu" -> "hpu")
# is a file saved on a device this machine lacks: fastckpt.load raises what
# torch.load raises for such a file (a RuntimeError naming the device), not a
# FormatError, to stay torch-compatible. Only these messages are allowed.
DEVICE_UNAVAILABLE = re.compile(r"device module is not registered|don't know how to restore data location|"
                                r"torch\.\w+\.is_available\(\) is False|Invalid device|device type",
                                re.IGNORECASE)


def load_cleanly(path, verify: bool, as_file: bool = False) -> None:
    """fastckpt.load(path): returns, or raises an allowed error (swallowed
    here); anything else propagates. as_file: load the file opened instead,
    which fastckpt checks for its layout and then leaves to torch.load, whose
    own errors for a damaged file (EOFError, RuntimeError, ...) are allowed too:
    there only the memory bound and the absence of a crash are checked."""
    if as_file:
        with open(path, "rb") as f:
            try:
                fastckpt.load(f)
            except Exception:
                pass
        return
    try:
        fastckpt.load(path, verify=verify)
    except ALLOWED:
        pass
    except RuntimeError as e:
        if not DEVICE_UNAVAILABLE.search(str(e)):
            raise


# ---------------------------------------------------------------- pickles

class _StorageRef:
    def __init__(self, key: str, nbytes: int):
        self.key, self.nbytes = key, nbytes


class _TensorRef:
    """Pickles as torch.save pickles a 1-D uint8 tensor over storage `key`."""

    def __init__(self, key: str, nbytes: int):
        self.storage = _StorageRef(key, nbytes)

    def __reduce_ex__(self, protocol):
        n = self.storage.nbytes
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, (n,), (1,), False, collections.OrderedDict()))


def tensor_pickle(storages: Sequence[Tuple[str, int]], protocol: int = 2) -> bytes:
    """data.pkl of {"t<key>": uint8 tensor of `nbytes` over storage `key`} for
    each (key, nbytes), as torch.save writes it: the tensors need no memory."""

    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _StorageRef):
                return ("storage", torch.ByteStorage, o.key, "cpu", o.nbytes)
            return None

    buf = io.BytesIO()
    P(buf, protocol=protocol).dump({f"t{k}": _TensorRef(k, n) for k, n in storages})
    return buf.getvalue()


def nested_pickle(depth: int) -> bytes:
    """A list nested `depth` deep (protocol 2): ] ] ] ... a a a ."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def memo_pickle(index: int) -> bytes:
    """An empty list stored at memo index `index` (LONG_BINPUT) and fetched back (LONG_BINGET)."""
    return b"\x80\x02]r" + struct.pack("<I", index) + b"j" + struct.pack("<I", index) + b"."


def wrap_pickle(outer: bytes, inner: bytes) -> bytes:
    """`inner` (a protocol-2 pickle) placed at the bottom of `outer`, a nested
    list pickle from nested_pickle: [[[... inner ...]]]."""
    depth = outer.count(b"]")
    return b"\x80\x02" + b"]" * depth + inner[2:-1] + b"a" * depth + b"."


# ---------------------------------------------------------------- archives

def _header(name: bytes, extra_len: int) -> bytes:
    """A local header as PyTorch writes it (bit 3: sizes in the descriptor),
    declaring an extra field of `extra_len` bytes that the caller writes (or not)."""
    return struct.pack("<IHHHHHIIIHH", _zip.LOCAL_SIG, 20, _zip.FLAGS, 0, 0, 0x21, 0, 0, 0,
                       len(name), extra_len) + name


def _aligned_header(name: bytes, offset: int, align: int = 64) -> bytes:
    pad = (-(offset + 30 + len(name) + 4)) % align
    return _header(name, 4 + pad) + struct.pack("<HH", _zip.PAD_TAG, pad) + b"Z" * pad


class Builder:
    """A zip archive put together piece by piece: the caller decides where each
    central directory entry points."""

    def __init__(self, top: str = "archive"):
        self.top = top
        self.out = bytearray()
        self.entries: List[_zip.Entry] = []

    def name(self, rest: str) -> bytes:
        return f"{self.top}/{rest}".encode()

    def record(self, rest: str, data: bytes, align: int = 64) -> _zip.Entry:
        """A well-formed record at the end of what is written so far."""
        name = self.name(rest)
        off = len(self.out)
        self.out += _aligned_header(name, off, align)
        e = _zip.Entry(name.decode(), len(data), zlib.crc32(data), off, len(self.out))
        self.out += data
        self.out += _zip.descriptor(e.crc, len(data), off)
        self.entries.append(e)
        return e

    def standard(self, pkl: bytes, storages: Sequence[bytes] = ()) -> None:
        self.record("data.pkl", pkl)
        self.record(".format_version", b"1")
        self.record(".storage_alignment", b"64")
        self.record("byteorder", sys.byteorder.encode())
        for i, s in enumerate(storages):
            self.record(f"data/{i}", s)

    def tail(self) -> None:
        self.record("version", b"3\n")
        self.record(".data/serialization_id", b"0" * 40)

    def finish(self, entries: Optional[List[_zip.Entry]] = None) -> bytes:
        cd = _zip.central_directory(self.entries if entries is None else entries, len(self.out))
        return bytes(self.out + cd)


def stock_archive(storages: Sequence[bytes]) -> bytes:
    """A well-formed archive of uint8 tensors t0, t1, ... (the control case)."""
    b = Builder()
    b.standard(tensor_pickle([(str(i), len(s)) for i, s in enumerate(storages)]), storages)
    b.tail()
    return b.finish()


def overlapping_archive(n: int, blob_size: int, local_extra: bool = True) -> bytes:
    """`n` storage records, all referenced by data.pkl, whose data is the same
    `blob_size`-byte blob (valid CRCs: a reader that allocates each record
    reads n * blob_size bytes from a file of about blob_size bytes).

    local_extra: each record has its own local header, whose declared extra
    field reaches over the headers after it up to the blob, so that every
    record's data is exactly the blob (valid CRCs). Else each record's data
    starts right after its header and runs over the next headers into the
    blob (CRCs 0: not checked). Either way a record's declared size reaches
    past the next record's local header: the central directory alone shows
    the overlap (stock_archive + a moved extra field is the case that only
    the local headers show: test_zip_bounds)."""
    blob = bytes(range(256)) * (blob_size // 256) + bytes(blob_size % 256)
    crc = zlib.crc32(blob)
    b = Builder()
    b.standard(tensor_pickle([(str(i), blob_size) for i in range(n)]))
    names = [b.name(f"data/{i}") for i in range(n)]
    start = len(b.out)
    fixed = sum(30 + len(nm) for nm in names)
    blob_at = start + fixed + (-(start + fixed)) % 64
    entries = list(b.entries)
    for i, nm in enumerate(names):
        off = len(b.out)
        if local_extra:
            head = _header(nm, blob_at - (off + 30 + len(nm)))
            size = blob_size
        else:
            head = _header(nm, 0)
            size = blob_size + blob_at - (off + len(head))  # runs into the blob's end
        b.out += head
        entries.append(_zip.Entry(nm.decode(), size, crc if local_extra else 0, off, off + len(head)))
    b.out += bytes(blob_at - len(b.out)) + blob + _zip.descriptor(crc, blob_size, blob_at)
    b.entries = entries
    if not local_extra:  # data.pkl refers to storages of each record's declared size
        pkl = tensor_pickle([(str(i), e.size) for i, e in enumerate(entries[4:])])
        return _replace_pickle(b, pkl)
    b.tail()
    return b.finish()


def _replace_pickle(b: Builder, pkl: bytes) -> bytes:
    """Rebuild with another data.pkl of the same length or shorter (padded with STOPs)."""
    first = b.entries[0]
    assert len(pkl) <= first.size, (len(pkl), first.size)
    pkl = pkl + b"." * (first.size - len(pkl))
    b.out[first.data_offset:first.data_offset + first.size] = pkl
    first.crc = zlib.crc32(pkl)
    b.out[first.data_offset + first.size + 4:first.data_offset + first.size + 8] = struct.pack("<I", first.crc)
    b.tail()
    return b.finish()


def out_of_order_archive(storages: Sequence[bytes], seed: int = 0) -> bytes:
    """A well-formed archive whose central directory lists the records in
    another order than the file's."""
    import random
    b = Builder()
    b.standard(tensor_pickle([(str(i), len(s)) for i, s in enumerate(storages)]), storages)
    b.tail()
    entries = list(b.entries)
    rnd = random.Random(seed)
    while entries == b.entries:
        rnd.shuffle(entries)
    return b.finish(entries)


def huge_size_archive(size: int, which: int = 4) -> bytes:
    """A well-formed archive of one 4096-byte storage, except that the central
    directory gives entry `which` a size of `size` bytes (zip64 when needed)."""
    b = Builder()
    b.standard(tensor_pickle([("0", size)]), [bytes(4096)])
    b.tail()
    entries = [_zip.Entry(e.name, e.size, e.crc, e.header_offset, e.data_offset) for e in b.entries]
    entries[which % len(entries)].size = size
    return b.finish(entries)


def huge_count_archive(count: int, zip64: bool = True) -> bytes:
    """A well-formed archive whose end record (zip64: its zip64 end record)
    claims `count` entries in a directory as big as the file says it is."""
    data = bytearray(stock_archive([bytes(100)]))
    eocd = data.rfind(b"PK\x05\x06")
    if not zip64:
        n = min(count, 0xFFFE)
        struct.pack_into("<HH", data, eocd + 8, n, n)
        return bytes(data)
    _, _, _, _, _, cd_size, cd_off, _ = struct.unpack_from("<IHHHHIIH", data, eocd)
    z64 = struct.pack("<IQHHIIQQQQ", _zip.EOCD64_SIG, 44, 45, 45, 0, 0, count, count, cd_size, cd_off)
    loc = struct.pack("<IIQI", _zip.EOCD64_LOC_SIG, 0, eocd, 1)
    end = struct.pack("<IHHHHIIH", _zip.EOCD_SIG, 0, 0, 0xFFFF, 0xFFFF, cd_size, cd_off, 0)
    return bytes(data[:eocd]) + z64 + loc + end


def unreferenced_archive(referenced: int, unreferenced: int) -> Tuple[bytes, str]:
    """An archive with two storages; data.pkl refers only to data/0 (of
    `referenced` bytes). data/1 (`unreferenced` bytes of 0xAB) is in the
    directory but no tensor uses it. Returns the bytes and data/1's name."""
    b = Builder()
    b.standard(tensor_pickle([("0", referenced)]), [bytes(referenced), b"\xab" * unreferenced])
    b.tail()
    return b.finish(), "data/1"


# ---------------------------------------------------------------- memory probe

def status_bytes(field: str) -> int:
    """A memory figure of this process (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the kernel (glibc's malloc_trim), so
    that an allocation reusing memory freed earlier faults its pages in again and
    shows in the RSS: without it, what earlier code freed hides what is measured."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim:
        trim(0)


def hwm_resettable() -> Optional[str]:
    """None when this kernel lets a process reset its peak RSS (clear_refs 5), else why not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        status_bytes("VmHWM")
        return None
    except (OSError, RuntimeError) as e:
        return f"cannot reset the peak RSS through /proc/self/clear_refs: {e}"


def _worker() -> None:
    """The probe's child: for each request line {"path", "verify"}, load the
    file and answer {"growth": peak RSS growth in bytes during that load,
    "error": traceback of a disallowed exception or null}."""
    warm = os.environ["FASTCKPT_PROBE_WARM"]
    if os.environ.get("FASTCKPT_PROBE_BREAK") == "bounds":  # to show that the oracle can fail
        from fastckpt.formats import zip as z
        from fastckpt import serialization as ser
        z.check_layout = lambda entries, cd_off, bad: 0
        fastckpt.torchsave.reader.Records.claim = lambda self, names, extra=0: None
    fastckpt.load(warm, verify=True)  # engine, buffers and torch's lazy state, before any baseline
    fastckpt.load(warm, verify=False)
    for line in sys.stdin:
        req = json.loads(line)
        release_free_memory()  # (no gc.collect(): garbage left from before only raises the baseline)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        base = status_bytes("VmRSS")
        error = None
        try:
            load_cleanly(req["path"], req["verify"], req.get("as_file", False))
        except BaseException:
            error = traceback.format_exc()
        # (The kernel's RSS counters are per-CPU and read approximately: a load
        # that allocates nothing can read a few hundred KiB below the baseline.)
        growth = max(0, status_bytes("VmHWM") - base)
        sys.stdout.write(json.dumps({"growth": growth, "error": error}) + "\n")
        sys.stdout.flush()


class MemoryProbe:
    """Loads files in a child process (a fresh interpreter, not a fork: the
    engine's threads do not survive a fork) and measures each load's own peak
    RSS growth: the child resets its high-water mark (VmHWM, through
    /proc/self/clear_refs) and reads its RSS just before the load, then reads
    the high-water mark after it. Large frees go back to the system at once
    (fixed mmap threshold, malloc_trim), so one input's freed memory does not
    hide the next one's allocations."""

    def __init__(self, warm_path: str, timeout: float = 300.0, env: Optional[dict] = None):
        self.warm_path, self.timeout, self.env = warm_path, timeout, env or {}
        self.proc: Optional[subprocess.Popen] = None

    def _start(self) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, FASTCKPT_PROBE_WARM=str(self.warm_path), MALLOC_MMAP_THRESHOLD_=str(128 << 10),
                   PYTHONPATH=os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")] if p]), **self.env)
        self.proc = subprocess.Popen([sys.executable, "-c", "import crafted; crafted._worker()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)

    def load(self, path, verify: bool, as_file: bool = False) -> Tuple[int, Optional[str]]:
        """(peak RSS growth in bytes, traceback of a disallowed exception or None)
        of fastckpt.load(path) (as_file: of the file opened)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"path": str(path), "verify": bool(verify), "as_file": as_file}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            why = "timed out" if not ready else f"died (exit status {self.proc.returncode})"
            return -1, f"the probe's child {why} while loading {path}"
        r = json.loads(line)
        return r["growth"], r["error"]

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                if f:
                    f.close()


# The memory a load may take: MEMORY_FACTOR x the file's size (its records are
# read at most once), PICKLE_FACTOR x its data.pkl's size (the objects a pickle
# builds take more memory than its bytes: a tensor about 2.4 KiB for ~100
# pickle bytes, a list nested 150,000 deep 13 MiB for 300 KB), and
# MEMORY_SLACK for torch's per-call state. Measured: under 1 MiB for every
# crafted kind but deep nesting; the overlapping records  took
# 300 MiB for a 2 MiB file with a 4 KB pickle.
MEMORY_FACTOR = 4
PICKLE_FACTOR = 64
MEMORY_SLACK = 16 << 20


def pickle_size(data: bytes) -> int:
    """The size of the archive's data.pkl as Python's zipfile reads the central
    directory (not fastckpt's parser: the oracle does not trust the code under
    test), at most the file's size; 0 when there is none to be found."""
    import zipfile
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            sizes = [i.file_size for i in z.infolist() if i.filename.endswith("/data.pkl")]
    except Exception:
        return 0
    return min(max(sizes, default=0), len(data))


def memory_bound(file_size: int, pkl_size: int = 0) -> int:
    return MEMORY_FACTOR * file_size + PICKLE_FACTOR * pkl_size + MEMORY_SLACK
