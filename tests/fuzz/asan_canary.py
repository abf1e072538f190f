"""A deliberate out-of-bounds write through fastckpt._C, for run_sanitized.sh.

Under the sanitized build, AddressSanitizer must stop this process with a
heap-buffer-overflow report: that shows the runtime, its options and the
script's detection of a sanitizer death all work, before a fuzz run that finds
nothing is believed. Without a sanitizer it would corrupt the heap, so it
refuses to run unless libasan is loaded.

The overflow: read_ranges is given a destination that claims 8192 bytes but
is a 64-byte malloc'd block (a ctypes array laid over it, as a buggy or
hostile caller could); the engine copies file bytes past the block's end.
"""
import ctypes
import os
import sys
import tempfile


def main() -> int:
    with open("/proc/self/maps") as f:
        if "libasan" not in f.read():
            print("asan_canary: libasan is not loaded; refusing to corrupt the heap", file=sys.stderr)
            return 2
    from fastckpt import _C
    from fastckpt._core.engine import get_engine

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    block = libc.malloc(64)
    liar = (ctypes.c_char * 8192).from_address(block)
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"x" * 16384)
        f.flush()
        _C.read_ranges(get_engine(), f.name, [(liar, 1)])  # offset 1: through the staging buffers (memcpy)
    print("asan_canary: the overflow went unnoticed", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
