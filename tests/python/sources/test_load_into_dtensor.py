"""fastckpt.load_into of full-size files into DTensor targets on a CPU gloo mesh, at 2 and 4 ranks:
each rank reads only its own shards (about 1/W of the sharded tensors' bytes) and its local shard
equals its slice of the full tensor (the checks are in tests/support/workers/load_into_worker.py)."""
import sys

import pytest

from dist_launch import ranks, report
from paths import WORKERS

sys.path.insert(0, str(WORKERS))
import load_into_worker  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("load_into")
    load_into_worker.write_files(str(d))
    return d


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_reads_its_own_shards(files, world):
    res = ranks(WORKERS / "load_into_worker.py", files, world=world, timeout=180)
    assert all(r.returncode == 0 for r in res), report(res)
    for r, out in enumerate(res):
        assert f"OK load_into rank {r}" in out.stdout, report(res)
