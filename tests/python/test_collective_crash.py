"""Ranks that die in the middle of a collective save (fastckpt/_collective.py):
what the survivors say matches what is under the final name. The random-kill
run is the crash driver's ``collective3`` kind (tests/crash/crash_driver.py,
short run in test_crash_short.py); these are its deterministic cases."""
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_collective_save import last_line, leftovers, reference_bytes, run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_rank_killed_after_rank0_committed(tmp_path):
    """Rank 1 dies entering the last collective, after rank 0 has everyone's shares:
    rank 0 commits, then loses the group. Its error must not say "nothing was
    committed" (the new checkpoint is there, complete); rank 2, which cannot know
    whether rank 0 got that far, says the file is the previous one or the new one."""
    out = tmp_path / "out"
    out.mkdir()
    path = out / "ckpt.pt"
    path.write_bytes(b"previous")
    res = run_ranks(tmp_path, 3, path, "mixed", "kill_commit")
    assert res[1][0] == -9, res[1]
    for r in (0, 2):
        assert res[r][0] == 0 and last_line(res[r][1]).startswith("ERR OSError: "), f"rank {r}: {res[r]}"
        assert str(path) in last_line(res[r][1]), res[r]
    line0, line2 = last_line(res[0][1]), last_line(res[2][1])
    assert "nothing was committed" not in line0 and f"the new checkpoint at '{path}' was committed" in line0, line0
    assert "nothing was committed" not in line2 and "either the previous checkpoint or the complete new one" in line2
    assert path.read_bytes() == reference_bytes(tmp_path, "mixed")
    assert leftovers(out) == []
