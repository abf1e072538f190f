"""Checkpoint directories owned by another user are refused (README "Guarantees").

Making a directory that another user owns needs root (chown); elsewhere these
tests skip.
"""
import errno
import os

import pytest
import torch

import fastckpt
from fastckpt import knobs
from fastckpt._owner import check_directory_owner
from fastckpt.manager import CheckpointManager
from conftest import dcp_unwrapped

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
