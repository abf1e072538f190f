"""Crafted pickles for the tests of fastckpt's restricted unpickler (fastckpt.formats.unpickler)
and the fuzzers of every parser that unpickles: not mutations of valid files but
structures built to make an unpickler run code or allocate far more than the
data holds. Each builder returns bytes; `SIZE_ATTACKS` and `CODE_ATTACKS` name them.

`peak_growth(fn)` is the per-input memory oracle: the growth of the process's
peak RSS while `fn` runs, measured for that call alone (the kernel's high-water
mark is reset first through /proc/self/clear_refs, after the C heap's free
pages went back to the kernel), plus the peak of traced
Python allocations (tracemalloc, reset per call); the larger of the two.
"""
import os
import pickle
import struct
import tracemalloc

import crafted  # the memory figures of /proc/self/status, shared with the load fuzzers

I4 = struct.Struct("<I")
Q8 = struct.Struct("<Q")

PROTO2 = b"\x80\x02"
PROTO4 = b"\x80\x04"


def long_binput(index: int = 0x2000000) -> bytes:
    """9 bytes: an empty dict stored at memo index `index`. CPython's C unpickler
    sizes its memo table from the index (16 bytes per entry, zero-filled):
    0x2000000 asks for 512 MiB, 0xFFFFFFFF for 64 GiB."""
    return PROTO2 + b"}" + b"r" + I4.pack(index) + b"."


def long_binget(index: int = 0x7FFFFFFF) -> bytes:
    """GET of a memo index nobody stored."""
    return PROTO2 + b"j" + I4.pack(index) + b"."


def binbytes8(n: int = 1 << 40) -> bytes:
    """A bytes object that declares `n` bytes and holds 3."""
    return PROTO4 + b"\x8e" + Q8.pack(n) + b"abc."


def binunicode8(n: int = 1 << 40) -> bytes:
    return PROTO4 + b"\x8d" + Q8.pack(n) + b"abc."


def bytearray8(n: int = 1 << 33) -> bytes:
    return b"\x80\x05" + b"\x96" + Q8.pack(n) + b"abc."


def binbytes(n: int = 0xFFFFFFFF) -> bytes:
    return b"\x80\x03" + b"B" + I4.pack(n) + b"abc."


def long4(n: int = 0x7FFFFFFF) -> bytes:
    return PROTO2 + b"\x8b" + I4.pack(n) + b"\x01."


def frame(n: int = 1 << 40) -> bytes:
    return PROTO4 + b"\x95" + Q8.pack(n) + b"N."


def deep_tuple_key(depth: int = 5000) -> bytes:
    """A dict whose key is a tuple nested `depth` deep (hashing it recurses in C:
    deep enough, it overflows the C stack)."""
    return PROTO2 + b"}" + b"N" + b"\x85" * depth + b"N" + b"s" + b"."


def deep_lists(depth: int = 5000) -> bytes:
    """Lists nested `depth` deep, built with a constant stack through the memo."""
    out = bytearray(PROTO2 + b"]" + b"r" + I4.pack(0))
    for i in range(1, depth):
        out += b"]" + b"r" + I4.pack(i) + b"a" + b"0" + b"j" + I4.pack(i)  # a new list into the last one
    return bytes(out) + b"0" + b"j" + I4.pack(0) + b"."


def deep_lists_on_stack(depth: int = 5000) -> bytes:
    """`depth` empty lists pushed, then appended each into the one below."""
    return PROTO2 + b"]" * depth + b"a" * (depth - 1) + b"."


def empty_set_spam(n: int = 1 << 20) -> bytes:
    """A list of `n` empty sets: one byte each in the pickle, about 216 bytes each in memory."""
    return PROTO4 + b"]" + b"(" + b"\x8f" * n + b"e."


