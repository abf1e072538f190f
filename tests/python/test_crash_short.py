"""A short run of the crash-consistency driver (tests/crash/crash_driver.py):
about 20 SIGKILLs, in one driver run, of fastckpt.save, async_save and
CheckpointManager.save (4 each), and at world size 2 (gloo) of dcp.save with
FastWriter, CheckpointManager.save in sharded mode and dcp.async_save with
FastWriter (3 each; both ranks or only one killed). Each kill is followed by
the driver's checks (previous checkpoint bitwise intact or the new one
complete and exact, `latest` names a complete checkpoint, leftovers cleaned by
a manager start, next save succeeds). Also the driver's stalled-peer check:
a rank stopped (SIGSTOP) in the middle of a sharded asynchronous save, and
the other rank must fail within its process group's timeout. The full run:
``python tests/crash/crash_driver.py --kills 300 --seed 7``."""
import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(ROOT, "tests", "crash", "crash_driver.py")
SINGLE = ("save", "async_save", "manager")
WORLD_2 = ("dcp2", "sharded2", "dcp_async2")
KILLS = {"save": 4, "async_save": 4, "manager": 4, "dcp2": 3, "sharded2": 3, "dcp_async2": 3}


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """One driver run over every kind this torch supports (one forkserver start for all)."""
    kinds = SINGLE + (WORLD_2 if dist.is_available() and dist.is_gloo_available() else ())
    kills = sum(KILLS[k] for k in kinds)  # the driver gives the first kinds the remainder: 4,4,4,3,3,3
    d = tmp_path_factory.mktemp("crash")
    r = subprocess.run([sys.executable, DRIVER, "--kills", str(kills), "--kinds", ",".join(kinds), "--seed", "11",
                        "--dir", str(d)], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"total kills={kills} violations=0" in out, out
    return out


def _assert_kinds(out, kinds):
    for kind in kinds:
        assert re.search(rf"^  {kind} +[0-9.]+ s kills= *{KILLS[kind]} ", out, re.M), out


def test_crash_short_single_file_and_manager(short_run):
    _assert_kinds(short_run, SINGLE)


def test_crash_short_world_size_2(short_run):
    """dcp.save, CheckpointManager (sharded) and dcp.async_save, 2 gloo ranks."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch has no gloo backend")
    _assert_kinds(short_run, WORLD_2)
    assert re.search(r"stalled_peer: rank 0 failed after [0-9.]+ s", short_run), short_run


def _driver():
    sys.path.insert(0, os.path.dirname(DRIVER))
    try:
        import crash_driver
    finally:
        sys.path.remove(os.path.dirname(DRIVER))
    return crash_driver


def test_driver_can_fail(tmp_path):
    """The driver's checks bite: a checkpoint changed behind its back is a violation."""
    drv = _driver().Driver(str(tmp_path), seed=0)
    drv.establish("save")
    path = tmp_path / "save" / "ckpt.pt"
    data = bytearray(path.read_bytes())
    data[-200] ^= 1  # damage the central directory of the "previous" checkpoint
    path.write_bytes(bytes(data))
    with pytest.raises(Exception):
        drv.check_file("save", 1, 2, killed=True)


@pytest.mark.parametrize("damage", [None, "latest_incomplete", "old_changed", "step_not_exact"])
def test_driver_can_fail_sharded(tmp_path, damage):
    """check_sharded2 bites: `latest` naming a step directory without .metadata,
    a changed previous step, a step that loads but holds other values. Undamaged,
    the same directory passes."""
    import warnings

    import fastckpt
    cd = _driver()
    drv = cd.Driver(str(tmp_path), seed=0)
    d = tmp_path / "sharded2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp without a process group
        mgr = fastckpt.CheckpointManager(d, keep_last=2, sharded=True)
        mgr.save(1, cd._expected_dcp(1))
        mgr.save(2, cd._expected_dcp(3 if damage == "step_not_exact" else 2))
    drv.prev["sharded2"] = (1, cd._tree_hash(d / "step_00000001"))
    assert (d / "latest").read_text() == "step_00000002\n"
    if damage == "latest_incomplete":
        (d / "step_00000002" / ".metadata").unlink()
    elif damage == "old_changed":
        shard = d / "step_00000001" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[-100] ^= 1
        shard.write_bytes(bytes(data))
    if damage is None:
        assert drv.check_sharded2("sharded2", 1, 2, killed=False) == "new_complete"
    else:
        with pytest.raises(AssertionError):
            drv.check_sharded2("sharded2", 1, 2, killed=True)
