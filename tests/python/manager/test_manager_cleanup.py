"""CheckpointManager.clean_temporaries removes only what crashed saves *of
this host* left: on a shared filesystem another
node may be writing its temporary file right now, and its pid means nothing
here. Every temporary name fastckpt makes (the engine's, the manager's
sharded directories, ``fastckpt convert``'s) carries its host."""

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fastckpt
from fastckpt import CheckpointManager, _C

from leaks import temp_files, temp_name_of


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _start_of(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[19])


@pytest.mark.parametrize("fmt", ["current", "earlier"])
def test_other_hosts_temporaries_survive_this_hosts_dead_ones_go(tmp_path, caplog, fmt):
    host = _C.temp_host()
    other = "some-other-node" if host != "some-other-node" else "yet-another-node"
    mgr = CheckpointManager(tmp_path)
    mgr.save(10, {"w": torch.ones(3)})
    dead = dead_pid()
    live, live_start = os.getppid(), _start_of(os.getppid())

    def plant_file(target, *fields, **kw):
        name = temp_name_of(target, *fields, fmt=fmt, **kw)
        (tmp_path / name).write_bytes(b"partial")
        return name

    def plant_dir(target, *fields, **kw):
        name = temp_name_of(target, *fields, fmt=fmt, **kw)
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"partial")
        return name

    keep = [
        # another host's, with a pid that is dead here: that node may be writing them now
        plant_file("step_00000020.pt", dead, other, 12345),
        plant_file("latest", dead, other, 12345, 3, "ff00"),
        plant_dir("step_00000030", dead, other, 12345, 0, "abcd1234", kind="dcp"),
        plant_dir("step_00000008", dead, other, 12345, 1, "abcd1234", kind="del"),
        # this host's, of a live process
        plant_file("step_00000040.pt", live, host, live_start, 0, "beef"),
        plant_dir("step_00000050", live, host, live_start, 0, "beef", kind="dcp"),
        # an older fastckpt's name (no host): which host wrote it cannot be told
        plant_file_raw(tmp_path, f".step_00000060.pt.fastckpt-tmp.{dead}.0.1a2b"),
    ]
    gone = [
        # this host's, of dead processes
        plant_file("step_00000020.pt", dead, host, 12345),
        plant_file("latest", dead, host, 12345, 3, "ff00"),
        plant_dir("step_00000030", dead, host, 12345, 0, "abcd1234", kind="dcp"),
        plant_dir("step_00000009", dead, host, 12345, 1, "abcd1234", kind="del"),
        plant_dir("step_00000007", dead, host, 12345, 2, "abcd1234", kind="old"),
        # this host's, of a pid now used by another process (its start time differs)
        plant_dir("step_00000070", live, host, live_start + 1, 0, "beef", kind="dcp"),
    ]
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        mgr2 = CheckpointManager(tmp_path)  # its start cleans
    assert sorted(temp_files(tmp_path)) == sorted(keep)
    assert keep[0] in caplog.text  # named for the user
    assert mgr2.clean_temporaries() == [] and sorted(temp_files(tmp_path)) == sorted(keep)
    assert mgr2.load_latest().step == 10
    assert not any((tmp_path / n).exists() for n in gone)
    # the step 7 copy left aside was the only one: renamed back, not removed
    assert (tmp_path / "step_00000007" / "__0_0.distcp").read_bytes() == b"partial"


def plant_file_raw(directory, name):
    (directory / name).write_bytes(b"partial")
    return name


def test_clean_temporaries_returns_what_it_removed(tmp_path):
    host = _C.temp_host()
    mgr = CheckpointManager(tmp_path)
    dead = dead_pid()
    names = [temp_name_of("step_00000020.pt", dead, host, 12345),
             temp_name_of("step_00000030", dead, host, 12345, 0, "abcd1234", kind="dcp")]
    (tmp_path / names[0]).write_bytes(b"partial")
    (tmp_path / names[1]).mkdir()
    assert mgr.clean_temporaries() == sorted(names)
    assert temp_files(tmp_path) == []


def test_manager_and_convert_temporary_names_carry_this_host(tmp_path, monkeypatch):
    """The sharded save's directory, and `fastckpt convert`'s to DCP, are named
    with the pid, host and start time (the engine's format, plus a suffix):
    a crash leaves something only this host removes."""
    pytest.importorskip("torch.distributed.checkpoint")
    from fastckpt.manager import ranks as m
    from fastckpt._core.tempnames import parse_temp as _parse_temp
    seen = []
    real = m._dcp_writer

    def spy(path):
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(m, "_dcp_writer", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        mgr = CheckpointManager(tmp_path / "ck", sharded=True)
        mgr.save(1, {"w": torch.ones(4)})
        mgr.save(1, {"w": torch.zeros(4)})  # re-saving: the old directory is moved aside (".old")
    # what the engine itself makes, for comparison
    w = _C.Writer(fastckpt.get_engine(), str(tmp_path / "x.pt"))
    engine_info = _C.parse_temp_name(os.path.basename(w.tmp_path), "x.pt")
    w.abort()
    assert len(seen) == 2
    for name in seen:
        target, info, kind, _key = _parse_temp(name)
        assert (target, kind) == ("step_00000001", "dcp") and info == engine_info

    from fastckpt.cli import convert as _convert
    from fastckpt import dcp as fdcp
    made = []

    class Boom(Exception):
        pass

    def writer(path):
        made.append(os.path.basename(path))
        raise Boom()

    fastckpt.save({"w": torch.ones(4)}, tmp_path / "src.pt")
    monkeypatch.setattr(fdcp, "FastWriter", writer)
    from fastckpt.sources.kinds import open_source
    src = open_source(str(tmp_path / "src.pt"))
    with pytest.raises(Boom):
        _convert.write_dcp(src, str(tmp_path / "out.dcp"))
    assert len(made) == 1
    target, info, kind, _key = _parse_temp(made[0])
    assert (target, kind) == ("out.dcp", "dcp") and info == engine_info
    assert temp_files(tmp_path) == []
