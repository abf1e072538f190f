"""fastckpt.integrations.torchtitan with torchtitan's own CheckpointManager, optimizer and LR scheduler
containers, FSDP2-sharded model, 2 gloo processes (tests/support/workers/torchtitan_dist.py).

torchtitan is optional: .ci/install_torchtitan.sh installs the tested version (0.3.0) with --no-deps
beside torch 2.13 (see docs/INTEGRATIONS.md); without it this test skips with the reason."""

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer",
                    reason="torchtitan is not installed (optional: .ci/install_torchtitan.sh installs 0.3.0)")
pytest.importorskip("torchtitan.components.optimizer",
                    reason="torchtitan's optimizer containers need spmd_types (.ci/install_torchtitan.sh)")

import dist_launch  # noqa: E402
from paths import WORKERS  # noqa: E402

WORKER = WORKERS / "torchtitan_dist.py"


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_torchtitan_checkpoints_through_fastckpt_resume_bitwise_both_ways(tmp_path):
    """One torchrun job of 2 processes: FastCheckpointManager's step folders are written by FastWriter
    and purged by keep_latest_k; torchtitan's stock CheckpointManager resumes from them and ours from
    the stock one's, bitwise against the uninterrupted run; async_mode="async" goes through fastckpt;
    a save that fails on one rank fails on both and leaves a folder that load() skips."""
    r = dist_launch.torchrun(WORKER, tmp_path, timeout=400)
    assert r.returncode == 0, dist_launch.report(r)
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")] == [
        "ok fastckpt-step-folders-and-purge", "ok ours-resumed-by-stock", "ok stock-resumed-by-ours",
        "ok ours-resumed-by-ours", "ok async-save", "ok failed-save-is-skipped-by-load"], dist_launch.report(r)
