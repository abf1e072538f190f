"""The memory tier in one process: snapshots in real shared memory (a tmpfs), restored after a
restart, saved from the snapshot, kept through a crash in the middle of the next one, never used
when damaged, checked against the memory there is, persisted on SIGTERM, freed by close()."""
import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.memory import namespace_of
from engines import record_commits
from paths import ROOT
from sim_device import SimDevice
from states import assert_same


def make_state(seed: int = 0, n: int = 1 << 16):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g)
    return {"model": {"w": base, "view": base[10:20], "bf16": torch.randn(300, generator=g).to(torch.bfloat16),
                      "t": torch.randn(8, 6, generator=g).t(), "i": torch.arange(5)},
            "optim": {"state": {0: {"momentum": torch.randn(50, generator=g)}}, "lr": 0.1}, "step": seed}


@pytest.fixture
def memdir(tmp_path, monkeypatch):
    """A memory directory of this test's own on /dev/shm (real shared memory), removed after it."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    d = Path("/dev/shm") / f"fastckpt-test-{os.getpid()}-{tmp_path.name}"
    monkeypatch.setenv("FASTCKPT_MEMORY_DIR", str(d))
    yield d
    import shutil
    shutil.rmtree(d, ignore_errors=True)


def slot_files(mgr):
    own = Path(mgr._memory.own.path)
    return {p.name: (p.stat().st_ino, p.stat().st_size) for p in sorted(own.glob("slot*.pt"))}


def test_a_restarted_job_restores_its_newest_snapshot_bitwise_and_slots_are_reused(tmp_path, memdir):
    ckpt = tmp_path / "ckpt"
    mgr = fastckpt.CheckpointManager(ckpt, memory=fastckpt.MemoryTier(keep=2))
    for step in range(6):
        mgr.snapshot(step, make_state(step))
        mgr._memory.wait()
        if step == 1:
            first = slot_files(mgr)
    assert slot_files(mgr) == first  # the same two files, rewritten in place: no new memory per snapshot
    assert len(first) == 2
    # the snapshot is complete: a new manager (a restarted job) finds it; the disk holds nothing
    again = fastckpt.CheckpointManager(ckpt, memory=fastckpt.MemoryTier(keep=2))
    r = again.load_latest()
    assert r.step == 5 and r.path.startswith(str(memdir / namespace_of(str(ckpt))))
    assert_same(r.state, make_state(5), bitwise=True)
    # the restored tensors keep their pages: the next snapshots never change them
    again.snapshot(6, make_state(6))
    again.snapshot(7, make_state(7))
    again._memory.wait()
    assert_same(r.state, make_state(5), bitwise=True)
    assert again.load_latest().step == 7
    # into the state the job has (replicated mode's state=): the snapshot fills its tensors in place
    target = make_state(0)
    ptr = target["model"]["w"].data_ptr()
    r = again.load_latest(state=target)
    assert r.step == 7 and r.state is target and target["model"]["w"].data_ptr() == ptr
    assert_same(target, make_state(7), bitwise=True)
    again.close()
    assert not (memdir / namespace_of(str(ckpt))).exists()  # close() frees the tier's memory


def test_save_after_snapshot_writes_from_the_snapshot(tmp_path, memdir, monkeypatch):
    calls = []
    commits = record_commits(monkeypatch)

    class Counted:
        def __reduce__(self):
            calls.append(1)
            return (dict, ())

    mgr = fastckpt.CheckpointManager(tmp_path / "c", memory=fastckpt.MemoryTier())
    state = make_state(3)
    state["extra"] = Counted()
    mgr.snapshot(3, state)
    state["model"]["w"].add_(1)  # changed after the snapshot: the file holds the snapshot's bytes
    path = mgr.save(3, state)
    file = max(commits, key=lambda st: st["bytes"])  # the checkpoint's (and the latest pointer's)
    commits.clear()
    assert len(calls) == 1  # pickled once, for the snapshot
    want = make_state(3)
    want["extra"] = {}
    assert_same(fastckpt.load(path, verify=True, weights_only=False), want, bitwise=True)
    assert_same(torch.load(path, weights_only=False), want, bitwise=True)  # a stock torch.save file
    assert mgr.latest_name() == path.name
    if file["direct"]:  # the slot's large records written straight from its pages
        assert file["borrowed_bytes"] >= state["model"]["w"].nbytes - 2 * 4096, file
    mgr.save(4, state)  # another step: the state itself
    assert len(calls) == 2
    assert all(st["borrowed_bytes"] == 0 for st in commits)  # the caller's tensors are never lent
    mgr.close()


_CRASH = textwrap.dedent("""
    import os, signal, sys, torch, fastckpt
    sys.path.insert(0, {support!r}); sys.path.insert(0, {tests!r})
    from test_memory_tier import make_state
    from fastckpt.torchsave import writer
    mgr = fastckpt.CheckpointManager({ckpt!r}, memory=fastckpt.MemoryTier(keep=2))
    mgr.snapshot(1, make_state(1)); mgr.snapshot(2, make_state(2)); mgr._memory.wait()
    real = writer.FileSink.write_crc
    def write_crc(self, t, crc):
        self.f.write(memoryview(t.numpy())[: t.numel() // 2]); self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    writer.FileSink.write_crc = write_crc
    mgr.snapshot(3, make_state(3))
""")


def test_a_crash_during_a_snapshot_keeps_the_previous_one(tmp_path, memdir):
    ckpt = tmp_path / "c"
    code = _CRASH.format(support=str(ROOT / "tests" / "support"), tests=str(Path(__file__).parent), ckpt=str(ckpt))
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert p.returncode == -signal.SIGKILL
    mgr = fastckpt.CheckpointManager(ckpt, memory=fastckpt.MemoryTier(keep=2))
    r = mgr.load_latest()
    assert r.step == 2
    assert_same(r.state, make_state(2), bitwise=True)
    mgr.close()


def test_a_damaged_snapshot_is_never_used(tmp_path, memdir):
    ckpt = tmp_path / "c"
    mgr = fastckpt.CheckpointManager(ckpt, memory=fastckpt.MemoryTier(keep=2))
    mgr.snapshot(2, make_state(2))
    mgr.save(2, make_state(2))
    mgr.snapshot(3, make_state(3))
    mgr._memory.wait()
    tier = mgr._memory
    for rec in tier.own.records():  # a flipped byte in the middle of every snapshot
        p = Path(tier.own.archive(rec["slot"]))
        with open(p, "r+b") as f:
            f.seek(rec["storages"][0][0] + 5)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
    again = fastckpt.CheckpointManager(ckpt, memory=fastckpt.MemoryTier(keep=2))
    with pytest.warns(RuntimeWarning, match="CRC-32 mismatch") as rec:
        r = again.load_latest()
    assert any("step 3" in str(w.message) for w in rec) and any("step 2" in str(w.message) for w in rec)
    assert r.step == 2 and r.path == str(ckpt / again.name_for(2))  # the disk's checkpoint
    assert_same(r.state, make_state(2), bitwise=True)
    again.close()


def test_memory_never_holds_a_step_older_than_the_disk(tmp_path, memdir):
    ckpt = tmp_path / "c"
    mgr = fastckpt.CheckpointManager(ckpt, memory=fastckpt.MemoryTier())
    mgr.snapshot(4, make_state(4))
    plain = fastckpt.CheckpointManager(ckpt)  # another writer of the directory moved on
    plain.save(9, make_state(9))
    r = mgr.load_latest()
    assert r.step == 9 and r.path == str(ckpt / mgr.name_for(9))
    mgr.close()


def test_a_snapshot_of_an_earlier_step_starts_a_new_branch(tmp_path, memdir):
    mgr = fastckpt.CheckpointManager(tmp_path / "c", memory=fastckpt.MemoryTier(keep=3))
    for s in (5, 6, 7):
        mgr.snapshot(s, make_state(s))
    mgr.snapshot(3, make_state(3))
    mgr._memory.wait()
    assert mgr._memory.holdings()["own"] == [3]
    assert mgr.load_latest().step == 3
    mgr.close()


def test_the_memory_check_refuses_an_oversized_state_before_writing(tmp_path, memdir):
    small = tmp_path / "small"
    small.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    try:
        mgr = fastckpt.CheckpointManager(tmp_path / "c", memory=fastckpt.MemoryTier(keep=2, directory=str(small)))
        with pytest.raises(OSError) as e:
            mgr.snapshot(1, {"w": torch.zeros(1 << 20)})  # 4 MiB, twice: more than the 4 MiB there
        assert e.value.errno == errno.ENOMEM and e.value.filename == str(small)
        msg = str(e.value)
        assert re.search(r"need 8\.\d MiB .*2 x this rank's 4\.0 MiB state.*has 4\.0 MiB free", msg), msg
        assert "keep=" in msg and "FASTCKPT_MEMORY_DIR" in msg
        assert not list(Path(mgr._memory.own.path).glob("slot*"))  # nothing written
        mgr.snapshot(2, {"w": torch.zeros(1 << 10)})  # a state that fits goes ahead
        mgr.close()
    finally:
        subprocess.run(["umount", str(small)], check=True)


_SIGTERM = textwrap.dedent("""
    import os, signal, sys, time, torch, fastckpt
    sys.path.insert(0, {support!r}); sys.path.insert(0, {tests!r})
    from test_memory_tier import make_state
    mgr = fastckpt.CheckpointManager({ckpt!r}, memory=fastckpt.MemoryTier(persist_on=signal.SIGTERM))
    mgr.save(2, make_state(2))
    mgr.snapshot(3, make_state(3))
    mgr.snapshot(4, make_state(4))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("NOT KILLED")
""")


def test_sigterm_persists_the_newest_snapshot_then_ends_the_process(tmp_path, memdir):
    ckpt = tmp_path / "c"
    code = _SIGTERM.format(support=str(ROOT / "tests" / "support"), tests=str(Path(__file__).parent), ckpt=str(ckpt))
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120,
                       capture_output=True, text=True)
    assert p.returncode == -signal.SIGTERM, p.stderr  # the default handler ran after the persist
    assert "NOT KILLED" not in p.stdout
    mgr = fastckpt.CheckpointManager(ckpt)
    assert mgr.latest_name() == mgr.name_for(4)
    assert_same(fastckpt.load(mgr.path_for(4), verify=True), make_state(4), bitwise=True)
    assert not list(ckpt.glob("*fastckpt-tmp*"))


def test_device_state_is_snapshotted_through_the_staging_pipeline(tmp_path, memdir):
    host = make_state(1)
    with SimDevice(seed=3, max_delay=0.002) as sim:
        dev = {"model": {k: sim.tensor(v.contiguous(), 0) for k, v in host["model"].items()}, "step": 1}
        mgr = fastckpt.CheckpointManager(tmp_path / "c", memory=fastckpt.MemoryTier())
        mgr.snapshot(1, dev)
        mgr._memory.wait()
        sim.close()
        assert not sim.violations
    r = fastckpt.CheckpointManager(tmp_path / "c", memory=fastckpt.MemoryTier()).load_latest(map_location="cpu")
    assert_same(r.state["model"], {k: v.contiguous() for k, v in host["model"].items()}, bitwise=True)


def test_arguments(tmp_path, memdir):
    with pytest.raises(ValueError, match="keep"):
        fastckpt.MemoryTier(keep=0)
    with pytest.raises(ValueError, match="replicas"):
        fastckpt.MemoryTier(replicas=-1)
    with pytest.raises(TypeError, match="MemoryTier"):
        fastckpt.CheckpointManager(tmp_path / "a", memory=2)
    with pytest.raises(ValueError, match="memory tier"):
        fastckpt.CheckpointManager(tmp_path / "b").snapshot(1, {})
    tier = fastckpt.MemoryTier()
    fastckpt.CheckpointManager(tmp_path / "c", memory=tier)
    with pytest.raises(ValueError, match="already serves"):
        fastckpt.CheckpointManager(tmp_path / "d", memory=tier)
    tier.clear()


def test_close_puts_the_previous_signal_handler_back(tmp_path, memdir):
    def mine(signum, frame):
        pass
    old = signal.signal(signal.SIGUSR2, mine)
    try:
        mgr = fastckpt.CheckpointManager(tmp_path / "c", memory=fastckpt.MemoryTier(persist_on=signal.SIGUSR2))
        assert signal.getsignal(signal.SIGUSR2) is not mine
        mgr.close()
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        signal.signal(signal.SIGUSR2, old)


@pytest.mark.parametrize("record", [b"", b"{]", b'{"version": 1}', b"[1, 2]", b'"x"' * 10,
                                    b'{"version": 1, "step": 7, "rank": 0, "nbytes": 10, "crc": 0, "slot": 0, '
                                    b'"pkl": [0, 99999], "storages": [], "opts": {}}',
                                    b'{"version": 1, "step": -1, "rank": 0, "nbytes": 10, "crc": 0, "slot": 0, '
                                    b'"pkl": [0, 1], "storages": [[5, 1]], "opts": {}}'])
def test_a_hostile_commit_record_is_never_a_snapshot(tmp_path, memdir, record):
    ckpt = tmp_path / "c"
    mgr = fastckpt.CheckpointManager(ckpt, memory=fastckpt.MemoryTier(keep=2))
    mgr.save(1, make_state(1))
    mgr.snapshot(2, make_state(2))
    mgr._memory.wait()
    rec = mgr._memory.own.records()[0]
    Path(mgr._memory.own.record_path(rec["slot"])).write_bytes(record)
    again = fastckpt.CheckpointManager(ckpt, memory=fastckpt.MemoryTier(keep=2))
    r = again.load_latest()
    assert r.step == 1 and r.path == str(ckpt / again.name_for(1))  # the disk's: the record is ignored
    assert_same(r.state, make_state(1), bitwise=True)
    again.close()
