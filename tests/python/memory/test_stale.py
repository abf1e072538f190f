"""Stale memory tier snapshots: found by fastckpt.memory.stale.scan, removed by clean.

The layouts are real memory tier directories (a torch.save archive and a commit record
per slot, owner.json per rank) made in a temporary directory; the live owner is this
process, the dead one a subprocess that has exited."""

import os
import time

import pytest

from fastckpt._core.tempnames import temp_name
from fastckpt.memory import stale
from fastckpt.memory.tier import OWNER_FILE

from memory_layout import age, dead_pid, make_namespace, tree


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "mem"
    r.mkdir()
    return r


def by_path(entries):
    return {e["path"]: e for e in entries}


def test_scan_reports_live_and_dead(root, tmp_path):
    live = make_namespace(root, tmp_path / "ck-live", os.getpid(), ranks=(0, 1), replicas=(2,), steps=(10, 20))
    gone_pid = dead_pid()
    dead = make_namespace(root, tmp_path / "ck-dead", gone_pid, ranks=(3,), replicas=(0, 1), steps=(7,))
    age(dead, 300)
    e = by_path(stale.scan(root))
    assert set(e) == {live, dead}
    a, b = e[live], e[dead]
    assert a["kind"] == b["kind"] == "namespace"
    assert a["live"] is True and a["owner_alive"] is True and stale.is_live(a)
    assert b["live"] is False and b["owner_alive"] is False and not stale.is_live(b, force=False)
    assert a["directories"] == [os.path.realpath(tmp_path / "ck-live")]
    assert b["directories"] == [os.path.realpath(tmp_path / "ck-dead")]
    assert (a["ranks"], a["replicas"]) == ([0, 1], [2])
    assert (b["ranks"], b["replicas"]) == ([3], [0, 1])
    assert a["newest_step"] == 20 and b["newest_step"] == 7
    assert sorted(o["pid"] for o in a["owners"]) == [os.getpid(), os.getpid()]
    assert [(o["pid"], o["alive"], o["rank"]) for o in b["owners"]] == [(gone_pid, False, 3)]
    want = 0
    for dirpath, _, files in os.walk(dead):
        want += sum(os.lstat(os.path.join(dirpath, f)).st_blocks * 512 for f in files)
    assert b["bytes"] == want > 0
    assert 299 <= b["age"] < 400 and a["age"] < 60
    assert a["other_files"] == b["other_files"] == []


def test_incomplete_slots_are_no_step(root, tmp_path):
    ns = make_namespace(root, tmp_path / "ck", dead_pid(), steps=(5, 9))
    os.unlink(os.path.join(ns, "rank0", "slot1.commit"))  # slot 1 (step 9) taken for a new snapshot
    assert stale.scan(root)[0]["newest_step"] == 5
    os.unlink(os.path.join(ns, "rank0", "slot0.commit"))
    assert stale.scan(root)[0]["newest_step"] is None


def test_clean_removes_the_dead_and_keeps_the_live(root, tmp_path):
    live = make_namespace(root, tmp_path / "ck-live", os.getpid(), replicas=(1,))
    dead = make_namespace(root, tmp_path / "ck-dead", dead_pid(), ranks=(0, 1), replicas=(2,))
    live_tree = tree(live)
    removed = stale.clean(root)
    assert not os.path.lexists(dead)
    assert tree(live) == live_tree
    assert removed[-1] == dead
    assert os.path.join(dead, "rank0", "slot0.pt") in removed
    assert os.path.join(dead, "replica2") in removed
    assert os.path.join(dead, "rank1", OWNER_FILE) in removed
    assert not any(p.startswith(live) for p in removed)
    assert stale.clean(root) == []  # nothing left to do
    assert [e["path"] for e in stale.scan(root)] == [live]


def test_a_namespace_without_owner_is_stale(root, tmp_path):
    ns = make_namespace(root, tmp_path / "ck", os.getpid(), ranks=(), replicas=(0,))
    e = stale.scan(root)[0]
    assert e["owners"] == [] and e["owner_alive"] is False and e["live"] is False
    assert stale.clean(root)[-1] == ns and not os.path.exists(ns)


def test_reused_pid_is_not_the_owner(root, tmp_path):
    # this process started long after the owner claimed the directory: a reused pid
    make_namespace(root, tmp_path / "ck", os.getpid(), since=1000.0)
    e = stale.scan(root)[0]
    assert e["owners"][0]["alive"] is False and e["live"] is False


def test_owner_of_another_host_is_unknown_unless_force(root, tmp_path):
    ns = make_namespace(root, tmp_path / "ck", 1, host="some-other-host.invalid")
    age(ns, 1000)
    e = stale.scan(root)[0]
    assert e["owners"][0]["alive"] is None and e["owner_alive"] is None
    assert e["live"] is True and stale.is_live(e) and not stale.is_live(e, force=True)
    assert stale.clean(root, older_than=10) == [] and os.path.isdir(ns)
    assert stale.clean(root, force=True)[-1] == ns and not os.path.exists(ns)


