"""Checkpoint directories owned by another user, or writable by others, are
refused (README "Guarantees").

Making a directory that another user owns, or giving it another group, needs
root (chown); elsewhere those tests skip.
"""
import errno
import grp
import os
import pwd
import stat
import tempfile

import pytest
import torch

import fastckpt
from fastckpt import knobs
from fastckpt._core.owner import check_directory_owner
from fastckpt.manager.manager import CheckpointManager
from dcp_calls import dcp_unwrapped

OTHER = 4242  # a uid that owns nothing on this machine

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root")


def _foreign(d):
    d.mkdir(exist_ok=True)
    os.chown(d, OTHER, OTHER)
    return d


def _refused(excinfo, path):
    e = excinfo.value
    assert isinstance(e, PermissionError) and e.errno == errno.EPERM
    assert e.filename == os.fspath(path)
    assert f"uid {OTHER}" in str(e) and "FASTCKPT_ALLOW_FOREIGN_OWNER" in str(e)


def test_own_and_missing_directories_pass(tmp_path):
    check_directory_owner(tmp_path)
    check_directory_owner(tmp_path / "not-yet")


@needs_root
def test_check_refuses_a_foreign_directory(tmp_path):
    d = _foreign(tmp_path / "theirs")
    with pytest.raises(PermissionError) as ei:
        check_directory_owner(d)
    _refused(ei, d)
    with knobs.override(allow_foreign_owner=1):
        check_directory_owner(d)


@needs_root
def test_manager_refuses_a_foreign_directory_and_touches_nothing(tmp_path):
    d = _foreign(tmp_path / "ckpt")
    planted = d / ".step_00000001.pt.fastckpt-tmp.1.1.1"
    planted.write_bytes(b"x")
    with pytest.raises(PermissionError) as ei:
        CheckpointManager(d)
    _refused(ei, d)
    assert planted.exists(), "a refused directory must not be cleaned either"
    with knobs.override(allow_foreign_owner=1):
        mgr = CheckpointManager(d)
        mgr.save(1, {"w": torch.ones(3)})
        r = mgr.load_latest()
    assert r.step == 1 and torch.equal(r.state["w"], torch.ones(3))


@needs_root
def test_dcp_writer_and_reader_refuse_a_foreign_directory(tmp_path):
    import torch.distributed.checkpoint as dcp
    sd = {"w": torch.arange(10.0)}
    d = _foreign(tmp_path / "dcp")
    with pytest.raises(PermissionError) as ei:
        dcp_unwrapped(dcp.save, sd, storage_writer=fastckpt.FastWriter(d), no_dist=True)
    _refused(ei, d)
    assert os.listdir(d) == []

    mine = tmp_path / "mine"
    dcp.save(sd, storage_writer=fastckpt.FastWriter(mine), no_dist=True)
    os.chown(mine, OTHER, OTHER)
    target = {"w": torch.zeros(10)}
    with pytest.raises(PermissionError) as ei:
        fastckpt.FastReader(mine).read_metadata()
    _refused(ei, mine)
    with pytest.raises(AssertionError, match="owned by uid 4242"):  # dcp.load's own wrapping
        dcp_unwrapped(dcp.load, target, storage_reader=fastckpt.FastReader(mine), no_dist=True)
    assert torch.equal(target["w"], torch.zeros(10))
    with knobs.override(allow_foreign_owner=1):
        dcp.load(target, storage_reader=fastckpt.FastReader(mine), no_dist=True)
    assert torch.equal(target["w"], sd["w"])


def test_single_file_load_from_a_foreign_directory_is_allowed(tmp_path):
    # Published checkpoints in shared directories are normal; weights_only guards them.
    p = tmp_path / "m.pt"
    fastckpt.save({"w": torch.ones(2)}, p)
    if os.geteuid() == 0:
        os.chown(tmp_path, OTHER, OTHER)
        os.chown(p, OTHER, OTHER)
    assert torch.equal(fastckpt.load(p)["w"], torch.ones(2))


