"""A short run of the crash-consistency driver (tests/crash/crash_driver.py):
about 25 SIGKILLs, in one driver run, of fastckpt.save, async_save and
CheckpointManager.save and the manager with a memory tier (4 each), and at world size 2 (gloo) of dcp.save with
FastWriter, CheckpointManager.save in sharded mode and dcp.async_save with
FastWriter (3 each; both ranks or only one killed). Each kill is followed by
the driver's checks (previous checkpoint bitwise intact or the new one
complete and exact, `latest` names a complete checkpoint, leftovers cleaned by
a manager start, next save succeeds). Also the driver's stalled-peer check:
a rank stopped (SIGSTOP) in the middle of a sharded asynchronous save, and
the other rank must fail within its process group's timeout. A second, separate
driver run kills collective saves at world size 3 (``collective3``: one rank or
all three killed; survivors end on their own with an error naming the path;
leftovers removed by the next collective save; and one rank stopped with
SIGSTOP: the other two fail within a few times the group's timeout). The full runs:
``python tests/crash/crash_driver.py --kills 300 --seed 7`` and
``python tests/crash/crash_driver.py --kinds collective3 --kills 100 --seed 1`` (and ``manager_async3``)."""
import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist
import fastspawn  # noqa: E402
from paths import TESTS  # noqa: E402

