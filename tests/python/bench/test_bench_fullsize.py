"""benchmarks/bench_fullsize.py at a tiny size follows report.py's STANDALONE contract (one process,
then 1 and 2 ranks), measures every row, and leaves nothing behind on the disk."""
import json
import os
import sys

import fastspawn  # noqa: E402
from paths import ROOT

REPO = str(ROOT)


def test_fullsize_benchmark_follows_the_standalone_contract(tmp_path):
    out = tmp_path / "fullsize.json"
    p = fastspawn.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_fullsize.py"), "--size", "16M",
                       "--reps", "1", "--worlds", "1,2", "--dir", str(tmp_path), "--json", str(out)],
                      capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert set(rep) >= {"title", "columns", "rows", "targets", "notes", "errors"} and rep["errors"] == []
    names = [r[0] for r in rep["rows"]]
    for want in ("load_into (in place), cold", "torch.load + copy into the state, warm",
                 "W=2: fastckpt.save(group=) full-size, every rank", "W=2: gather to rank 0 + torch.save (+fsync)",
                 "W=2: fastckpt.load_into full-size file -> shards (cold)", "W=2: dcp.load (FileSystemReader, cold)"):
        assert want in names, names
    assert all(float(r[1]) > 0 for r in rep["rows"])
    wanted = {"single-process load_into <= 0.15 CPU-s/GB (cold)",
              "W=2: sharded load_into reads <= 1.1/W of the file per rank"}
    assert wanted <= {t["target"] for t in rep["targets"]}
    assert all(isinstance(t["measured"], float) and isinstance(t["met"], bool) for t in rep["targets"])
    assert os.listdir(tmp_path) == ["fullsize.json"]