def copying_calls(elements: int = 20000, copies: int = 600, module: str = "builtins", name: str = "set") -> bytes:
    """`copies` calls of an allowed copying callable (`module.name`, e.g. set) on one
    memoized list of `elements` distinct ints: 5 bytes per call, each call copies
    the whole list (tens of bytes per element)."""
    out = bytearray(PROTO4)
    mod, nm = module.encode(), name.encode()
    out += b"\x8c" + bytes([len(mod)]) + mod + b"\x8c" + bytes([len(nm)]) + nm + b"\x93" + b"r" + I4.pack(0)
    out += b"0"  # the callable stays in memo 0
    out += b"]" + b"(" + b"".join(b"M" + struct.pack("<H", i % 65536) if i < 65536 else
                                 b"J" + struct.pack("<i", i) for i in range(elements))
    out += b"e" + b"r" + I4.pack(1) + b"0"  # the list, in memo 1
    out += b"]" + b"("
    for _ in range(copies):
        out += b"j" + I4.pack(0) + b"j" + I4.pack(1) + b"\x85" + b"R"
    out += b"e."
    return bytes(out)


def huge_memo_get_spam(n: int = 1 << 18) -> bytes:
    """One small object pushed `n` times by GET: 2 bytes each, 8 bytes on the stack."""
    return PROTO2 + b"]" + b"q\x00" + b"(" + b"h\x00" * n + b"l."


SIZE_ATTACKS = {
    "long_binput_512MiB": long_binput(0x2000000),
    "long_binput_64GiB": long_binput(0xFFFFFFFF),
    "long_binget": long_binget(),
    "binbytes8_1TiB": binbytes8(),
    "binunicode8_1TiB": binunicode8(),
    "bytearray8_8GiB": bytearray8(),
    "binbytes_4GiB": binbytes(),
    "long4_2GiB": long4(),
    "frame_1TiB": frame(),
    "deep_tuple_key": deep_tuple_key(),
    "deep_lists": deep_lists(),  # nesting through the memo: harmless (Python's recursion guards), not refused
    "deep_lists_on_stack": deep_lists_on_stack(),
}

# Refused by the walk's budget (they would allocate well over 64 times their size).
AMPLIFIERS = {
    "empty_set_spam": empty_set_spam(1 << 18),
    "copying_calls": copying_calls(),
}


def _global_call(mod: str, name: str, args: tuple) -> bytes:
    body = pickle.dumps(args, protocol=2)[2:-1]  # the args tuple, without PROTO and STOP
    return PROTO2 + b"c" + mod.encode() + b"\n" + name.encode() + b"\n" + body + b"R."


def code_attacks(marker: str):
    """Pickles that, unpickled by a plain unpickler, create the file `marker`
    (by os.system, subprocess, builtins.eval/exec, or a callable that writes it)."""
    py = f"open({marker!r}, 'w').write('pwned')"
    return {
        "os.system": _global_call("os", "system", (f"touch {marker}",)),
        "posix.system": _global_call("posix", "system", (f"touch {marker}",)),
        "subprocess.call": _global_call("subprocess", "call", (["touch", marker],)),
        "builtins.eval": _global_call("builtins", "eval", (py,)),
        "builtins.exec": _global_call("builtins", "exec", (py,)),
        "io.open": _global_call("io", "open", (marker, "w")),
    }


# ---------------------------------------------------------------- a DCP checkpoint of one record

def record(pkl: bytes) -> bytes:
    """A DCP tensor record (a torch.save archive of a float32 tensor of 3
    elements) whose data.pkl is `pkl`, with correct CRCs."""
    import io
    import sys
    import zipfile

    import torch
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", sys.byteorder)
        z.writestr("archive/data/0", torch.arange(3.0).numpy().tobytes())
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def value_ckpt(d, pkl: bytes) -> None:
    """Make `d` a DCP checkpoint of one non-tensor value "x" (a BYTE_IO record: a
    torch.save archive) whose data.pkl is `pkl`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
    os.makedirs(d, exist_ok=True)
    blob = record(pkl)
    with open(os.path.join(d, "__0_0.distcp"), "wb") as f:
        f.write(blob)
    md = Metadata(state_dict_metadata={"x": BytesStorageMetadata()},
                  storage_data={MetadataIndex("x"): _StorageInfo("__0_0.distcp", 0, len(blob))})
    with open(os.path.join(d, ".metadata"), "wb") as f:
        f.write(pickle.dumps(md))


def record_ckpt(d, pkl: bytes) -> None:
    """Make `d` a DCP checkpoint of one tensor "w" (float32, 3 elements) stored in
    one record whose data.pkl is `pkl`."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )
    os.makedirs(d, exist_ok=True)
    blob = record(pkl)
    with open(os.path.join(d, "__0_0.distcp"), "wb") as f:
        f.write(blob)
    md = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([3]),
                                                        [ChunkStorageMetadata(torch.Size([0]), torch.Size([3]))])},
        storage_data={MetadataIndex("w", torch.Size([0])): _StorageInfo("__0_0.distcp", 0, len(blob))})
    with open(os.path.join(d, ".metadata"), "wb") as f:
        f.write(pickle.dumps(md))


