"""Power loss: every crash state of every save kind leaves the old checkpoint or the complete new one.

A SIGKILL keeps the page cache, so only a simulated power cut can tell whether fdatasync and the
directory fsync happen. Save kinds (scenarios.py): ``fastckpt.save``; ``fastckpt.async_save`` (two
in flight at once too; and with background staging, where it returns before the large tensors are
copied: the caller copying a share and the staging thread the rest, or the tensors written straight
from their memory); ``CheckpointManager`` save and async_save with its ``latest`` update and
retention, replicated and sharded (world size 2); DCP ``FastWriter`` at world size 2 (gloo, two
processes; ``dcp.save`` and ``dcp.async_save``); the collective ``fastckpt.save(obj, path, group=pg)``
at world size 3 (three processes writing their shares of one temporary file through the mount,
each fdatasyncing its own, rank 0 the rest, the rename and the directory fsync), the full-size save of
sharded state (``full``: DTensors at world size 2, every rank writing its shards' blocks), and
``CheckpointManager`` in replicated mode at world size 3 (its saves collective, and its async_saves,
two in a row, written collectively by every rank's writer thread). Those three are checked under crashfs's per-client model (a process's writes are
durable only once that process fsyncs the file, as on a shared filesystem: scenarios.PER_CLIENT). Each test runs one scenario in a child process on crashfs,
an in-memory FUSE filesystem that records every operation (crashfs.py), then replays the record
and checks, at every point between two operations, the states a power cut may leave there
(synced only; names persisted but unsynced data lost; unsynced data persisted but names not;
everything persisted; and the namespace committed in order up to each earlier change since the
last directory fsync, as a journal would) under a strict model: a file's data is durable only
once fsynced or fdatasynced, a new name, rename or unlink only once its directory is fsynced
(test_crashfs_model.py tests the model itself, without FUSE). The checkpoint
under its final name, ``latest`` and what ``CheckpointManager.load_latest`` resumes from must be
the last one whose save returned, or one whose save was under way: loaded and compared bitwise,
never torn or missing.

The FUSE mount accepts O_DIRECT (the kernel passes direct writes straight to the daemon), so the
engine's O_DIRECT path is what the default configuration tests; the long run adds the buffered
fallback (FASTCKPT_DIRECT=0), the thread backend and intermediate flushes.

``test_simulator_finds_a_missing_sync`` proves the check has teeth: with the engine's data
fdatasync or directory fsync turned off (FASTCKPT_TEST_SKIP_SYNC, test-only) it finds torn or
lost checkpoints.

Short by default (part of ``make test``); ``FASTCKPT_POWERLOSS_LONG=1`` (``make powerloss-long``)
saves larger checkpoints more times in more engine configurations and prints its counts.
Without FUSE (no /dev/fuse, no permission, libfuse3 or mfusepy missing) every test skips.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

REASON = harness.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"power-loss tests need FUSE: {REASON}")

LONG = os.environ.get("FASTCKPT_POWERLOSS_LONG") == "1"
SHORT_PARAMS = {"numel": 1 << 16, "saves": 2}  # 256 KiB of float32 and a few small tensors per checkpoint
PARAMS = {"numel": 1 << 20, "saves": 4} if LONG else SHORT_PARAMS
CONFIGS = {"default": {}}
if LONG:
    CONFIGS.update({
        "buffered": {"FASTCKPT_DIRECT": "0"},
        "threads": {"FASTCKPT_BACKEND": "threads"},
        "flushes": {"FASTCKPT_FLUSH_INTERVAL": "1M", "FASTCKPT_BUFFER_SIZE": "256K"},
    })
SCENARIOS = ["save", "async_save", "manager", "manager_memory", "dcp", "manager_sharded", "collective", "full",
             "manager_collective", "resave"]

REPORTS = []


@pytest.fixture(scope="module", autouse=True)
def _print_counts(request):
    """Prints each run's counts (cut points, crash states checked, violations) after the module,
    also without -s. (No conftest.py here: pytest imports tests/python's as the module `conftest`; a second one would clash.)"""
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    cap = request.config.pluginmanager.get_plugin("capturemanager")
    if REPORTS and tr is not None and cap is not None:
        with cap.global_and_fixture_disabled():
            tr.write_line("")
            tr.write_sep("=", "power-loss counts")
            for line in REPORTS:
                tr.write_line(line)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_power_cut_leaves_old_or_new(scenario, config, tmp_path):
    rep = harness.run(scenario, PARAMS, str(tmp_path), env=CONFIGS[config])
    REPORTS.append(f"{rep.line()} [{config}]")
    _old_or_new(rep, PARAMS["saves"])


def _old_or_new(rep, saves: int) -> None:
    """No crash state violated the rule, and the check was not vacuous: the states seen include no
    checkpoint yet and the final one."""
    assert rep.violation_count == 0, "\n".join(rep.violations)
    for check, seen in rep.seen.items():
        assert "absent" in seen and max(v for v in seen if isinstance(v, int)) >= saves, (check, seen)


# async_save with background staging (it returns before the large tensors are copied): the caller
# copying a share and the staging thread the rest, or the tensors written straight from their memory
# (torch's large allocations 2 MiB-aligned, so that they can be), or both: one tensor copied by the
# staging thread, the others sent live
STAGED = {"split": {"FASTCKPT_ASYNC_WRITE_THROUGH": "0", "FASTCKPT_ASYNC_CALLER_COPY": "50"},
          "through": {"FASTCKPT_ASYNC_WRITE_THROUGH": "1", "THP_MEM_ALLOC_ENABLE": "1"},
          "mixed": {"FASTCKPT_ASYNC_WRITE_THROUGH": "1", "THP_MEM_ALLOC_ENABLE": "1"}}


@pytest.mark.parametrize("mode", list(STAGED))
def test_power_cut_during_background_staged_async_saves(mode, tmp_path):
    params = {"numel": 1 << 19, "saves": 2, "mode": mode}  # three 2 MiB tensors per checkpoint
    rep = harness.run("async_staged", params, str(tmp_path), env=STAGED[mode])
    REPORTS.append(f"{rep.line()} [background staging, {mode}]")
    _old_or_new(rep, params["saves"])


@pytest.mark.parametrize("scenario", ["dcp", "resave"])
def test_directory_resaves_without_the_exchange(scenario, tmp_path):
    """The same re-saves where the filesystem refuses RENAME_EXCHANGE (FASTCKPT_TEST_NO_EXCHANGE,
    test-only): the two-rename fallback, whose interrupted state (the final name missing, the old
    copy aside) fastckpt's readers read through, so every crash state still loads old or new."""
    rep = harness.run(scenario, PARAMS, str(tmp_path), env={"FASTCKPT_TEST_NO_EXCHANGE": "1"})
    REPORTS.append(f"{rep.line()} [FASTCKPT_TEST_NO_EXCHANGE=1]")
    assert rep.violation_count == 0, "\n".join(rep.violations)


@pytest.mark.parametrize("scenario", ["save", "manager", "manager_memory"] + (["dcp", "manager_sharded", "collective", "manager_collective"] if LONG else []))
@pytest.mark.parametrize("skip", ["data", "dir"])
def test_simulator_finds_a_missing_sync(skip, scenario, tmp_path):
    rep = harness.run(scenario, SHORT_PARAMS, str(tmp_path), env={"FASTCKPT_TEST_SKIP_SYNC": skip})
    REPORTS.append(f"{rep.line()} [FASTCKPT_TEST_SKIP_SYNC={skip}: violations expected]")
    assert rep.violation_count > 0, f"with the {skip} sync skipped, no crash state lost a checkpoint"
    torn = [v for v in rep.violations if "found 'torn" in v]
    lost = [v for v in rep.violations if "found 'torn" not in v]
    if skip == "data":  # renamed and named durably, but its data was never synced
        assert torn, rep.violations
    else:  # a save returned, but its name was never made durable
        assert lost, rep.violations


@pytest.mark.parametrize("scenario,ranks", [("collective", "1,2"), ("full", "1")])
def test_per_client_model_finds_a_rank_that_skips_its_sync(tmp_path, scenario, ranks):
    """The collective save on a shared filesystem: each rank must make its own share durable.
    Ranks 1 and 2 skip their data fdatasync (FASTCKPT_TEST_SKIP_SYNC=data in those processes
    only; in the full-size save of sharded state, rank 1) while rank 0 syncs and commits: on one local filesystem rank 0's fdatasync would
    cover their writes, under crashfs's per-client model (scenarios.PER_CLIENT) their shares
    are lost and the renamed file is torn."""
    params = dict(SHORT_PARAMS, skip_sync_ranks=ranks)
    log = harness.record(scenario, params, str(tmp_path))
    rep = harness.check(scenario, params, log, str(tmp_path))
    REPORTS.append(f"{rep.line()} [ranks {ranks} skip their data sync: violations expected]")
    assert rep.violation_count > 0, f"with ranks {ranks} not syncing their shares, no crash state lost data"
    assert [v for v in rep.violations if "torn: " in v], rep.violations
    # what the per-client model adds: on one local filesystem, rank 0's later fdatasync covers them
    assert harness.check(scenario, params, log, str(tmp_path), per_client=False).violation_count == 0
