"""benchmarks/bench_training.py (the stall benchmark) at a tiny size follows report.py's STANDALONE contract:
a row per mode with positive figures, each mode's checkpoint read back bitwise, its targets, a PNG chart, and nothing
left behind in --dir or /dev/shm."""
import glob
import json
import os
import sys

import fastspawn  # noqa: E402
from paths import ROOT

REPO = str(ROOT)
MODES = ["none", "torch.save + fsync", "fastckpt.save", "fastckpt.async_save",
         "fastckpt.async_save, background staging (the default: written from the tensors when the last save was "
         "written before its fence, else copied)",
         "fastckpt.async_save, background staging, every tensor copied (knob async_write_through=0)",
         "fastckpt.async_save, background staging, written from the tensors until the fence (knob async_write_through=1)",
         "fastckpt.async_save, background staging, 40% of the bytes copied by the call, the rest by the staging thread "
         "(knob async_caller_copy)",
         "memory tier snapshot",
         "dcp.async_save (FileSystemWriter)", "torch_checkpointing async"]
TARGETS = ["fastckpt.async_save blocked <= 5% of time-to-durable",
           "fastckpt.async_save blocked <= 1.2x a plain copy of the state into warm memory",
           "fastckpt.async_save(background) blocked <= 5% of time-to-durable",
           "fastckpt.async_save(background) blocked <= 1.2x a plain copy of the state into warm memory",
           "fastckpt.async_save(background-copy) blocked <= 5% of time-to-durable",
           "fastckpt.async_save(background-copy) blocked <= 1.2x a plain copy of the state into warm memory",
           "fastckpt.async_save(background-through) blocked <= 5% of time-to-durable",
           "fastckpt.async_save(background-through) blocked <= 1.2x a plain copy of the state into warm memory",
           "fastckpt.async_save(background-split) blocked <= 5% of time-to-durable",
           "fastckpt.async_save(background-split) blocked <= 1.2x a plain copy of the state into warm memory",
           "fastckpt.async_save interference window <= 1.1",
           "fastckpt.async_save(background) interference window <= 1.1",
           "fastckpt.async_save(background-copy) interference window <= 1.1",
           "fastckpt.async_save(background-through) interference window <= 1.1",
           "fastckpt.async_save(background-split) interference window <= 1.1",
           "memory.snapshot interference window <= 1.1"]


def _shm():
    # the memory tier mode's directory (other benchmarks' tests, running beside this one, have their own)
    return set(glob.glob("/dev/shm/fastckpt-bench-stall-*"))


def test_stall_benchmark_follows_the_standalone_contract(tmp_path):
    disk, out = tmp_path / "disk", tmp_path / "stall.json"
    disk.mkdir()
    shm_before = _shm()
    p = fastspawn.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_training.py"), "--quick",
                       "--size", "8M", "--width", "1024", "--dir", str(disk), "--json", str(out)],
                      capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert set(rep) >= {"title", "columns", "rows", "targets", "notes", "errors", "images"}
    assert rep["errors"] == []
    cols = rep["columns"]
    assert cols[:7] == ["mode", "step ms", "blocked ms (steady)", "blocked % of durable", "staged ms", "durable ms",
                        "interference window"]
    assert len(rep["rows"]) == len(MODES)
    rows = {}
    for want, r in zip(MODES, rep["rows"]):  # a label may add what "durable" means for it, in parentheses
        assert r[0] == want or r[0].startswith(want + " ("), (want, r[0])
        rows[want] = dict(zip(cols, r))
    for name, r in rows.items():
        assert float(r["step ms"]) > 0 and 0 < float(r["goodput"]) <= 1.0, (name, r)  # steps' time / wall time
        if name == "none":
            assert r["blocked ms (steady)"] == "-" and r["interference window"] == "-"
            continue
        blocked, staged, durable = (float(r[k]) for k in ("blocked ms (steady)", "staged ms", "durable ms"))
        assert blocked > 0 and staged > 0 and durable >= staged, (name, r)
        assert float(r["first-save blocked ms"]) > 0, (name, r)
        assert float(r["background CPU-s per checkpoint"]) >= 0, (name, r)
        assert r["read back"] == "bitwise", (name, r)  # its last checkpoint, read back with its own loader
    for sync in ("torch.save + fsync", "fastckpt.save"):  # blocked until durable: the whole save
        assert 99.0 <= float(rows[sync]["blocked % of durable"]) <= 101.0, rows[sync]
        assert rows[sync]["interference window"] == "-"
    assert float(rows["fastckpt.async_save"]["blocked ms (steady)"]) < float(rows["fastckpt.async_save"]["durable ms"])
    assert [t["target"] for t in rep["targets"]] == TARGETS
    for t in rep["targets"][:10]:
        assert isinstance(t["measured"], float) and t["measured"] > 0 and isinstance(t["met"], bool), t
    for t in rep["targets"][10:]:  # no step may overlap a write this small: then not judged
        assert (t["measured"] is None and t["met"] is None) or (t["measured"] > 0 and isinstance(t["met"], bool)), t
    # Page-aligned tensors (the benchmark runs torch under THP_MEM_ALLOC_ENABLE=1): with the knob on,
    # background staging hands them to the writer (sent before the fence, or copied by it: steps this short
    # leave the writer little time); with the knob at 0, none; by default, none in the first save (it copies),
    # then as the last save's fence decides.
    assert any("THP_MEM_ALLOC_ENABLE=1" in n for n in rep["notes"]), rep["notes"]
    pct = {}
    for n in rep["notes"]:
        if n.startswith("fastckpt.async_save(background") and "straight from the tensors" in n:
            sent, fenced = (int(x.split("%")[0].split()[-1]) for x in n.split(", ")[:2])
            pct[n.split(":")[0]] = (sent, fenced)
    assert sum(pct["fastckpt.async_save(background-through)"]) > 0, pct
    assert pct["fastckpt.async_save(background-copy)"] == pct["fastckpt.async_save(background-split)"] == (0, 0), pct
    assert "fastckpt.async_save(background)" in pct, pct
    assert rep["images"] == ["stall.png"]
    assert (tmp_path / "stall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert p.stdout.startswith("### ") and "| " + " | ".join(cols) + " |" in p.stdout  # what report.py keeps (raw/)
    assert os.listdir(disk) == []
    assert _shm() == shm_before
