"""Scheduling of the test suite on several workers (pytest-xdist, `make test`).

`make test` runs ``pytest -n N --dist loadgroup --no-loadscope-reorder``: every
test is a unit of work of its own, except the tests of a module whose
module-scoped fixtures are expensive (a crash driver's run, a mounted FUSE
filesystem, a fuzz corpus), which stay together on one worker (an
``xdist_group`` named after the module) so that the fixture is built once.
The units go to whichever worker is free, longest first (longest-processing-
time-first keeps the last minutes of the run from being one long test on one
worker while the other idles): the expected durations come from
``tests/durations.json``, seconds per test id, written by a run with
``FASTCKPT_TEST_DURATIONS_OUT=tests/durations.json`` (``make test-durations``).
A test that is not in it counts as short. Serial runs keep pytest's order.

The long tier: a test or parametrization marked ``long`` is a second variant of a class
that ``make test`` already covers with another (the same check at a larger placement, the
other branch of a fault, a slower launcher); ``make test`` skips it with the reason,
``make test-long`` (``FASTCKPT_TEST_LONG=1 pytest -m long``) runs them.

At the end of a run, the run fails if it left something of fastckpt's in /dev/shm (shared memory
that outlives the tests takes the machine's memory until a reboot).
"""
import gc
import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# The shared helpers (tests/support: fastspawn, dist_launch, states, ...) are imported by their bare
# names, `import fastspawn`, by every test module of tests/python/<area>/ and tests/powerloss/; the
# scripts the tests start as children (tests/support/workers/) put the same folder on sys.path.
if str(HERE / "support") not in sys.path:
    sys.path.insert(0, str(HERE / "support"))
DURATIONS = HERE / "durations.json"
# Tests shorter than this are left out of durations.json (they count as DEFAULT_S).
RECORD_MIN_S, DEFAULT_S = 1.0, 0.3
# Modules whose module-scoped fixtures are worth building once: their tests share one worker.
GROUPED = {
    "tests/powerloss/test_powerloss.py",
    "tests/python/cli/test_convert_ranks.py",
    "tests/python/collective/test_collective_load_device.py",
    "tests/python/crash/test_crash_short.py",
    "tests/python/dcp/test_dcp.py",
    "tests/python/dcp/test_fuzz_dcp.py",
    "tests/python/formats/test_hostile.py",
    "tests/python/formats/test_zip_bounds.py",
    "tests/python/manager/test_ddp_resume.py",
    "tests/python/memory/test_memory_nodes.py",
    "tests/python/torchsave/test_cold_read_once.py",
    "tests/python/torchsave/test_fuzz_load.py",
}


def _distributed(config) -> bool:
    return getattr(config.option, "numprocesses", None) not in (None, 0) or hasattr(config, "workerinput")


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


LONG = os.environ.get("FASTCKPT_TEST_LONG") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "long: a variant that make test skips and make test-long runs "
                                       "(FASTCKPT_TEST_LONG=1); another variant covers its class in make test")


def _skip_long(items) -> set:
    """Mark the long tests skipped unless FASTCKPT_TEST_LONG=1; their node ids."""
    skipped = set()
    if LONG:
        return skipped
    why = pytest.mark.skip(reason="a long variant: make test-long runs it (FASTCKPT_TEST_LONG=1)")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(why)
            skipped.add(item.nodeid)
    return skipped


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup with the groups decided here, from the node ids. xdist's own grouping reads
    an "@group" suffix that its worker-side hook appends to each node id from the xdist_group
    marker; pytest 9 derives node ids from another field, the suffix never reaches the scheduler,
    and every test became a unit of its own: a grouped module's expensive fixture (a crash driver's
    run, a FUSE mount, a two-rank save) was built again on each worker that got one of its tests."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Scheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            mod = _module(nodeid)
            return "group:" + mod if mod in GROUPED else super()._split_scope(nodeid)
    return Scheduling(config, log)