DRIVER = str(TESTS / "crash" / "crash_driver.py")
SINGLE = ("save", "async_save", "manager", "memory")
WORLD_2 = ("dcp2", "sharded2", "dcp_async2")
KILLS = {"save": 4, "async_save": 4, "manager": 4, "memory": 4, "dcp2": 3, "sharded2": 3, "dcp_async2": 3}
COLLECTIVE_KILLS = 5


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """One driver run over every kind this torch supports (one forkserver start for all)."""
    kinds = SINGLE + (WORLD_2 if dist.is_available() and dist.is_gloo_available() else ())
    kills = sum(KILLS[k] for k in kinds)  # the driver gives the first kinds the remainder: 4,4,4,4,3,3,3
    d = tmp_path_factory.mktemp("crash")
    r = fastspawn.run([sys.executable, DRIVER, "--kills", str(kills), "--kinds", ",".join(kinds), "--seed", "11",
                        "--dir", str(d)], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"total kills={kills} violations=0" in out, out
    return out


@pytest.fixture(scope="module", params=["collective3", "manager_async3"])
def world3_run(request, tmp_path_factory):
    """A world-size-3 kind in a driver run of its own (its rounds are longer: three ranks, and a
    cleanup save after each round that leaves temporaries): fastckpt.save(group=), and the
    manager's collective async_save."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch has no gloo backend")
    kind = request.param
    d = tmp_path_factory.mktemp(kind)
    r = fastspawn.run([sys.executable, DRIVER, "--kills", str(COLLECTIVE_KILLS), "--kinds", kind,
                        "--seed", "5", "--dir", str(d)], capture_output=True, text=True, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"total kills={COLLECTIVE_KILLS} violations=0" in out, out
    return kind, out


def test_crash_short_world_size_3(world3_run):
    """At world size 3: no violation, no survivor hung, and beside a stopped rank the others
    failed (within a few times the group's timeout)."""
    kind, out = world3_run
    m = re.search(rf"^  {kind} +[0-9.]+ s kills= *{COLLECTIVE_KILLS} .*survivor finished/failed/hung: "
                  r"(\d+)/(\d+)/(\d+)\]", out, re.M)
    assert m, out
    assert int(m.group(3)) == 0 and int(m.group(1)) + int(m.group(2)) > 0, out
    assert re.search(rf"^  {kind} .*stalled_peer: survivors failed within [0-9.]+ s", out, re.M), out


def _assert_kinds(out, kinds):
    for kind in kinds:
        assert re.search(rf"^  {kind} +[0-9.]+ s kills= *{KILLS[kind]} ", out, re.M), out


def test_crash_short_single_file_and_manager(short_run):
    _assert_kinds(short_run, SINGLE)


def test_crash_short_world_size_2(short_run):
    """dcp.save, CheckpointManager (sharded) and dcp.async_save, 2 gloo ranks."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch has no gloo backend")
    _assert_kinds(short_run, WORLD_2)
    assert re.search(r"stalled_peer: rank 0 failed after [0-9.]+ s", short_run), short_run


def _driver():
    sys.path.insert(0, os.path.dirname(DRIVER))
    try:
        import crash_driver
    finally:
        sys.path.remove(os.path.dirname(DRIVER))
    return crash_driver


def test_driver_can_fail(tmp_path):
    """The driver's checks bite: a checkpoint changed behind its back is a violation."""
    drv = _driver().Driver(str(tmp_path), seed=0)
    drv.establish("save")
    path = tmp_path / "save" / "ckpt.pt"
    data = bytearray(path.read_bytes())
    data[-200] ^= 1  # damage the central directory of the "previous" checkpoint
    path.write_bytes(bytes(data))
    with pytest.raises(Exception):
        drv.check_file("save", 1, 2, killed=True)


@pytest.mark.parametrize("damage", [None, "latest_incomplete", "old_changed", "step_not_exact"])
def test_driver_can_fail_sharded(tmp_path, damage):
    """check_sharded2 bites: `latest` naming a step directory without .metadata,
    a changed previous step, a step that loads but holds other values. Undamaged,
    the same directory passes."""
    import warnings

    import fastckpt
    cd = _driver()
    drv = cd.Driver(str(tmp_path), seed=0)
    d = tmp_path / "sharded2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp without a process group
        mgr = fastckpt.CheckpointManager(d, keep_last=2, sharded=True)
        mgr.save(1, cd._expected_dcp(1))
        mgr.save(2, cd._expected_dcp(3 if damage == "step_not_exact" else 2))
    drv.prev["sharded2"] = (1, cd._tree_hash(d / "step_00000001"))
    assert (d / "latest").read_text() == "step_00000002\n"
    if damage == "latest_incomplete":
        (d / "step_00000002" / ".metadata").unlink()
    elif damage == "old_changed":
        shard = d / "step_00000001" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[-100] ^= 1
        shard.write_bytes(bytes(data))
    if damage is None:
        assert drv.check_sharded2("sharded2", 1, 2, killed=False) == "new_complete"
    else:
        with pytest.raises(AssertionError):
            drv.check_sharded2("sharded2", 1, 2, killed=True)


def _planted_temp(d, live: bool) -> str:
    """A temporary file of ckpt.pt as a save of this host leaves it: of a process that is
    gone (a leftover), or of this live process (never to be removed)."""
    import socket
    from fastckpt import _C
    pid = os.getpid()
    if not live:
        p = subprocess.Popen(["true"])
        p.wait()
        pid = p.pid
    name = f".ckpt.pt.fastckpt-tmp.{pid}.{_C.temp_host()}.0.0.abc"
    assert _C.parse_temp_name(name, "ckpt.pt") is not None, socket.gethostname()
    (d / name).write_bytes(b"x" * 5000)
    return name


@pytest.mark.parametrize("damage", [None, "old_changed", "torn", "other_state", "stray_name", "survivor_silent",
                                    "survivor_no_path", "survivor_says_nothing", "survivor_says_committed",
                                    "survivor_returned", "rank0_left_temp"])
def test_driver_can_fail_collective(tmp_path, damage):
    """check_collective3 bites: the previous checkpoint changed, a torn file or another
    state under the final name, a stray name beside it, and survivors whose ending does
    not match the file (ended without an error, an error that does not name the path,
    one that says nothing was committed when the new checkpoint is there or the
    reverse, one that returned while the previous checkpoint stayed). Undamaged, the
    same round passes. And rank 0 survived while a temporary file remains."""
    import fastckpt
    cd = _driver()
    drv = cd.Driver(str(tmp_path), seed=0)
    d = tmp_path / "collective3"
    path = d / "ckpt.pt"
    fastckpt.save(cd.collective_state(1), path)
    drv.prev["collective3"] = (1, cd._sha(path))
    new = damage not in ("old_changed", "survivor_returned", "survivor_says_committed")
    if new:
        fastckpt.save(cd.collective_state(3 if damage == "other_state" else 2), path)
    if damage == "old_changed":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1  # inside a tensor's data
        path.write_bytes(bytes(data))
    elif damage == "torn":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif damage == "stray_name":
        (d / "ckpt.pt.part").write_bytes(b"x")
    elif damage == "rank0_left_temp":  # rank 0 survived, yet a temporary file remains
        _planted_temp(d, live=False)
    p = str(path)
    err = {None: f"error OSError: [Errno 5] cannot save to {p!r}: ...; the new checkpoint at {p!r} was committed",
           "survivor_silent": "nothing (exit code 3)",
           "survivor_no_path": "error OSError: [Errno 5] a rank died; either the previous or the new one",
           "survivor_says_nothing": f"error OSError: [Errno 5] cannot save to {p!r}: ...; nothing was committed",
           "survivor_says_committed": f"error OSError: cannot save to {p!r}: the new checkpoint at {p!r} "
                                      "was committed (complete and durable)",
           "survivor_returned": "done"}
    msg = err.get(damage, err[None])
    drv.last_survivors = {1: (3, [msg] if msg.startswith(("error", "done")) else [])}
    if damage == "rank0_left_temp":
        drv.last_survivors[0] = (3, [err[None]])
    if damage is None:
        assert drv.check_collective3("collective3", 1, 2, killed=True) == "new_complete"
    else:
        why = {"old_changed": "neither the previous checkpoint nor a complete one|neither the old nor the new",
               "torn": "neither the previous checkpoint nor a complete one", "other_state": "neither the old nor",
               "stray_name": "unexpected names", "survivor_silent": "ended without raising",
               "survivor_no_path": "does not name", "survivor_says_nothing": "says nothing was committed",
               "survivor_says_committed": "says the new checkpoint was committed",
               "survivor_returned": "returned from the save", "rank0_left_temp": "rank 0 survived"}[damage]
        with pytest.raises(AssertionError, match=why):
            drv.check_collective3("collective3", 1, 2, killed=True)


CLEANUP_CHECK = """
import os, sys
sys.path.insert(0, sys.argv[1])
import crash_driver as cd
import fastckpt
root, name, live = sys.argv[2], sys.argv[3], sys.argv[4] == "1"
drv = cd.Driver(root, seed=0)
d = os.path.join(root, "collective3")
path = os.path.join(d, "ckpt.pt")
drv.prev["collective3"] = (1, cd._sha(path))
drv.last_survivors = {}
try:
    outcome = drv.check_collective3("collective3", 1, 2, killed=True)
except AssertionError as e:
    print("CHECK FAILED:", e)
else:
    print("CHECK PASSED:", outcome, drv.prev["collective3"][0], sorted(os.listdir(d)))
"""


@pytest.mark.parametrize("live", [False, True])
def test_driver_can_fail_collective_cleanup(tmp_path, live):
    """The cleanup check after a round with leftovers runs a real collective save
    (3 ranks, in a subprocess: the driver's forkserver must import it): a dead
    process's temporary file goes; one that the next save may not remove (a live
    process's) stays, and the driver reports it."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch has no gloo backend")
    import fastckpt
    cd = _driver()
    d = tmp_path / "collective3"
    d.mkdir()
    fastckpt.save(cd.collective_state(1), d / "ckpt.pt")
    name = _planted_temp(d, live)  # live: this pytest process, alive while the check runs
    r = fastspawn.run([sys.executable, "-c", CLEANUP_CHECK, os.path.dirname(DRIVER), str(tmp_path), name,
                        "1" if live else "0"], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    if not live:
        assert "CHECK PASSED: old_intact 2 ['ckpt.pt']" in out, out
        assert not (d / name).exists()
    else:
        assert "CHECK FAILED: the next collective save left temporaries" in out, out
        assert (d / name).exists()


BROKEN_ROUND = """
import os, sys
sys.path.insert(0, sys.argv[1])
import crash_driver as cd
drv = cd.Driver(sys.argv[2], seed=0)
drv.establish("collective3")
old = drv.prev["collective3"][0]
# rank 1 killed in the middle of its share's writes (each write slowed by 100 ms: ~3 s of writes)
killed, _ = drv._run_children("collective3", old + 1, "write:1:100", kill_at=0.8, victims=(1,))
try:
    drv.check_collective3("collective3", old, old + 1, killed)
except AssertionError as e:
    print("CHECK FAILED:", e)
else:
    print("CHECK PASSED", killed, drv.last_survivors)
"""


@pytest.mark.parametrize("broken", [True])  # unbroken (False), the same round passes: kept for running by hand
def test_driver_catches_a_broken_collective_save(tmp_path, broken):
    """A real round (3 ranks, rank 1 killed during its writes) with a deliberately broken
    collective save whose rank 0 does not remove its temporary file when it fails
    (FASTCKPT_CRASH_BREAK=leave_temp): the driver's check reports it."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch has no gloo backend")
    env = dict(os.environ)
    if broken:
        env["FASTCKPT_CRASH_BREAK"] = "leave_temp"
    r = fastspawn.run([sys.executable, "-c", BROKEN_ROUND, os.path.dirname(DRIVER), str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    if broken:
        assert "CHECK FAILED: rank 0 survived the round" in out, out
    else:
        assert "CHECK PASSED True" in out, out