def test_older_than(root, tmp_path):
    old = make_namespace(root, tmp_path / "ck-old", dead_pid())
    new = make_namespace(root, tmp_path / "ck-new", dead_pid())
    age(old, 3600)
    age(new, 60)
    assert stale.clean(root, older_than=600)[-1] == old
    assert not os.path.exists(old) and os.path.isdir(new)
    assert stale.clean(root, older_than=600) == []
    assert stale.clean(root, older_than=30)[-1] == new and not os.path.exists(new)
    with pytest.raises(ValueError, match="older_than"):
        stale.clean(root, older_than=-1)


def test_dry_run_removes_nothing(root, tmp_path):
    make_namespace(root, tmp_path / "ck-live", os.getpid())
    dead = make_namespace(root, tmp_path / "ck-dead", dead_pid(), replicas=(1,))
    before = tree(root)
    would = stale.clean(root, dry_run=True)
    assert tree(root) == before
    assert would and would[-1] == dead
    assert stale.clean(root) == would  # what it said it would remove, in the same order
    assert not os.path.exists(dead)


def test_foreign_entries_and_other_files_are_left(root, tmp_path):
    (root / "someone-else").mkdir()
    (root / "someone-else" / "slot0.pt").write_bytes(b"not ours")   # no rank*/replica* dir: foreign
    (root / "notes.txt").write_text("hello")
    (root / "empty").mkdir()
    dead = make_namespace(root, tmp_path / "ck", dead_pid(), ranks=(0, 1))
    with open(os.path.join(dead, "rank0", "keep.me"), "w") as f:
        f.write("user data")
    with open(os.path.join(dead, "README"), "w") as f:
        f.write("user data")
    os.mkdir(os.path.join(dead, "rankX"))   # not a rank<N> directory
    mine = temp_name("slot0.commit")        # a temporary of a commit record: the tier's
    other = temp_name("keep.me")            # a temporary of something else: not the tier's
    for n in (mine, other):
        open(os.path.join(dead, "rank1", n), "w").close()
    e = by_path(stale.scan(root))
    assert e[str(root / "someone-else")] == {"kind": "foreign", "path": str(root / "someone-else"),
                                             "why": "no rank*/replica* directories"}
    assert e[str(root / "notes.txt")]["kind"] == e[str(root / "empty")]["kind"] == "foreign"
    assert sorted(e[dead]["other_files"]) == sorted(
        [os.path.join(dead, "README"), os.path.join(dead, "rankX"), os.path.join(dead, "rank0", "keep.me"),
         os.path.join(dead, "rank1", other)])

    reps = stale.clean_report(root)
    assert [r["path"] for r in reps] == [dead]
    left = sorted(x["path"] for x in reps[0]["left"])
    assert left == sorted(e[dead]["other_files"])
    assert dead not in reps[0]["removed"]
    assert os.path.join(dead, "rank1", mine) in reps[0]["removed"]
    assert tree(dead) == ["README", "rank0", "rank0/keep.me", "rank1", f"rank1/{other}", "rankX"]
    assert (root / "someone-else" / "slot0.pt").read_bytes() == b"not ours"
    assert (root / "notes.txt").read_text() == "hello" and (root / "empty").is_dir()
    assert stale.clean(root) == []  # only what is not ours is left


def test_symlinks_are_not_followed(root, tmp_path):
    outside = tmp_path / "outside"
    victim = make_namespace(outside, tmp_path / "ck-victim", dead_pid(), replicas=(1,))  # a namespace outside
    victim_tree = tree(outside)
    dead = make_namespace(root, tmp_path / "ck", dead_pid())
    os.symlink(os.path.join(victim, "rank0", "slot0.pt"), os.path.join(dead, "rank0", "slot7.pt"))
    os.symlink(os.path.join(victim, "rank0", "slot0.commit"), os.path.join(dead, "rank0", "slot7.commit"))
    os.symlink(os.path.join(victim, "rank0"), os.path.join(dead, "rank5"))
    os.symlink(victim, root / "linked-namespace")
    e = by_path(stale.scan(root))
    assert e[str(root / "linked-namespace")] == {"kind": "foreign", "path": str(root / "linked-namespace"),
                                                 "why": "a symbolic link (not followed)"}
    assert e[dead]["ranks"] == [0] and e[dead]["newest_step"] == 20   # the linked slot 7 is not read
    reps = stale.clean_report(root, force=True)
    assert [r["path"] for r in reps] == [dead]
    whys = {x["path"]: x["why"] for x in reps[0]["left"]}
    assert whys == {os.path.join(dead, "rank0", "slot7.pt"): "a symbolic link (not followed)",
                    os.path.join(dead, "rank0", "slot7.commit"): "a symbolic link (not followed)",
                    os.path.join(dead, "rank5"): "a symbolic link (not followed)"}
    assert tree(outside) == victim_tree  # nothing outside the root was touched
    assert os.path.islink(root / "linked-namespace")
    assert sorted(os.listdir(os.path.join(dead, "rank0"))) == ["slot7.commit", "slot7.pt"]


def test_missing_root(tmp_path):
    with pytest.raises(FileNotFoundError):
        stale.scan(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        stale.clean(tmp_path / "nope")


def test_default_root_is_the_memory_directory(root, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTCKPT_MEMORY_DIR", str(root))
    dead = make_namespace(root, tmp_path / "ck", dead_pid())
    assert [e["path"] for e in stale.scan()] == [dead]
    assert stale.clean()[-1] == dead
