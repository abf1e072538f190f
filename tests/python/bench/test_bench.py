"""`fastckpt bench` (benchmarks/bench_quick.py, bench_tune.py, harness.py, workload.py) and the report
assembler (benchmarks/report.py).

Structure only: tiny sizes, one repetition, no figure is compared with a speed (speeds belong in
benchmarks, not in timed tests); every measured figure must merely be positive.
"""

import argparse
import importlib.util
import json
import math
import os
import shutil

import subprocess
import sys

import pytest

import fastckpt

from paths import ROOT

REPO = str(ROOT)
if REPO not in sys.path:  # the checkout's benchmarks package (not part of the installed fastckpt)
    sys.path.insert(0, REPO)

from benchmarks import bench_quick, bench_tune, harness, workload  # noqa: E402
from fastckpt.cli import command as cli  # noqa: E402
import fastspawn  # noqa: E402


def _args(*argv):
    p = argparse.ArgumentParser()
    bench_quick.add_arguments(p)
    return p.parse_args([str(a) for a in argv])


def _strict_json(text):
    def no_nan(x):
        raise ValueError(f"not strict JSON: {x}")
    return json.loads(text, parse_constant=no_nan)


def _leftovers(d):
    return [n for n in os.listdir(d) if n.startswith(".fastckpt-bench-")]


def test_parse_and_format_size():
    assert harness.parse_size("2G") == 2 << 30
    assert harness.parse_size("512M") == 512 << 20
    assert harness.parse_size("1.5GiB") == 3 << 29
    assert harness.parse_size("65536") == 65536
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        harness.parse_size("two gigs")
    with pytest.raises(argparse.ArgumentTypeError, match="too small"):
        harness.parse_size("1K")
    assert harness.fmt_size(8 << 20) == "8M"
    assert harness.fmt_size(3 << 30) == "3G"
    assert harness.fmt_size(1000) == "1000"


def test_defaults():
    a = _args()
    assert (a.dir, a.size, a.reps, a.json, a.tune) == (".", 2 << 30, None, None, False)
    assert _args("d", "--json").json == "-" and _args("d", "--json", "r.json").json == "r.json"


def test_arguments_beside_a_common_quiet_option():
    # the fastckpt command gives every subcommand -q/--quiet (and -v) through a parent parser
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true")
    common.add_argument("-v", "--verbose", action="count", default=0)
    p = argparse.ArgumentParser(parents=[common])
    bench_quick.add_arguments(p)
    a = p.parse_args(["/x", "-q", "--tune"])
    assert (a.dir, a.quiet, a.tune) == ("/x", True, True)


