"""pytest plugin for tests/fuzz/run_sanitized.sh (``-p fuzz_plugin``, with
this directory on PYTHONPATH).

1. Proof: before any test runs, the process must be running the sanitized
   build, else pytest exits (return code 3) and the run does not count:
   fastckpt and fastckpt._C come from $FASTCKPT_SANITIZED_DIR, and the
   AddressSanitizer runtime is loaded (mapped in /proc/self/maps, and
   ``__asan_init`` resolves in the process).
2. Counting: every call of the loaders under test is counted where it is made
   (fastckpt.load; FastReader.read_metadata, which each DCP input starts
   with), so the total is the inputs actually executed, not hypothesis'
   max_examples cap.
3. Hangs: each of those calls, and FastReader.read_data, runs under a
   faulthandler watchdog ($FASTCKPT_FUZZ_CALL_TIMEOUT seconds, default 300)
   that dumps every thread's stack and exits the process.

At the end of the session, $FASTCKPT_FUZZ_REPORT (JSON) receives the counts,
the proof and pytest's exit status.
"""
import ctypes
import faulthandler
import functools
import json
import os
import sys

import pytest

COUNTS = {"fastckpt.load": 0, "FastReader.read_metadata": 0}
PROOF = {}
TIMEOUT = float(os.environ.get("FASTCKPT_FUZZ_CALL_TIMEOUT", "300"))


def _watched(fn, counter=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if counter is not None:
            COUNTS[counter] += 1
        faulthandler.dump_traceback_later(TIMEOUT, exit=True)
        try:
            return fn(*args, **kwargs)
        finally:
            faulthandler.cancel_dump_traceback_later()
    return wrapper


def _prove_sanitized_build():
    want = os.environ.get("FASTCKPT_SANITIZED_DIR")
    if not want:
        return "FASTCKPT_SANITIZED_DIR is not set"
    want = os.path.realpath(want)
    import fastckpt
    from fastckpt import _C
    PROOF["fastckpt"] = os.path.realpath(fastckpt.__file__)
    PROOF["fastckpt._C"] = os.path.realpath(_C.__file__)
    for what in ("fastckpt", "fastckpt._C"):
        if os.path.commonpath([PROOF[what], want]) != want:
            return f"{what} was imported from {PROOF[what]}, not from the sanitized build in {want}"
    with open("/proc/self/maps") as f:
        maps = f.read()
    asan = sorted({line.split()[-1] for line in maps.splitlines() if "libasan" in line.split()[-1]})
    PROOF["asan_runtime"] = asan
    if not asan:
        return "the AddressSanitizer runtime (libasan) is not mapped in this process"
    if PROOF["fastckpt._C"] not in maps:
        return f"{PROOF['fastckpt._C']} is not mapped in this process"
    try:
        ctypes.CDLL(None).__asan_init  # noqa: B018  (the lookup is the check)
    except AttributeError:
        return "__asan_init does not resolve in this process"
    PROOF["__asan_init"] = True
    return None


def pytest_configure(config):
    why = _prove_sanitized_build()
    if why:
        pytest.exit(f"fuzz_plugin: NOT the sanitized build: {why}", returncode=3)
    import fastckpt
    from fastckpt.dcp.reader import FastReader
    fastckpt.load = _watched(fastckpt.load, "fastckpt.load")
    FastReader.read_metadata = _watched(FastReader.read_metadata, "FastReader.read_metadata")
    FastReader.read_data = _watched(FastReader.read_data)
    print(f"fuzz_plugin: sanitized build in use: {PROOF}", file=sys.stderr)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FASTCKPT_FUZZ_REPORT")
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"counts": COUNTS, "proof": PROOF, "exitstatus": int(exitstatus),
                   "tests_failed": session.testsfailed, "tests_collected": session.testscollected}, f, indent=1)
