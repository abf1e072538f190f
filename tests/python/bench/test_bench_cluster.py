"""The cluster benchmark: benchmarks/bench_cluster.py (every rank), cluster_emulate.py
(N emulated nodes: loop filesystems + blkio cgroups, or plain directories) and cluster_report.py.

Structure and accounting only, no speed is compared with anything (speeds belong in the benchmark):
a world-size-2 run on plain directories where every mode either runs and loads back equal with its
bytes accounted for, or says why it is unavailable; the emulation's set-up and tear-down as root with
cgroup v1 blkio (skipped otherwise), also after an error and on SIGTERM.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from paths import ROOT

REPO = str(ROOT)
if REPO not in sys.path:  # the checkout's benchmarks package (not part of the installed fastckpt)
    sys.path.insert(0, REPO)

from benchmarks import cluster_emulate as ce  # noqa: E402
from benchmarks import cluster_report, harness  # noqa: E402

MiB = 1 << 20
MODES = ("rank0", "collective", "node", "fastdcp", "dcp")
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _env():
    return dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")


def _run_plain(tmp_path, world=2, size="4M", extra=()):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "cluster_emulate.py"), "--no-emulate", "--worlds",
           str(world), "--size", size, "--dir", str(tmp_path), "--out", str(out), "--timeout", "120", *extra]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), timeout=300)
    return p, out


@needs_gloo
def test_world2_plain_directories_every_mode_accounted_or_unavailable(tmp_path):
    p, out = _run_plain(tmp_path)
    assert p.returncode == 0, p.stdout[-4000:]
    run = json.loads((out / "w2.json").read_text())
    assert run["world"] == 2 and run["nodes"] == ["node0", "node1"] and run["rank_nodes"] == ["node0", "node1"]
    payload = run["state_dict"]["bytes"]
    assert payload > 1 * MiB
    assert [m["mode"] for m in run["modes"]] == list(MODES)
    on_disk = harness.mount_of(str(tmp_path)).get("fstype") not in ("tmpfs", "ramfs")
    checked = []
    for m in run["modes"]:
        if not m["available"]:
            assert m["reason"].startswith("unavailable: ") and len(m["reason"]) > 20, m
            continue
        save = m["save"]
        assert save["errors"] == [], m
        assert [r["rank"] for r in save["ranks"]] == [0, 1]
        assert all(r["seconds"] >= 0 and r["error"] is None for r in save["ranks"])
        ckpt = save["ckpt_bytes"]
        assert ckpt >= payload, (m["mode"], ckpt, payload)  # the checkpoint holds every tensor byte
        if on_disk:
            written = [r["write_bytes"] for r in save["ranks"]]
            # every byte of the checkpoint was written by some rank (page-granular, so at least that)
            assert sum(written) >= 0.95 * ckpt * (2 if m["mode"] == "node" else 1), (m["mode"], written, ckpt)
            if m["mode"] == "rank0":
                assert written[1] < 0.05 * ckpt, written  # rank 1 only waited
            if m["mode"] == "collective":
                assert min(written) > 0.25 * ckpt, written  # both ranks wrote a share of the one file
        if m["mode"] == "node":
            assert m["node_copy_bytes"][0] == m["node_copy_bytes"][1] == ckpt  # one complete copy per node
        load = m["load"]
        if load.get("skipped"):
            assert load["skipped"].startswith("unavailable: "), m
            continue
        assert load["errors"] == [] and load["check"] == "equal on every rank", m
        assert [r["check"] for r in load["ranks"]] == ["equal", "equal"]
        assert m["cache"].startswith("checkpoint files evicted"), m["cache"]
        if on_disk:
            # evicted from the page cache: every byte came from the disk at least once, to some rank
            assert sum(r["read_bytes"] for r in load["ranks"]) >= 0.9 * ckpt, (m["mode"], load["ranks"])
        checked.append(m["mode"])
    # what exists in every fastckpt since the collective save runs, whatever else is still missing
    assert {"rank0", "fastdcp", "dcp"} <= set(checked) | {m["mode"] for m in run["modes"] if m.get("load", {}).get(
        "skipped")}, checked
    md = (out / "CLUSTER.md").read_text()
    for label in cluster_report.SHORT.values():
        assert f"| {label} |" in md, label
    assert "## N = 2 node(s), 2 rank(s)" in md and "not emulated" in md
    assert json.loads((out / "cluster.json").read_text())["runs"][0]["world"] == 2
    # no checkpoint left behind in the benchmark's directories
    assert not [n for n in os.listdir(tmp_path) if n.startswith("fastckpt-cluster-plain-")]
    if not on_disk:
        pytest.skip("tmp_path is on tmpfs: /proc/self/io counts no bytes there, byte accounting not checked")


def _fake_run(world, **per_mode):
    def op(seconds, ckpt, per_rank, key):
        ranks = [{"rank": r, "seconds": seconds, key: b, "cgroup_" + key: b, "error": None} for r, b in
                 enumerate(per_rank)]
        return {"ranks": ranks, "slowest_s": seconds, "ckpt_bytes": ckpt, "ckpt_gbps": ckpt / seconds / 1e9,
                "all_ranks_bytes": sum(per_rank), "aggregate_gbps": sum(per_rank) / seconds / 1e9, "errors": [],
                "check": "equal on every rank"}
    modes = []
    for name in MODES:
        if name not in per_mode:
            modes.append({"mode": name, "available": False, "reason": "unavailable: not in this test"})
            continue
        (ss, sw), (ls, lr) = per_mode[name]
        modes.append({"mode": name, "available": True, "save": op(ss, 10**9, sw, "write_bytes"),
                      "load": op(ls, 10**9, lr, "read_bytes")})
    return {"world": world, "nodes": [f"node{i}" for i in range(world)], "link_mbps": 100.0, "modes": modes,
            "state_dict": {"bytes": 10**9, "tensors": 3}, "backend": "gloo", "emulation": {"description": "test"}}


def test_report_targets_and_report_py_section(tmp_path):
    """Targets from known figures (B = 100 MB/s = 0.1 GB/s, N = 4), and benchmarks/report.py's rendering."""
    g = 10**9
    run = _fake_run(4, rank0=((10.0, [g, 0, 0, 0]), (10.0, [g] * 4)),
                    collective=((2.6, [g // 4] * 4), (4.0, [g // 4] * 4)),
                    node=((10.0, [g] * 4), (3.0, [g // 4] * 4)))
    ts = cluster_report.targets([run])
    assert {x["at"] for x in ts} == {"N=4"}

    def t(start):
        found = [x for x in ts if x["target"].startswith(start)]
        assert len(found) == 1, (start, ts)
        return found[0]
    assert t("collective save")["met"] is True and t("collective save")["measured"] == pytest.approx(1 / 1.04)
    assert t("node-local save")["met"] is True and t("node-local save")["measured"] == pytest.approx(1.0)
    assert t("rank-0-only save")["met"] is True and t("rank-0-only save")["measured"] == pytest.approx(1.0)
    assert t("collective load reads")["measured"] == pytest.approx(1.0) and t("collective load reads")["met"]
    # 10 s (every rank reads the whole file) / 4 s (collective) = 2.5 < 0.8 x 4
    assert t("collective load >=")["measured"] == pytest.approx(2.5) and t("collective load >=")["met"] is False
    slow = _fake_run(4, collective=((5.2, [g // 4] * 4), (4.0, [g // 2, g // 4, g // 8, g // 8])))
    st = {x["target"][:22]: x for x in cluster_report.targets([slow])}
    assert st["collective save >= 0.9"]["met"] is False  # 0.48 x N*B
    reads = st["collective load reads "]
    assert reads["measured"] == pytest.approx(2.0) and reads["met"] is False  # rank 0 read half the file
    # every table row has the header's cells, an unavailable mode's and a skipped load's too
    run["modes"][2]["load"] = {"skipped": "unavailable: no group= (test)"}
    md = cluster_report.markdown([run])
    rows = [x for x in md if x.startswith("| ") and "N=4" not in x and "verdict" not in x]
    assert len(rows) == 1 + 2 + 2 + 2 + 1 + 1  # header, three modes' save+load, two unavailable modes
    assert {x.count(" | ") for x in rows} == {len(cluster_report.HEADER) - 1}, rows
    assert any("| node-local copies | load | unavailable: no group= (test) |" in x for x in rows)
    # report.py renders the standalone JSON cluster_emulate.py writes, with its chart
    raw = tmp_path / "raw"
    (raw / "cluster").mkdir(parents=True)
    (raw / "cluster" / "cluster_scaling.png").write_bytes(b"png")
    (raw / "cluster.json").write_text(json.dumps(cluster_report.standalone([run], "cluster/cluster_scaling.png",
                                                                           [])))
    meta = {"runs": [], "deepspeed": "not run (test)", "extras": {}, "tune": None,
            "standalone": {"cluster": {"json": "raw/cluster.json", "md": "raw/cluster.md", "exit": 0,
                                       "seconds": 1.0}}}
    (raw / "meta.json").write_text(json.dumps({"meta": meta, "machine": harness.machine_info(str(tmp_path)),
                                               "settings": {"sizes": "", "reps": 1, "command": "test"}}))
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import report
    assert report.main(["--assemble-only", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "REPORT.md").read_text()
    assert f"## {cluster_report.TITLE}" in md
    assert "![cluster_scaling](raw/cluster/cluster_scaling.png)" in md
    assert "| 4 | collective (shared file) | save | 2.60 |" in md
    assert "**NOT met**" in md and "collective load >= 0.8 x N times faster" in md
    assert "cluster" in report.OPT_IN  # minutes and root: only when asked for (make bench-cluster)


# ----------------------------------------------------------------------------- the emulation (root)

def _why_no_emulation():
    why = ce.why_not_emulated()
    if why is None and subprocess.run(["losetup", "-f"], capture_output=True).returncode:
        why = "no free loop device"
    return why


def _attached(images):
    out = subprocess.run(["losetup", "-l", "-n", "-O", "NAME,BACK-FILE"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if any(img in line for img in images)]


def _mounted(prefix):
    with open("/proc/self/mounts") as f:
        return [line for line in f if prefix in line]


def _assert_undone(emu, base, images, cgroups):
    assert _attached(images) == []
    assert _mounted(base) == []
    assert [c for c in cgroups if os.path.exists(c)] == []
    assert not os.path.exists(base)
    assert emu.loops == [] and emu.mounts == [] and emu.cgroups == []


def test_emulation_throttles_per_node_and_tears_down(tmp_path):
    why = _why_no_emulation()
    if why:
        pytest.skip(f"cannot emulate nodes here: {why}")
    bps = 50_000_000
    emu = ce.Emulation(str(tmp_path), nodes=2, fs_bytes=64 * MiB, link_bps=bps)
    with emu:
        base = emu.base
        images = [f["image"] for f in emu.fs.values()]
        cgroups = list(emu.cgroups)
        assert sorted(emu.fs) == ["node0", "node1", "shared"]
        for f in emu.fs.values():
            assert os.path.ismount(f["mount"])
        assert len(_attached(images)) == 3
        dio = subprocess.run(["losetup", "-l", "-n", "-O", "DIO", emu.fs["shared"]["dev"]], capture_output=True,
                             text=True).stdout.split()
        assert dio == ["1"], dio  # the loop device does direct I/O to its image
        for i in range(2):
            cg = emu.cgroup(i)
            for knob in ("read_bps_device", "write_bps_device"):
                lines = sorted(open(os.path.join(cg, "blkio.throttle." + knob)).read().split("\n"))
                want = sorted([f"{emu.fs['shared']['majmin']} {bps}", f"{emu.fs[f'node{i}']['majmin']} {bps}"])
                assert [x for x in lines if x] == want, (cg, knob, lines)
        # an O_DIRECT write from node 0's cgroup is charged to node 0's cgroup, on its own device
        target = os.path.join(emu.fs["node0"]["mount"], "f")
        procs = os.path.join(emu.cgroup(0), "cgroup.procs")
        r = subprocess.run(["sh", "-c", f'echo $$ > {procs} && exec dd if=/dev/zero of={target} bs=1M count=4 '
                                        f'oflag=direct status=none'], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        stats = open(os.path.join(emu.cgroup(0), "blkio.throttle.io_service_bytes")).read().split("\n")
        node0 = [int(x.split()[2]) for x in stats if x.startswith(emu.fs["node0"]["majmin"] + " Write")]
        assert node0 and node0[0] >= 4 * MiB, stats
        other = open(os.path.join(emu.cgroup(1), "blkio.throttle.io_service_bytes")).read().split("\n")
        assert not [x for x in other if x.startswith(emu.fs["node0"]["majmin"] + " Write") and int(x.split()[2])]
    _assert_undone(emu, base, images, cgroups)


def test_emulation_undone_after_an_error_inside_and_in_setup(tmp_path):
    why = _why_no_emulation()
    if why:
        pytest.skip(f"cannot emulate nodes here: {why}")
    emu = ce.Emulation(str(tmp_path), nodes=1, fs_bytes=32 * MiB, link_bps=10_000_000)
    with pytest.raises(RuntimeError, match="boom"):
        with emu:
            base, images, cgroups = emu.base, [f["image"] for f in emu.fs.values()], list(emu.cgroups)
            raise RuntimeError("boom")
    _assert_undone(emu, base, images, cgroups)
    # set-up failing half-way (the second filesystem cannot be made: too small for ext4) undoes the first
    emu = ce.Emulation(str(tmp_path), nodes=1, fs_bytes=32 * MiB, link_bps=10_000_000)
    real = emu._filesystem
    made = []

    def second_fails(name):
        if made:
            raise ce.EmulationError("injected: second filesystem")
        real(name)
        made.append(emu.fs[name]["image"])
    emu._filesystem = second_fails
    with pytest.raises(ce.EmulationError, match="injected"):
        with emu:
            pass
    assert made and _attached(made) == [] and _mounted(os.path.dirname(made[0])) == []
    assert not os.path.exists(os.path.dirname(made[0]))


@needs_gloo
def test_emulation_undone_on_sigterm(tmp_path):
    why = _why_no_emulation()
    if why:
        pytest.skip(f"cannot emulate nodes here: {why}")
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "cluster_emulate.py"), "--worlds", "2", "--size", "8M",
           "--dir", str(tmp_path), "--out", str(tmp_path / "out"), "--link-mbps", "5"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        seen = []
        deadline = time.monotonic() + 120
        for line in p.stderr:  # wait until the ranks are running inside the emulation
            seen.append(line)
            if "== world size 2" in line or time.monotonic() > deadline:
                break
        assert any("== world size 2" in x for x in seen), "".join(seen)
        base = [n for n in os.listdir(tmp_path) if n.startswith("fastckpt-cluster-emu-")]
        assert len(base) == 1
        cg = os.path.join(ce.BLKIO, f"fastckpt-cluster-emu-{p.pid}")
        assert os.path.isdir(cg)
        time.sleep(2)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert _mounted(str(tmp_path)) == []
    assert _attached([str(tmp_path)]) == []
    assert not os.path.exists(cg)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("fastckpt-cluster-emu-")]


def test_cannot_emulate_is_said_not_passed(tmp_path, monkeypatch, capsys):
    """Without root / blkio / loop devices: make bench-cluster exits 2 saying why; under report.py (--json)
    the section says 'not run' and why, with no rows and no verdicts."""
    monkeypatch.setattr(ce, "why_not_emulated", lambda: "not root (test)")
    assert ce.main(["--dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "cannot emulate nodes here: not root (test)" in capsys.readouterr().err
    js = tmp_path / "raw" / "cluster.json"
    js.parent.mkdir()
    assert ce.main(["--dir", str(tmp_path), "--json", str(js)]) == 0
    got = json.loads(js.read_text())
    assert got["rows"] == [] and got["targets"] == []
    assert got["notes"] == ["not run: cannot emulate nodes here: not root (test)"]