# tryfirst: the xdist_group markers are on the items before xdist's worker-side hook reads them
# (where the node-id suffix still works, pytest < 9; the scheduler above groups in every case).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    skipped = _skip_long(items)
    if not _distributed(config):
        return
    try:
        expected = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        expected = {}
    cost = {}  # unit of work -> expected seconds
    unit = {}
    for item in items:
        mod = _module(item.nodeid)
        if mod in GROUPED:
            item.add_marker(pytest.mark.xdist_group(mod))
            unit[item.nodeid] = "group:" + mod
        else:
            unit[item.nodeid] = item.nodeid
        u = unit[item.nodeid]
        own = 0.0 if item.nodeid in skipped else float(expected.get(item.nodeid, DEFAULT_S))
        cost[u] = cost.get(u, 0.0) + own
    # Stable: the tests of a group keep their order; equal costs keep pytest's.
    items.sort(key=lambda it: -cost[unit[it.nodeid]])


def pytest_collection_finish(session):
    """What exists once the tests are collected (torch's, pytest's and the test modules' 280,000 or
    so objects) goes to the collector's permanent generation: a full collection then walks only what
    the tests made since, in microseconds instead of 0.15 s here (0.3 s with both CPUs busy). The
    leak checks (tests/support/leaks.py) collect before each count of descriptors, twice per fault
    test, and the collector's own full passes run the whole suite long. Those objects live for the
    whole run anyway; a later object is collected as before."""
    gc.collect()
    gc.freeze()


# ---------------------------------------------------------------- recording durations

_seen = {}


def pytest_runtest_logreport(report):
    if os.environ.get("FASTCKPT_TEST_DURATIONS_OUT"):
        _seen[report.nodeid] = _seen.get(report.nodeid, 0.0) + report.duration  # setup + call + teardown


# ---------------------------------------------------------------- shared memory left behind

SHM = Path("/dev/shm")
_shm_before = set()


def _shm_names() -> set:
    """fastckpt's names in /dev/shm, and the namespaces in the memory tier's default directory (only
    those starting with FASTCKPT_TEST_SHM_ONLY where set: a test's nested run, so that what the
    tests beside it make there does not count)."""
    only = os.environ.get("FASTCKPT_TEST_SHM_ONLY", "")
    try:
        names = {n for n in os.listdir(SHM) if n.startswith("fastckpt")}
    except OSError:
        return set()
    if (SHM / "fastckpt").is_dir():
        names |= {f"fastckpt/{n}" for n in os.listdir(SHM / "fastckpt")}
    return {n for n in names if n.startswith(only)}


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        _shm_before.update(_shm_names())


def _shm_left(session) -> None:
    """What this run made in /dev/shm and left there fails the run (another run of the tests at the
    same time on this machine would be counted too: run one at a time). A run that a test starts
    with FASTCKPT_TEST_NESTED_RUN=1 does not check: the tests running beside it in the outer run
    come and go there, and the outer run checks what all of them left, the nested run's included."""
    if hasattr(session.config, "workerinput") or not SHM.is_dir():
        return
    if os.environ.get("FASTCKPT_TEST_NESTED_RUN") == "1":
        return
    left = sorted(_shm_names() - _shm_before)
    if left:
        session.config.get_terminal_writer().line(
            "FAILED: the tests left shared memory behind in /dev/shm: " + ", ".join(left), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_sessionfinish(session, exitstatus):
    _shm_left(session)
    out = os.environ.get("FASTCKPT_TEST_DURATIONS_OUT")
    if not out or hasattr(session.config, "workerinput"):  # the controller writes (it sees every report)
        return
    rows = {k: round(v, 1) for k, v in sorted(_seen.items(), key=lambda kv: -kv[1]) if v >= RECORD_MIN_S}
    Path(out).write_text(json.dumps(rows, indent=0) + "\n")