def test_quick(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_quick.run(_args(tmp_path, "--size", "16M", "--reps", "1", "--json", out, "-q")) == 0
    res = _strict_json(out.read_text())
    assert res["kind"] == "fastckpt-bench"
    for k in ("machine", "state_dict", "args", "cache", "summary", "records", "notes", "errors", "seconds"):
        assert k in res, k
    assert res["errors"] == []
    m = res["machine"]
    assert m["nproc"] >= 1 and m["fstype"] and m["torch"] and m["fastckpt"] and m["date"]
    have_fio = shutil.which("fio") is not None
    assert res["args"]["fio"] == have_fio
    payload = res["state_dict"]["bytes"]
    assert 12 << 20 < payload < 20 << 20
    for op in ("save", "load"):
        rows = {r["method"]: r for r in res["summary"][op]}
        assert set(rows) == ({"disk", "fastckpt", "torch"} if have_fio else {"fastckpt", "torch"})
        for key, r in rows.items():
            assert r["n"] == 1
            assert r["gbps"] > 0 and r["gbps_min"] <= r["gbps"] <= r["gbps_max"]
            assert r["cpu_s_per_gb"] >= 0
            if key != "disk":
                assert r["peak_rss_mb"] > 0
                if have_fio:
                    assert r["x_disk"] == pytest.approx(r["gbps"] / res["summary"][f"disk_{op}_gbps"])
        assert rows["fastckpt"]["label"] == f"fastckpt.{op}"
        if op == "load":
            assert rows["fastckpt"]["verified"] is True and rows["torch"]["verified"] is True
    assert len(res["records"]) == 4 + (4 if have_fio else 0)  # 2 methods x save+load, 2 fio points x write+read
    if not have_fio:
        assert any("fio is not installed" in n for n in res["notes"])
    text = capsys.readouterr().out
    assert "| save | fastckpt.save" in text and "| load | torch.load" in text and "x disk" in text
    assert _leftovers(tmp_path) == []


def test_tune_tiny_grid(tmp_path, capsys):
    grid = "uring:1M:4:4,threads:1M:4:4:2"
    assert bench_quick.run(_args(tmp_path, "--tune", "--grid", grid, "--size", "16M", "--reps", "1", "--no-fio",
                            "--json", "-q")) == 0  # --json without PATH: JSON on stdout
    res = _strict_json(capsys.readouterr().out)
    assert res["kind"] == "fastckpt-bench-tune"
    labels = [c["label"] for c in res["configs"]] + list(res["failed"])
    assert len(labels) == 3  # the grid, plus the current settings (not in it)
    assert sum(c["default"] for c in res["configs"]) == 1
    for c in res["configs"]:
        assert c["save_gbps"] > 0 and c["load_gbps"] > 0
        assert min(c["save_gbps"], c["load_gbps"]) <= c["combined_gbps"] <= max(c["save_gbps"], c["load_gbps"])
    assert [c["combined_gbps"] for c in res["configs"]] == sorted((c["combined_gbps"] for c in res["configs"]),
                                                                 reverse=True)
    assert res["best"] == res["configs"][0]
    assert res["env"] and all(e.startswith("FASTCKPT_") and "=" in e for e in res["env"])
    assert res["significant"] is None  # one repetition: no noise estimate
    # the printed override line is valid Python for fastckpt.knobs
    assert res["override"].startswith("fastckpt.knobs.override(")
    with eval(res["override"], {"fastckpt": fastckpt}):  # noqa: S307
        cfg = fastckpt.knobs.as_dict()
        for line in res["env"]:
            name, value = line.split("=", 1)
            knob = next(k for k, v in bench_tune.ENV.items() if v == name)
            want = harness.parse_size(value) if knob == "buffer_size" else value
            assert str(cfg[knob]) == str(want)
    assert _leftovers(tmp_path) == []


def test_tune_text_output(tmp_path, capsys):
    assert bench_quick.run(_args(tmp_path, "--tune", "--grid", "threads:1M:4:4:2", "--size", "8M", "--reps", "1",
                            "--no-fio", "-q")) == 0
    text = capsys.readouterr().out
    assert "export FASTCKPT_" in text and "fastckpt.knobs.override(" in text and "save+load GB/s" in text


def test_cannot_run_here(tmp_path, capsys):
    assert bench_quick.run(_args(tmp_path / "missing", "--size", "16M", "-q")) == 2
    assert "not a directory" in capsys.readouterr().err
    assert bench_quick.run(_args(tmp_path, "--size", "1T", "-q")) == 2
    assert "not enough" in capsys.readouterr().err
    assert bench_quick.run(_args(tmp_path, "--tune", "--grid", "uring:8M:8", "-q")) == 2
    assert "--grid" in capsys.readouterr().err
    assert _leftovers(tmp_path) == []


def test_build_state_dict_scales():
    sd = workload.build_state_dict(8 << 20)
    info = workload.describe_sd(sd)
    assert 6 << 20 < info["bytes"] < 10 << 20 and info["tensors"] > 1000
    assert workload.compare(sd, workload.build_state_dict(8 << 20)) == []
    other = workload.build_state_dict(8 << 20, seed=1)
    assert workload.compare(sd, other)  # a different state dict is told apart


# ----------------------------------------------------------------------------- the command over the harness

def test_command_runs_the_checkouts_harness(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["bench", str(tmp_path), "--size", "8M", "--reps", "1", "--no-fio", "--no-torch", "-q",
                     "--json", str(out)]) == 0
    res = _strict_json(out.read_text())
    assert res["kind"] == "fastckpt-bench" and res["errors"] == []
    assert [r["method"] for r in res["summary"]["load"]] == ["fastckpt"]
    assert "| load | fastckpt.load" in capsys.readouterr().out
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("argv", [["bench", "{d}", "--size", "8M"], ["bench", "--size", "8M", "{d}"], ["bench"]])
def test_command_without_a_source_checkout(tmp_path, monkeypatch, capsys, argv):
    # an installed package: nothing beside it but site-packages; the command says where the harness is
    monkeypatch.setattr(cli, "_source_root", lambda: str(tmp_path))
    assert cli.main([a.format(d=tmp_path) for a in argv]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert "source checkout" in err and "benchmarks/bench_quick.py" in err, err
    assert "Traceback" not in err


def test_the_runtime_package_holds_no_harness():
    pkg = os.path.dirname(fastckpt.__file__)
    assert not os.path.exists(os.path.join(pkg, "_bench.py"))
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name)) as f:
                text = f.read()
            for line in text.splitlines():
                assert not line.lstrip().startswith(("import benchmarks", "from benchmarks")), (name, line)


