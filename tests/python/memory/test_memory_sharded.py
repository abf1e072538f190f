"""The memory tier with sharded=True: each rank's DTensor shards snapshotted, restored in place
(tests/support/workers/memory_sharded_worker.py at world sizes 2 and 3, gloo, one node)."""
import os
import shutil
from pathlib import Path

import pytest

from dist_launch import ranks, report
from paths import WORKERS


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_state_snapshots_and_restores_in_place(tmp_path, world):
    mem = Path("/dev/shm") / f"fastckpt-test-{os.getpid()}-{tmp_path.name}"
    try:
        res = ranks(WORKERS / "memory_sharded_worker.py", tmp_path / "ckpt", world=world, timeout=240,
                    extra_env={"FASTCKPT_MEMORY_DIR": str(mem)})
        assert all(r.returncode == 0 and "OK" in r.stdout for r in res), report(res)
    finally:
        shutil.rmtree(mem, ignore_errors=True)