# Opcode fragments to splice into valid pickles.
def tricks(marker: str):
    return {
        "long_binput_2G": b"r" + I4.pack(0x7FFFFFFF),
        "long_binput_32M": b"r" + I4.pack(0x02000000),
        "binput_ahead": b"q\xff",
        "long_binget": b"j" + I4.pack(0x7FFFFFFF),
        "binbytes8": b"\x8e" + Q8.pack(1 << 40),
        "binunicode8": b"\x8d" + Q8.pack(1 << 40),
        "binbytes": b"B" + I4.pack(0xFFFFFFFF),
        "binunicode": b"X" + I4.pack(0xFFFFFFFF),
        "long4": b"\x8b" + I4.pack(0x7FFFFFFF),
        "frame": b"\x95" + Q8.pack(1 << 40),
        "deep_tuple": b"N" + b"\x85" * 300,
        "deep_lists": b"]" * 300 + b"a" * 299,
        "marks": b"(" * 2000,
        "empty_sets": b"\x8f" * 5000,
        "os_system": b"cos\nsystem\n(S'touch " + marker.encode() + b"'\ntR",
        "eval": b"cbuiltins\neval\n(S'open(" + repr(marker).encode() + b", \"w\")'\ntR",
    }


# ---------------------------------------------------------------- the memory oracle

def _reset_hwm() -> bool:
    return crafted.hwm_resettable() is None  # resets the peak RSS (VmHWM) to the current RSS when it can


def rss_oracle_available() -> bool:
    return _reset_hwm()


def peak_growth(fn, *args, traced: bool = True, **kwargs):
    """(result or exception, bytes): run fn once and measure how much the peak
    memory grew during this call alone: the RSS high-water mark (reset before
    it) and, with `traced` (or where the high-water mark cannot be reset),
    tracemalloc's peak of Python allocations (reset before it)."""
    if not traced and not rss_oracle_available():
        traced = True
    started = traced and not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    if traced:
        tracemalloc.reset_peak()
        base_traced = tracemalloc.get_traced_memory()[0]
    crafted.release_free_memory()  # memory freed by earlier tests would hide this call's allocations
    _reset_hwm()
    base_rss = crafted.status_bytes("VmRSS")
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - returned for the caller to judge
        out = e
    grown = crafted.status_bytes("VmHWM") - base_rss
    if traced:
        grown = max(grown, tracemalloc.get_traced_memory()[1] - base_traced)
    if started:
        tracemalloc.stop()
    return out, grown


def peak_in_subprocess_code(body: str) -> str:
    """Python source that runs `body` (which may raise) and prints one JSON line:
    {"error": type name, "message": str, "grown": bytes of VmHWM growth}."""
    return (
        "import json, os, sys\n"
        "def _st(k):\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(k + ':'):\n"
        "            return int(line.split()[1]) * 1024\n"
        "def _run():\n"
        + "".join("    " + ln + "\n" for ln in body.splitlines())
        + "try:\n"
        "    open('/proc/self/clear_refs', 'w').write('5')\n"
        "except OSError:\n"
        "    pass\n"
        "_base = _st('VmRSS')\n"
        "try:\n"
        "    _run()\n"
        "    _err, _msg = None, ''\n"
        "except BaseException as e:\n"
        "    _err, _msg = type(e).__name__, str(e)\n"
        "print(json.dumps({'error': _err, 'message': _msg, 'grown': _st('VmHWM') - _base}))\n"
    )


def file_size(path) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                   if os.path.isfile(os.path.join(path, n)))
    return os.path.getsize(path)
