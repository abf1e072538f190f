"""A short run of the crash-consistency driver (tests/crash/crash_driver.py):
about 20 SIGKILLs of fastckpt.save, async_save, a 2-rank DCP save and
CheckpointManager.save, each followed by the driver's checks (previous
checkpoint bitwise intact or new one complete and verified, `latest` names a
complete checkpoint, leftovers cleaned, next save succeeds). The full run:
``python tests/crash/crash_driver.py --kills 200``."""
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(ROOT, "tests", "crash", "crash_driver.py")


def _run(tmp_path, kinds, kills, seed):
    r = subprocess.run([sys.executable, DRIVER, "--kills", str(kills), "--kinds", kinds, "--seed", str(seed),
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"total kills={kills} violations=0" in out, out
    return out


def test_crash_short_single_file_and_manager(tmp_path):
    out = _run(tmp_path, "save,async_save,manager", 15, 11)
    for kind in ("save", "async_save", "manager"):
        assert f"{kind:10s} kills=   5" in out, out


def test_crash_short_dcp_world_size_2(tmp_path):
    if not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    out = _run(tmp_path, "dcp2", 5, 12)
    assert "dcp2       kills=   5" in out, out


def test_driver_can_fail(tmp_path, monkeypatch):
    """The driver's checks bite: a checkpoint changed behind its back is a violation."""
    sys.path.insert(0, os.path.dirname(DRIVER))
    try:
        import crash_driver
    finally:
        sys.path.remove(os.path.dirname(DRIVER))
    drv = crash_driver.Driver(str(tmp_path), seed=0)
    drv.establish("save")
    path = tmp_path / "save" / "ckpt.pt"
    data = bytearray(path.read_bytes())
    data[-200] ^= 1  # damage the central directory of the "previous" checkpoint
    path.write_bytes(bytes(data))
    with pytest.raises(Exception):
        drv.check_file("save", 1, 2, killed=True)
