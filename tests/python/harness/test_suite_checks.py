"""The suite's own checks bite: a run that leaves fastckpt's shared memory in /dev/shm fails
(tests/conftest.py), and so does a test that leaves a fastckpt setting in the process environment
(tests/python/conftest.py), whose other changes are undone for the next test."""
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import fastspawn

TESTS = Path(__file__).resolve().parents[2]


def _pytest(tmp_path, body: str, shm_only: str = "") -> subprocess.CompletedProcess:
    """A pytest run of `body` with the suite's conftests. Its /dev/shm check counts only the names
    starting with `shm_only` (none without it): the other worker's tests make and remove names
    there meanwhile."""
    (tmp_path / "test_probe.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    if shm_only:
        env["FASTCKPT_TEST_SHM_ONLY"] = shm_only
    else:
        env["FASTCKPT_TEST_NESTED_RUN"] = "1"
    env.pop("FASTCKPT_TEST_DURATIONS_OUT", None)  # `make test-durations`: the probe's run records nothing
    return fastspawn.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                         "-p", "python.conftest", "--rootdir", str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_a_run_that_leaves_shared_memory_fails(tmp_path):
    name = f"fastckpt-probe-{uuid.uuid4().hex[:8]}"
    try:
        r = _pytest(tmp_path, f"def test_leaves():\n    open('/dev/shm/{name}', 'w').write('x')\n", shm_only=name)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"left shared memory behind in /dev/shm: {name}" in r.stdout, r.stdout
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")
    r = _pytest(tmp_path, f"import os\ndef test_cleans():\n    open('/dev/shm/{name}', 'w').write('x')\n"
                          f"    os.unlink('/dev/shm/{name}')\n", shm_only=name)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_fastckpt_setting_left_in_the_environment_fails_and_other_changes_are_undone(tmp_path):
    r = _pytest(tmp_path, "import os\n"
                          "def test_a_leaves():\n    os.environ['FASTCKPT_PROBE_LEFT'] = '1'\n"
                          "    os.environ['OTHER_PROBE_LEFT'] = '2'\n"
                          "def test_b_sees_nothing():\n"
                          "    assert 'FASTCKPT_PROBE_LEFT' not in os.environ and 'OTHER_PROBE_LEFT' not in os.environ\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "left fastckpt settings in the process environment: FASTCKPT_PROBE_LEFT='1' (was None)" in r.stdout, \
        r.stdout
    assert "2 passed, 1 error" in r.stdout, r.stdout  # test_a passed, its teardown failed; test_b passed


def test_a_grouped_module_runs_on_one_worker_and_builds_its_fixture_once(tmp_path):
    """The tests of a module in tests/conftest.py's GROUPED share one xdist worker under `make test`'s
    --dist loadgroup, so that its module-scoped fixture is built once (with pytest 9 xdist's own
    marker-based grouping groups nothing: tests/conftest.py schedules the groups itself)."""
    pytest.importorskip("xdist")
    mod = tmp_path / "tests" / "python" / "crash" / "test_crash_short.py"  # a GROUPED module's path
    mod.parent.mkdir(parents=True)
    log = tmp_path / "log"
    mod.write_text("import os, pytest\n"
                   "@pytest.fixture(scope='module')\n"
                   "def built():\n"
                   f"    open({str(log)!r}, 'a').write('fixture\\n')\n"
                   + "".join(f"def test_{i}(built):\n"
                             f"    open({str(log)!r}, 'a').write('test ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
                             for i in range(12)))
    (tmp_path / "test_other.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(12)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]),
               FASTCKPT_TEST_NESTED_RUN="1")  # as _pytest: /dev/shm is the outer run's to check
    env.pop("FASTCKPT_TEST_DURATIONS_OUT", None)
    r = fastspawn.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                       "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "--rootdir", str(tmp_path),
                       str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = log.read_text().splitlines()
    assert lines.count("fixture") == 1, lines
    workers = {ln.split()[1] for ln in lines if ln.startswith("test ")}
    assert len([ln for ln in lines if ln.startswith("test ")]) == 12 and len(workers) == 1, lines


def test_what_collection_made_is_frozen_and_later_cycles_are_still_collected():
    """tests/conftest.py moves what exists at the end of collection (torch's objects among them) to
    the collector's permanent generation, so that the leak checks' full collections are cheap; what
    a test makes later is collected as before."""
    import gc
    import weakref

    import torch
    assert gc.get_freeze_count() > 50_000, gc.get_freeze_count()

    class Node:
        pass
    a = Node()
    a.self = a  # a reference cycle: only the cyclic collector frees it
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None
