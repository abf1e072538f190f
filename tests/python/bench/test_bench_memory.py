"""benchmarks/bench_memory.py at a tiny size follows report.py's STANDALONE contract (one process and
two torchrun agents as emulated nodes), and leaves nothing behind on the disk or in /dev/shm."""
import glob
import json
import os
import sys

import fastspawn  # noqa: E402
from paths import ROOT

REPO = str(ROOT)


def test_memory_benchmark_follows_the_standalone_contract(tmp_path):
    out = tmp_path / "mem.json"
    shm_before = set(glob.glob("/dev/shm/fastckpt-bench-*"))
    p = fastspawn.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_memory.py"), "--size", "16M",
                       "--snapshots", "3", "--dir", str(tmp_path), "--json", str(out)],
                      capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert set(rep) >= {"title", "columns", "rows", "targets", "notes", "errors"} and rep["errors"] == []
    names = [r[0] for r in rep["rows"]]
    for want in ("memory copy into warm memory (the limit)", "snapshot: steady (slot reused), blocked",
                 "fastckpt.async_save: blocked / until durable", "restore from memory (load_latest after a restart)",
                 "2 nodes: replication of a steady snapshot (both ways at once)"):
        assert want in names, names
    assert sum(n.startswith("2 nodes: restore after node 1 was lost") for n in names) == 2
    assert all(float(r[1]) > 0 for r in rep["rows"])
    assert [t["target"] for t in rep["targets"]] == ["snapshot blocking <= 1.5x a copy into warm memory",
                                                     "restore from memory >= 3x faster than from disk"]
    assert all(isinstance(t["measured"], float) and isinstance(t["met"], bool) for t in rep["targets"])
    assert os.listdir(tmp_path) == ["mem.json"]
    assert set(glob.glob("/dev/shm/fastckpt-bench-*")) == shm_before
