"""The peers of benchmarks/peers.py in bench_save_load.py's table at a tiny size: every row measured, checked
against the saved state (verified), its durability and CPU accounting said; and the harness's count of
helper processes' CPU, which their CPU-s/GB column depends on.

Structure only (speeds belong in benchmarks, not in timed tests)."""

import json
import os
import subprocess
import sys
import time

import pytest

import fastspawn
from paths import ROOT

REPO = str(ROOT)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402


def test_timed_counts_the_cpu_of_helper_processes():
    """A helper process that burns CPU inside the window is in cpu_s (and helpers_cpu_s), whether it is still
    alive at the end (a writer process) or was reaped in the window."""
    burn = [sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"]

    def reaped():
        subprocess.run(burn, check=True)

    t, _ = harness.timed(reaped)
    assert t["helpers_cpu_s"] >= 0.35 and t["cpu_s"] >= t["helpers_cpu_s"], t

    def alive():  # the helper's work done inside the window, the helper not reaped (a long-lived writer)
        p = subprocess.Popen(burn[:2] + [burn[2] + "\nimport sys\nsys.stdin.read()"], stdin=subprocess.PIPE)
        t0 = time.perf_counter()
        while harness._proc_cpu(p.pid) < 0.4 and time.perf_counter() - t0 < 30:
            time.sleep(0.01)
        assert p.pid in harness.descendants()
        return p

    t, (p, _, _) = harness.timed(alive)
    p.communicate(b"")
    assert t["helpers_cpu_s"] >= 0.35 and t["cpu_s"] >= t["helpers_cpu_s"], t


def test_fsync_tree(tmp_path):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "a.bin").write_bytes(b"x" * 10)
    (d / "b.bin").write_bytes(b"y")
    harness.fsync_tree(str(d))  # every file and directory, the directory and its parent: no error
    with pytest.raises(FileNotFoundError):
        harness.fsync_tree(str(tmp_path / "missing"))


def test_peer_rows_are_measured_and_verified(tmp_path):
    for mod in ("torch_checkpointing", "safetensors", "fastsafetensors", "runai_model_streamer"):
        pytest.importorskip(mod, reason=f"{mod} (a benchmark peer, requirements-dev.txt) is not installed")
    out = tmp_path / "sl.json"
    p = fastspawn.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_save_load.py"), "--size", "16M",
                       "--reps", "1", "--no-fio", "--no-touch-ref", "--only", "tc,tc_async,dcp_async,safetensors",
                       "--dir", str(tmp_path), "--json", str(out)],
                      capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["skipped"] == {}
    saves = {r["label"]: r for r in res["summary"]["rows_save"]}
    loads = {r["label"]: r for r in res["summary"]["rows_load"]}
    io = "buffered" if any("use_direct_io=True) fails here" in n for n in res["notes"]) else "O_DIRECT"
    want_saves = [f"torch-checkpointing sync ({io})+fsync", f"torch-checkpointing async ({io}, writer process)+fsync",
                  "dcp.async_save thread", "dcp.async_save process", "dcp.async_save thread + DefaultStager (cached)",
                  "safetensors save_file+fsync"]
    assert sorted(saves) == sorted(want_saves)
    for label, r in saves.items():
        assert r["gbps"] > 0 and r["cpu_per_gb"] > 0 and r["check"].startswith("verified"), (label, r)
    for label in want_saves[1:5]:  # the async rows: the caller's blocked time, shorter than the durable save
        assert 0 < saves[label]["blocked_s"], label
    want_loads = ["torch-checkpointing load (mmap), pages touched", "safetensors load_file, pages touched"] + [
        f"{x} (safetensors' file), pages touched" for x in (
            "fastckpt.safetensors.load_file", "fastsafetensors fastsafe_open(nogds=True)",
            "runai-model-streamer SafetensorsStreamer")]
    assert sorted(loads) == sorted(want_loads)
    for label, r in loads.items():
        assert r["gbps"] > 0 and r["check"] == "verified", (label, r)
    # the writer process's and the DCP daemon's CPU are in the rows' CPU figure
    recs = {r["label"]: r for r in res["records"]}
    for label in (want_saves[1], "dcp.async_save process"):
        assert recs[label]["extra"]["helpers_cpu_s"] > 0, label
        assert recs[label]["extra"]["helpers_peak_rss"] > 0, label
    assert any("never fsyncs" in n for n in res["notes"])
    assert [n for n in os.listdir(tmp_path) if n != "sl.json"] == []  # nothing left behind (probe, temp dirs)


def test_zipnn_benchmark_follows_the_standalone_contract(tmp_path):
    """bench_zipnn.py --quick: the JSON report.py renders, one verified row per data set, the break-even link
    speeds consistent with the measured sizes and times."""
    pytest.importorskip("zipnn", reason="zipnn (a benchmark peer, requirements-dev.txt) is not installed")
    out = tmp_path / "zipnn.json"
    p = fastspawn.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_zipnn.py"), "--quick", "--dir",
                       str(tmp_path), "--json", str(out)], capture_output=True, text=True, timeout=600,
                      env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert set(rep) >= {"title", "columns", "rows", "targets", "notes", "errors"} and rep["errors"] == []
    assert len(rep["rows"]) == 3 and all(len(r) == len(rep["columns"]) for r in rep["rows"])
    col = {c: i for i, c in enumerate(rep["columns"])}
    for row, (name, m) in zip(rep["rows"], rep["raw"].items()):
        assert row[0] == name and row[col["check"]] == "verified"
        assert 0 < m["zipped"] < m["raw"] and m["compress_s"] > 0 and m["decompress_s"] > 0
        pays = row[col["zipnn pays for uploads below MB/s"]]
        assert pays == pytest.approx((m["raw"] - m["zipped"]) / m["compress_s"] / 1e6, abs=0.1)
    bf16 = next(m for n, m in rep["raw"].items() if "as bfloat16" in n)
    assert bf16["zipped"] < 0.8 * bf16["raw"]  # trained-looking bf16: the exponent byte compresses
    assert any("scrambles the buffer" in n for n in rep["notes"])


def test_a_peer_that_cannot_be_imported_is_skipped_with_the_reason(monkeypatch, tmp_path):
    from benchmarks import peers

    for mod in ("fastsafetensors", "runai_model_streamer", "torch_checkpointing"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError, as when not installed
    skipped, notes = {}, []
    readers = peers.safetensors_readers(skipped)
    assert [k for k, _, _ in readers] == ["st_fastckpt"]
    assert set(skipped) == {"fastsafetensors", "runai"} and all("not importable" in v for v in skipped.values())
    assert peers.torch_checkpointing_methods(str(tmp_path), ["tc", "tc_async"], skipped, notes) == []
    assert "requirements-dev.txt" in skipped["tc"] and "requirements-dev.txt" in skipped["tc_async"]