def test_knob_values(monkeypatch):
    assert knobs.get("allow_foreign_owner") in (0, 1)
    monkeypatch.setenv("FASTCKPT_ALLOW_FOREIGN_OWNER", "yes")
    with pytest.raises(ValueError, match="allow_foreign_owner"):
        knobs.get("allow_foreign_owner")
    monkeypatch.setenv("FASTCKPT_ALLOW_FOREIGN_OWNER", "1")
    assert knobs.get("allow_foreign_owner") == 1
    with pytest.raises(ValueError):
        with knobs.override(allow_foreign_owner=-1):
            pass


# ---------------------------------------------------------------- writable by others

def _refused_writable(excinfo, path, who):
    e = excinfo.value
    assert isinstance(e, PermissionError) and e.errno == errno.EPERM
    assert e.filename == os.fspath(path)
    msg = str(e)
    assert f"{path} is writable by {who}" in msg
    assert "step_99999999.pt" in msg and "FASTCKPT_ALLOW_FOREIGN_OWNER" in msg


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o773])
def test_world_writable_directory_is_refused_sticky_or_not(tmp_path, mode):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(PermissionError) as ei:
        check_directory_owner(d)
    _refused_writable(ei, d, "every user")
    assert ("sticky bit" in str(ei.value)) == bool(mode & stat.S_ISVTX)
    with knobs.override(allow_foreign_owner=1):
        check_directory_owner(d)
    os.chmod(d, 0o755)
    check_directory_owner(d)


def test_the_shared_temp_directory_itself_is_refused():
    # Root-owned (trusted owner) and sticky, yet anyone can create step_99999999.pt in it.
    tmp = tempfile.gettempdir()
    st = os.stat(tmp)
    if not st.st_mode & stat.S_IWOTH:
        pytest.skip(f"{tmp} is not world-writable here")
    with pytest.raises(PermissionError) as ei:
        check_directory_owner(tmp)
    _refused_writable(ei, tmp, "every user")


def test_manager_and_dcp_writer_refuse_a_world_writable_directory_and_touch_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp
    d = tmp_path / "ckpt"
    d.mkdir()
    os.chmod(d, 0o1777)
    planted = d / "step_99999999.pt"
    fastckpt.save({"w": torch.full((3,), 666.0)}, planted)
    leftover = d / ".step_00000001.pt.fastckpt-tmp.1.1.1"
    leftover.write_bytes(b"x")
    with pytest.raises(PermissionError) as ei:
        CheckpointManager(d)
    _refused_writable(ei, d, "every user")
    assert leftover.exists() and planted.exists()
    with pytest.raises(PermissionError) as ei:
        dcp_unwrapped(dcp.save, {"w": torch.ones(2)}, storage_writer=fastckpt.FastWriter(d), no_dist=True)
    _refused_writable(ei, d, "every user")
    with knobs.override(allow_foreign_owner=1):
        mgr = CheckpointManager(d, clean=False)
        mgr.save(1, {"w": torch.ones(3)})


@needs_root
def test_group_writable_directory_of_a_shared_group_is_refused(tmp_path):
    d = tmp_path / "team"
    d.mkdir()
    os.chown(d, os.geteuid(), OTHER)
    os.chmod(d, 0o775)
    with pytest.raises(PermissionError) as ei:
        check_directory_owner(d)
    _refused_writable(ei, d, f"the members of gid {OTHER}")
    os.chmod(d, 0o755)  # the group can no longer write: fine
    check_directory_owner(d)


def test_group_writable_directory_of_ones_own_private_group_passes(tmp_path):
    me = pwd.getpwuid(os.geteuid()).pw_name
    try:
        g = grp.getgrnam(me)
    except KeyError:
        pytest.skip(f"no user-private group named {me} here")
    if set(g.gr_mem) - {me}:
        pytest.skip(f"group {me} lists other members: not a private group")
    d = tmp_path / "mine"
    d.mkdir()
    if os.stat(d).st_gid != g.gr_gid:
        if os.geteuid() != 0:
            pytest.skip("cannot give the directory my private group")
        os.chown(d, -1, g.gr_gid)
    os.chmod(d, 0o775)
    check_directory_owner(d)
