"""Lightning's own checkpoint tests (tests/third_party/lightning) once more, with fastckpt's
asynchronous plugin as the strategies' default CheckpointIO (``FASTCKPT_THIRD_PARTY=async``). The
mode is read when that folder's conftest is imported, so it is a pytest run of its own, started
here: inside `make test`'s parallel run, where it takes one worker while the other goes on (a
separate step after the run kept one CPU idle for its 30-40 s). The main run covers the folder in
the default mode (``FastCheckpointIO``)."""
import os
import re
import sys

import pytest

import fastspawn
from paths import ROOT

pytest.importorskip("lightning", reason="lightning is not installed (pip install 'fastckpt-io[lightning]')")

FOLDER = ROOT / "tests" / "third_party" / "lightning"


def test_lightnings_own_tests_pass_with_the_async_plugin_swapped_in(tmp_path):
    # FASTCKPT_TEST_NESTED_RUN: the other worker's tests make and remove names in /dev/shm while this run
    # goes on; this (outer) run checks at its end what every test left there (tests/conftest.py)
    env = dict(os.environ, FASTCKPT_THIRD_PARTY="async", FASTCKPT_TEST_NESTED_RUN="1")
    env.pop("FASTCKPT_TEST_DURATIONS_OUT", None)  # `make test-durations`: this inner run records nothing
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    p = fastspawn.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                        str(tmp_path / "basetemp"), str(FOLDER)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    out = p.stdout + p.stderr
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    assert p.returncode == 0, "\n".join(failed) + "\n...\n" + out[-4000:]
    # the swap really happened: most upstream tests went through fastckpt's asynchronous plugin
    m = re.search(r"third_party/lightning \(async\): (\d+) of (\d+) upstream tests called the swapped-in "
                  r"CheckpointIO \((\d+) calls\)", out)
    assert m is not None, out[-3000:]
    called, total, calls = map(int, m.groups())
    assert total >= 150 and called >= 100 and calls >= called, m.group(0)
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"\d+ (failed|errors?)\b", summary), summary
    print(m.group(0))
    print(summary)
