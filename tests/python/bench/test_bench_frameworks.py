"""benchmarks/bench_frameworks.py at a tiny size follows report.py's STANDALONE contract."""
import json
import os
import subprocess
import sys

import pytest
import fastspawn  # noqa: E402
from paths import ROOT

REPO = str(ROOT)


def test_frameworks_benchmark_follows_the_standalone_contract(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    out = tmp_path / "fw.json"
    p = fastspawn.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_frameworks.py"), "--size", "8M",
                        "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert set(rep) >= {"title", "columns", "rows", "targets", "notes", "errors"} and rep["errors"] == []
    assert [r[0] for r in rep["rows"]] == ["Lightning TorchCheckpointIO+fsync", "Lightning FastCheckpointIO",
                                           "Accelerate save_state+fsync", "Accelerate save_state, use_fastckpt"]
    # same state written both ways: the byte counts agree within the formats' small differences
    sizes = [r[3] for r in rep["rows"]]
    assert sizes[0] > 6e6 and abs(sizes[1] - sizes[0]) < 0.05 * sizes[0] and abs(sizes[3] - sizes[2]) < 0.05 * sizes[2]
    assert [t["target"].split(" >= ")[1].split("x")[0] for t in rep["targets"]] == ["2.0", "2.0"]
    assert all(isinstance(t["measured"], float) for t in rep["targets"])
    assert os.listdir(tmp_path) == ["fw.json"]  # the temporary directory is gone