# ----------------------------------------------------------------------------- the report assembler

def _report_module():
    spec = importlib.util.spec_from_file_location("fastckpt_bench_report", os.path.join(REPO, "benchmarks",
                                                                                         "report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(label, key, op, gbps, disk, cpu=0.5, rss=100.0, check="verified", blocked=math.nan, dev_x=math.nan):
    return {"label": label, "key": key, "op": op, "n": 3, "gbps": gbps, "lo": gbps * 0.9, "hi": gbps * 1.1,
            "x_fast": math.nan, "x_disk": gbps / disk, "x_disk_paired": gbps / disk, "cpu_per_gb": cpu,
            "machine_per_gb": cpu * 2, "rss_mb": rss, "pool_mb": 10.0, "file_mb": 100.0, "check": check,
            "blocked_s": blocked, "dev_x": dev_x}


def _fake_save_load(size):
    f = size / (1 << 30)  # figures that grow with the size, as on a real disk
    dw, dr = 2.0 + f, 2.5 + f
    saves = [_row("fio bs=8M qd=8", "fio", "save", dw, dw, rss=math.nan, check=""),
             _row("fastckpt.save", "fastckpt", "save", 1.9 + f, dw, cpu=0.3, check="verified (by load)"),
             _row("fastckpt.async_save", "async", "save", 1.8 + f, dw, blocked=0.2),
             _row("torch.save+fsync", "torch", "save", 0.4, dw, cpu=2.0, check="verified (by load)"),
             _row("DCP FileSystemWriter t=1", "dcp", "save", 0.9, dw),
             _row("DCP FileSystemWriter t=2", "dcp", "save", 1.1, dw, check="verified (by load)"),
             _row("safetensors save_file+fsync", "safetensors", "save", 1.5, dw)]
    loads = [_row("fio bs=8M qd=8", "fio", "load", dr, dr, rss=math.nan, check=""),
             _row("fastckpt.load", "fastckpt", "load", 1.7 + f, dr, dev_x=1.004),
             _row("torch.load", "torch", "load", 1.0, dr),
             _row("DCP FileSystemReader", "dcp", "load", 0.8, dr),
             _row("(ref) fresh memory: empty+fill_", "ref", "load", 3.0, dr, check="")]
    return {"args": {"size": size, "reps": 3}, "state_dict": {"tensors": 1172, "bytes": int(size * 1.02)},
            "summary": {"rows_save": saves, "rows_load": loads, "disk_save_gbps": dw, "disk_load_gbps": dr,
                        "disk_save_point": "fio bs=8M qd=8", "disk_load_point": "fio bs=8M qd=8"},
            "load_label_of": {"fastckpt.save": "fastckpt.load", "torch.save+fsync": "torch.load",
                              "DCP FileSystemWriter t=2": "DCP FileSystemReader",
                              "safetensors save_file+fsync": "safetensors load"},
            "skipped": {"deepspeed": "not installed here"}, "notes": ["a note"], "errors": [],
            "drop_caches_error": None, "context": {"safetensors": "0.0-test", "load_avg": [0.1, 0.1, 0.1]}}


def test_report_assembler(tmp_path):
    pytest.importorskip("matplotlib")
    report = _report_module()
    raw = tmp_path / "raw"
    raw.mkdir()
    runs = []
    for size in (256 << 20, 1 << 30, 4 << 30):
        tag = harness.fmt_size(size)
        (raw / f"save_load-{tag}.json").write_text(json.dumps(_fake_save_load(size)))
        (raw / f"save_load-{tag}.md").write_text("raw\n")
        runs.append({"size": size, "json": f"raw/save_load-{tag}.json", "md": f"raw/save_load-{tag}.md", "exit": 0,
                     "seconds": 60.0})
    runs.append({"size": 8 << 30, "json": "raw/save_load-8G.json", "md": "raw/save_load-8G.md", "exit": 1,
                 "last_line": "not enough memory: about 30 GB needed"})
    tune = {"args": {"reps": 2}, "seconds": 100.0, "state_dict": {"bytes": 1 << 30}, "failed": {},
            "configs": [{"label": "uring 16M x 8 buffers, depth 8", "knobs": {}, "save_gbps": 2.0, "load_gbps": 2.2,
                         "combined_gbps": 2.1, "save_cpu_s_per_gb": 0.1, "load_cpu_s_per_gb": 0.1, "default": False},
                        {"label": "uring 8M x 8 buffers, depth 8", "knobs": {}, "save_gbps": 1.9, "load_gbps": 2.1,
                         "combined_gbps": 2.0, "save_cpu_s_per_gb": 0.1, "load_cpu_s_per_gb": 0.1, "default": True}],
            "env": ["FASTCKPT_BUFFER_SIZE=16M"], "override": "fastckpt.knobs.override(buffer_size=16 << 20)",
            "gain_over_default": 0.05, "significant": False}
    tune["best"] = tune["configs"][0]
    (raw / "tune.json").write_text(json.dumps(tune))
    meta = {"runs": runs, "deepspeed": "not run (test)", "extras": {},
            "tune": {"json": "raw/tune.json", "md": "raw/tune.md", "exit": 0, "seconds": 100.0}}
    machine = harness.machine_info(str(tmp_path))
    settings = {"sizes": "256M,1G,4G,8G", "reps": 3, "command": "make bench", "seconds": 1200.0}
    (raw / "meta.json").write_text(json.dumps({"meta": meta, "machine": machine, "settings": settings}))

    assert report.main(["--assemble-only", "--out", str(tmp_path)]) == 1  # the 8G run failed: said, exit 1
    md = (tmp_path / "REPORT.md").read_text()
    for s in ("## Machine", "## The disk's limits (fio)", "## Summary", "## 256 MiB", "## 1 GiB", "## 4 GiB",
              "## 8 GiB", "Not measured: no results (exit 1: not enough memory: about 30 GB needed)", "| **fastckpt.save / fastckpt.load** |",
              "| DCP FileSystemWriter t=2 / DCP FileSystemReader |", "| fastckpt.async_save |",
              "caller blocked 0.20 s", "| (ref) fresh memory: empty+fill_ |", "disk read 1.00x the tensor bytes", "not installed here",
              "export FASTCKPT_BUFFER_SIZE=16M", "within this run's noise", "![save_gbps](save_gbps.png)",
              machine["fstype"]):
        assert s in md, s
    # the summary's 4 GiB line: fastckpt.save 5.90 GB/s = 0.98 x the disk (6.0), 14.75 x torch.save
    assert "| 4 GiB | 5.90 | 0.98 | 14.75 |" in md
    for png in ("save_gbps.png", "load_gbps.png", "cpu_per_gb.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    res = _strict_json((tmp_path / "results.json").read_text())
    assert [e["size"] for e in res["sizes"]] == [256 << 20, 1 << 30, 4 << 30, 8 << 30]
    e = res["sizes"][2]
    assert e["disk"]["write_gbps"] == 6.0
    fast = next(r for r in e["rows"] if r["key"] == "fastckpt")
    assert fast["save"]["gbps"] == pytest.approx(5.9) and fast["load"]["label"] == "fastckpt.load"
    assert next(r for r in e["rows"] if r["key"] == "async")["blocked_s"] == 0.2
    assert res["tune"]["best"]["label"].startswith("uring 16M")


def test_charts_draw_what_their_legends_and_labels_say(tmp_path, monkeypatch):
    """A single-size run draws its disk limit (a dashed line through one point draws nothing), and the CPU
    chart puts every load bar under the reader's name and every save bar under the writer's."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    report = _report_module()
    size = 1 << 30
    tag = harness.fmt_size(size)
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / f"save_load-{tag}.json").write_text(json.dumps(_fake_save_load(size)))
    (raw / f"save_load-{tag}.md").write_text("raw\n")
    meta = {"runs": [{"size": size, "json": f"raw/save_load-{tag}.json", "md": f"raw/save_load-{tag}.md",
                      "exit": 0, "seconds": 60.0}], "deepspeed": "not run (test)", "extras": {}, "tune": None}
    settings = {"sizes": "1G", "reps": 3, "command": "make bench", "seconds": 60.0}
    (raw / "meta.json").write_text(json.dumps({"meta": meta, "machine": harness.machine_info(str(tmp_path)),
                                               "settings": settings}))
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    report.main(["--assemble-only", "--out", str(tmp_path)])
    by_title = {f.axes[0].get_title().split(" (")[0]: f.axes[0] for f in figs}
    want = {"durable save": 3.0, "cold load": 3.5}  # _fake_save_load(1 GiB): fio write 2+1, read 2.5+1
    for title, disk in want.items():
        handles, labels = by_title[title].get_legend_handles_labels()
        line = handles[next(i for i, lab in enumerate(labels) if lab.startswith("disk limit"))]
        ys = list(line.get_ydata())
        assert ys and all(y == pytest.approx(disk) for y in ys), (title, ys)
        assert len(ys) >= 2 or line.get_marker() not in (None, "None", "", " "), title  # visible
    ax = next(a for t, a in by_title.items() if t.startswith("CPU cost"))
    names = [t.get_text() for t in ax.get_yticklabels()]
    drawn = {}
    for container, op in zip(ax.containers, [lab for lab in ax.get_legend_handles_labels()[1]]):
        for bar in container:
            drawn[names[round(bar.get_y() + bar.get_height() / 2)]] = (op, bar.get_width())
    # every measured side has a bar under its own name, and nothing else has one
    assert drawn == {"fastckpt.save": ("save", 0.3), "fastckpt.async_save": ("save", 0.5),
                     "torch.save+fsync": ("save", 2.0), "DCP FileSystemWriter t=1": ("save", 0.5),
                     "DCP FileSystemWriter t=2": ("save", 0.5), "safetensors save_file+fsync": ("save", 0.5),
                     "fastckpt.load": ("load", 0.5), "torch.load": ("load", 0.5),
                     "DCP FileSystemReader": ("load", 0.5), "(ref) fresh memory: empty+fill_": ("load", 0.5)}, drawn


def _save_load_module():
    spec = importlib.util.spec_from_file_location("fastckpt_bench_save_load",
                                                  os.path.join(REPO, "benchmarks", "bench_save_load.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_size_targets_are_judged_on_their_figures():
    sl = _save_load_module()
    Row = sl.Row

    def row(label, key, op, gbps, cpu):
        return Row(label, key, op, 3, gbps, gbps, gbps, cpu_per_gb=cpu)
    rows = {"save": [row("fastckpt.save", "fastckpt", "save", 3.0, 0.10)],
            "load": [row(sl.LABEL_LOAD_VERIFY, "fastckpt", "load", 2.6, 0.25),
                     row(sl.LABEL_LOAD_NOVERIFY, "fastckpt_noverify", "load", 2.8, 0.15),
                     row(sl.LABEL_TORCH_MMAP, "torch_mmap", "load", 2.0, 0.25),
                     row(sl.LABEL_FASTREADER, "fastdcp", "load", 2.2, 0.3)]}
    summary = {"disk_load_gbps": 2.5}
    lines = sl.size_targets(rows, summary)
    got = {t["id"]: t for t in summary["size_targets"]}
    assert got["load_vs_torch_mmap"]["measured"] == pytest.approx(1.3) and got["load_vs_torch_mmap"]["met"]
    assert got["load_vs_fio"]["measured"] == pytest.approx(1.04) and got["load_vs_fio"]["met"]
    assert got["fastreader_vs_load"]["measured"] == pytest.approx(2.2 / 2.6)
    assert got["fastreader_vs_load"]["met"] is False
    assert got["save_cpu"]["met"] is True and got["load_cpu"]["met"] is False  # 0.25 s/GB > 0.2
    assert len(lines) == 5 and any("NOT MET" in l and "CPU-s/GB <= 0.2" in l for l in lines)
    # a figure that was not measured is said, never judged
    summary = {}
    sl.size_targets({"save": [], "load": rows["load"][:1]}, summary)
    got = {t["id"]: t for t in summary["size_targets"]}
    assert got["load_vs_fio"]["met"] is None and got["save_cpu"]["measured"] is None


def test_report_states_targets_and_renders_standalone_scripts(tmp_path):
    report = _report_module()
    raw = tmp_path / "raw"
    raw.mkdir()
    sl = _fake_save_load(256 << 20)
    sl["summary"]["size_targets"] = [
        {"id": "load_vs_torch_mmap", "target": "fastckpt.load (verify on) vs torch.load(mmap=True) >= 1.3 x",
         "goal": 1.3, "unit": "x", "measured": 1.42, "met": True},
        {"id": "load_cpu", "target": "fastckpt.load (verify on) CPU-s/GB <= 0.2 s/GB", "goal": 0.2, "unit": "s/GB",
         "measured": 0.31, "met": False}]
    (raw / "save_load-256M.json").write_text(json.dumps(sl))
    (raw / "small.json").write_text(json.dumps({
        "title": "100,000 scalar tensors", "columns": ["method", "save s", "file MB"],
        "rows": [["fastckpt", 0.5, 30.0], ["torch", 0.6, 27.0]],
        "targets": [{"target": "file <= 1.3 x torch.save's", "measured": 1.11, "unit": "x", "met": True}],
        "notes": ["a small note"]}))
    meta = {"runs": [{"size": 256 << 20, "json": "raw/save_load-256M.json", "md": "raw/save_load-256M.md",
                      "exit": 0}],
            "deepspeed": "not run (test)", "extras": {}, "tune": None,
            "standalone": {"small": {"json": "raw/small.json", "md": "raw/small.md", "exit": 0, "seconds": 3.0},
                           "first_load": {"missing": "not run: benchmarks/bench_first_load.py is not in this "
                                                     "checkout"}}}
    settings = {"sizes": "256M", "reps": 3, "command": "make bench", "seconds": 60.0}
    (raw / "meta.json").write_text(json.dumps({"meta": meta, "machine": harness.machine_info(str(tmp_path)),
                                               "settings": settings}))
    assert report.main(["--assemble-only", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "REPORT.md").read_text()
    for s in ("## Targets", "| fastckpt.load (verify on) vs torch.load(mmap=True) >= 1.3 x | 256 MiB | "
              "1.42 x | **met** |", "| fastckpt.load (verify on) CPU-s/GB <= 0.2 s/GB | 256 MiB | 0.310 s/GB | "
              "**NOT met** |", "| file <= 1.3 x torch.save's | bench_small.py | 1.11 x | **met** |",
              "## 100,000 scalar tensors", "| fastckpt | 0.5 | 30 |", "- note: a small note",
              "bench_first_load.py is not in this checkout"):
        assert s in md, s
    res = _strict_json((tmp_path / "results.json").read_text())
    assert [x["name"] for x in res["standalone"]] == ["small", "first_load"]


def test_safetensors_benchmark_follows_the_standalone_contract(tmp_path):
    """bench_safetensors.py at a tiny size: its JSON is what report.py renders, its loads were checked
    against the saved state (an error otherwise), and a target is stated per pair."""
    pytest.importorskip("safetensors")
    out = tmp_path / "st.json"
    p = fastspawn.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_safetensors.py"), "--size", "8M",
                        "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = _strict_json(out.read_text())
    assert rep["errors"] == [] and [c for _, c in rep["raw"]["checked"]] == [True, True]
    # fio (where installed) at the points of whole blocks of the file
    fio = [f"disk: fio O_DIRECT read, {bs >> 20} MiB x {qd}" for bs, qd in ((1 << 20, 16), (8 << 20, 8))
           if shutil.which("fio") and rep["raw"]["file_bytes"]["ours"] >= bs]
    assert [r[0] for r in rep["rows"]] == ["safetensors.save_file+fsync", "fastckpt.safetensors.save_file",
                                           "safetensors.load_file, pages touched", "fastckpt.safetensors.load_file",
                                           "disk: engine read into resident memory"] + fio + [
                                           "memory: fresh pages of the load's size faulted in"]
    assert all(r[1] > 0 for r in rep["rows"])
    assert [t["target"].split(" >= ")[1].split("x")[0] for t in rep["targets"]] == ["2.0", "1.3"]
    assert all(isinstance(t["measured"], float) for t in rep["targets"])
    # the limit (the larger of the fastest disk row and the memory row) and what it allows: safetensors' load
    # median over it
    s = rep["raw"]["seconds"]
    limit = max(min(s[r[0]] for r in rep["rows"] if r[0].startswith("disk:")),
                s["memory: fresh pages of the load's size faulted in"])
    bound = round(s["safetensors.load_file, pages touched"] / limit, 2)
    assert any(n.startswith("the limit in this run:") and f"no loader of this file could be more than {bound}x"
               in n for n in rep["notes"]), rep["notes"]



def test_remote_benchmark_follows_the_standalone_contract(tmp_path):
    """bench_remote.py --quick against the real local S3 endpoint: the JSON report.py renders, one row per
    client and operation, the endpoint said in the notes."""
    pytest.importorskip("moto", reason="moto (the local S3 endpoint) is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    out = tmp_path / "remote.json"
    p = fastspawn.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_remote.py"), "--quick",
                        "--dir", str(tmp_path), "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = _strict_json(out.read_text())
    assert [r[0].split()[0] for r in rep["rows"]] == ["upload"] * 4 + ["download"] * 3 + ["restore"]
    split = rep["raw"]["split_bytes_per_process"]  # one upload, a share of its parts per process
    assert sum(split) == rep["raw"]["bytes"] and len(split) == 2 and min(split) > 0
    assert all(r[1] > 0 and r[2] > 0 for r in rep["rows"]) and "moto" in rep["notes"][0]
    assert rep["errors"] == [] and rep["raw"]["bytes"] >= 32 << 20


def test_first_load_benchmark_reports_async_saves_return_and_durable_apart(tmp_path):
    """bench_first_load.py at one size and one process per operation: async_save has a row until its
    future is done and one until the call returned, which cannot be the longer of the two."""
    out = tmp_path / "first.json"
    p = fastspawn.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_first_load.py"), "--reps", "1",
                       "--sizes", "400K", "--modes", "fastckpt.async_save,torch.save", "--dir", str(tmp_path),
                       "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = _strict_json(out.read_text())
    rows = {r[0]: r for r in rep["rows"]}
    assert set(rows) == {"fastckpt.async_save", "fastckpt.async_save, returned", "torch.save"}
    durable, returned = rows["fastckpt.async_save"], rows["fastckpt.async_save, returned"]
    for col in (2, 3):  # first and second call, ms
        assert 0 < float(returned[col]) <= float(durable[col])
    assert returned[5].endswith("x") and returned[6] == "torch.save"
    assert any("returned" in n for n in rep["notes"])
