"""The persistence model of crashfs on hand-written op logs (no FUSE needed): what a power cut
keeps and drops, so that the power-loss tests' verdicts rest on a model that is itself tested."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crashfs  # noqa: E402
from crashfs import ROOT  # noqa: E402


def states_after(log, per_client=False):
    """{variant: {path: bytes or 'dir'}} for a power cut after the last op of ``log``."""
    out = {}
    for cut, variant, tree, model in crashfs.crash_states(log, per_client=per_client):
        if cut == len(log):
            out.setdefault(variant, []).append(
                {p: (model.content(c) if k == "f" else "dir") for p, k, c in tree})
    return out


def commit(tmp_ino=2, data=b"new", fsync=True, fsyncdir=True):
    """The engine's protocol: temporary file, write, fdatasync, rename, directory fsync."""
    log = [("create", ROOT, ".tmp", tmp_ino), ("write", tmp_ino, 0, data)]
    log += [("fsync", tmp_ino)] if fsync else []
    log += [("rename", ROOT, ".tmp", ROOT, "ck", 0)]
    log += [("fsyncdir", ROOT)] if fsyncdir else []
    return log


def test_full_protocol_survives_every_variant():
    for variant, states in states_after(commit()).items():
        for s in states:
            assert s == {"ck": b"new"}, variant


def test_a_name_is_durable_only_after_its_directory_is_fsynced():
    st = states_after(commit(fsyncdir=False))
    assert st["synced only"] == [{}]  # the rename (and the creation) were never made durable
    assert st["names persisted, unsynced data lost"] == [{"ck": b"new"}]


def test_data_is_durable_only_after_fsync():
    st = states_after(commit(fsync=False))
    assert {"ck": b""} in st["synced only"]  # durable name, data never synced: a torn checkpoint


def test_truncate_and_overwrite_before_fsync_are_dropped():
    log = commit() + [("truncate", 2, 0), ("write", 2, 0, b"xy")]
    st = states_after(log)
    assert st["synced only"] == [{"ck": b"new"}]
    assert st["everything persisted (as SIGKILL)"] == [{"ck": b"xy"}]


def test_unlink_is_durable_only_after_the_directory_fsync():
    st = states_after(commit() + [("unlink", ROOT, "ck")])
    assert st["synced only"] == [{"ck": b"new"}]
    assert st["names persisted, unsynced data lost"] == [{}]


def test_journal_prefix_finds_the_gap_between_two_renames():
    # "move the old one aside, then rename the new one in": a cut that persisted only the first
    # rename leaves no checkpoint under the final name, which neither all-or-nothing variant shows
    log = commit() + [("create", ROOT, ".tmp2", 3), ("write", 3, 0, b"v2"), ("fsync", 3),
                      ("rename", ROOT, "ck", ROOT, "ck.aside", 0), ("rename", ROOT, ".tmp2", ROOT, "ck", 0)]
    st = states_after(log)
    assert {".tmp2": b"v2", "ck.aside": b"new"} in st[crashfs.PREFIX]
    for variant in ("synced only", "names persisted, unsynced data lost"):
        assert all("ck" in s for s in st[variant])


def test_a_directory_is_reachable_only_through_durable_entries():
    log = [("mkdir", ROOT, "d", 2), ("create", 2, "f", 3), ("write", 3, 0, b"x"), ("fsync", 3), ("fsyncdir", 2)]
    assert states_after(log)["synced only"] == [{}]  # the parent never recorded "d"
    assert states_after(log + [("fsyncdir", ROOT)])["synced only"] == [{"d": "dir", "d/f": b"x"}]


def _two_writers(fsyncs):
    """Two processes (pids 10, 11) write halves of one file, then the given (pid) fsyncs, rename
    and directory fsync (the collective save's protocol: every rank syncs its own share)."""
    log = [("create", ROOT, ".tmp", 2), ("truncate", 2, 4, 10), ("write", 2, 0, b"ab", 10),
           ("write", 2, 2, b"cd", 11)]
    log += [("fsync", 2, pid) for pid in fsyncs]
    return log + [("rename", ROOT, ".tmp", ROOT, "ck", 0), ("fsyncdir", ROOT)]


def test_per_client_a_writes_are_durable_only_after_its_own_fsync():
    st = states_after(_two_writers([10]), per_client=True)
    assert st["synced only"] == [{"ck": b"ab\0\0"}]  # process 11 never synced its half
    assert states_after(_two_writers([10]))["synced only"] == [{"ck": b"abcd"}]  # one local fs: any fsync
    for fsyncs in ([10, 11], [11, 10]):
        for variant, states in states_after(_two_writers(fsyncs), per_client=True).items():
            assert all(s == {"ck": b"abcd"} for s in states), (fsyncs, variant)


def test_per_client_keeps_what_was_durable_and_orders_a_process_changes():
    log = _two_writers([10, 11]) + [("write", 2, 0, b"XY", 10), ("write", 2, 2, b"ZW", 11), ("fsync", 2, 11)]
    st = states_after(log, per_client=True)
    assert st["synced only"] == [{"ck": b"abZW"}]
    assert st["everything persisted (as SIGKILL)"] == [{"ck": b"XYZW"}]
    log += [("truncate", 2, 1, 10), ("write", 2, 1, b"q", 10), ("fsync", 2, 10)]
    assert states_after(log, per_client=True)["synced only"] == [{"ck": b"Xq"}]
