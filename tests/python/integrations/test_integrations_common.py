"""fastckpt.integrations._common.atomic_directory: the directory commit every integration uses."""
import errno
import os

import pytest

from fastckpt.errors import RanksFailed
from fastckpt.manager.ranks import PeerFailed, Ranks
from fastckpt.integrations import _common


def fill(files):
    def write(tmp):
        for n, data in files.items():
            with open(os.path.join(tmp, n), "wb") as f:
                f.write(data)
        return os.stat(tmp).st_ino
    return write


def test_new_and_replaced_directories_leave_nothing_else(tmp_path):
    d = tmp_path / "ck"
    ino = _common.atomic_directory(d, fill({"a": b"1", "b": b"2"}))
    assert sorted(os.listdir(d)) == ["a", "b"] and os.stat(d).st_ino == ino
    ino = _common.atomic_directory(d, fill({"c": b"3"}))
    assert os.listdir(d) == ["c"] and os.stat(d).st_ino == ino  # replaced as a whole
    assert os.listdir(tmp_path) == ["ck"]


def test_inner_directory(tmp_path):
    def write(tmp):
        os.mkdir(os.path.join(tmp, "checkpoint-4"))
        fill({"x": b"x"})(os.path.join(tmp, "checkpoint-4"))
    _common.atomic_directory(tmp_path / "checkpoint-4", write, inner="checkpoint-4")
    assert os.listdir(tmp_path) == ["checkpoint-4"] and os.listdir(tmp_path / "checkpoint-4") == ["x"]
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        _common.atomic_directory(tmp_path / "checkpoint-6", lambda tmp: None, inner="checkpoint-6")
    assert os.listdir(tmp_path) == ["checkpoint-4"]


def test_replacing_swaps_atomically_where_the_system_can(tmp_path, monkeypatch):
    """Over an existing directory the commit is one renameat2(RENAME_EXCHANGE): the two-rename
    fallback (during which the final name is missing) is not used."""
    from fastckpt import _C
    from fastckpt._core import dircommit
    d = tmp_path / "ck"
    _common.atomic_directory(d, fill({"old": b"o"}))
    probe_a, probe_b = tmp_path / "pa", tmp_path / "pb"
    probe_a.mkdir()
    probe_b.mkdir()
    if not _C.rename_exchange(str(probe_a), str(probe_b)):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not offered by this kernel or filesystem")
    hows = []
    real = dircommit.commit_directory
    monkeypatch.setattr(_common, "commit_directory", lambda *a, **k: hows.append(real(*a, **k)))
    _common.atomic_directory(d, fill({"new": b"n"}))
    assert hows == ["exchange"]
    assert os.listdir(d) == ["new"]
    assert sorted(os.listdir(tmp_path)) == ["ck", "pa", "pb"]


def test_a_failed_write_leaves_the_old_directory_and_names_the_users_path(tmp_path):
    d = tmp_path / "ck"
    _common.atomic_directory(d, fill({"old": b"o"}))

    def failing(tmp):
        fill({"half": b"h"})(tmp)
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(tmp, "half"))
    with pytest.raises(OSError) as ei:
        _common.atomic_directory(d, failing)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(d)
    assert str(d) in str(ei.value) and "left as it was" in str(ei.value)
    assert os.listdir(d) == ["old"] and os.listdir(tmp_path) == ["ck"]
    with pytest.raises(NotADirectoryError):
        (tmp_path / "f").write_bytes(b"")
        _common.atomic_directory(tmp_path / "f", fill({}))


class Rank1Of2(Ranks):
    """This process as rank 1 of 2, rank 0's side of every collective scripted (what it sends)."""

    def __init__(self, *rank0):
        self.rank, self.world_size, self.dist = 1, 2, True
        self.rank0 = list(rank0)
        self.sent = []

    def gather(self, obj, background=False):
        self.sent.append(obj)
        return [self.rank0.pop(0), obj]


def test_a_process_that_does_not_see_rank_0s_temporary_directory_fails_the_save(tmp_path):
    ranks = Rank1Of2((None, str(tmp_path / ".ck.fastckpt-tmp.elsewhere.dcp")), (None, None), None)
    with pytest.raises(FileNotFoundError, match="rank 1 does not see rank 0's temporary directory") as ei:
        _common.atomic_directory(tmp_path / "ck", fill({"x": b"1"}), ranks=ranks)
    assert str(tmp_path / "ck") in str(ei.value)
    assert ranks.sent[1][0][1].startswith("FileNotFoundError")  # rank 0 was told, then the cleanup barrier
    assert len(ranks.sent) == 3 and os.listdir(tmp_path) == []


def test_rank_1_writes_its_own_files_and_learns_that_rank_0s_commit_failed(tmp_path):
    tmp = tmp_path / ".ck.fastckpt-tmp.rank0.dcp"
    tmp.mkdir()  # what rank 0 made
    ranks = Rank1Of2((None, str(tmp)), (None, None), ((5, "OSError: [Errno 5] rename failed"), None), None)
    with pytest.raises(PeerFailed, match="failed on rank 0: OSError") as ei:
        _common.atomic_directory(tmp_path / "ck", fill({"mine": b"1"}), ranks=ranks, own=["mine", "absent"])
    assert str(tmp_path / "ck") in str(ei.value)
    assert os.listdir(tmp) == ["mine"]  # rank 1 does not remove rank 0's directory: rank 0 does
    assert not (tmp_path / "ck").exists()


def test_a_lost_peer_is_an_error_naming_the_directory(tmp_path):
    class Lost(Rank1Of2):
        def gather(self, obj, background=False):
            raise RuntimeError("Connection closed by peer")
    with pytest.raises(RanksFailed, match="lost contact with the other processes") as ei:
        _common.atomic_directory(tmp_path / "ck", fill({}), ranks=Lost())
    e = ei.value
    assert str(tmp_path / "ck") in str(e) and e.filename == str(tmp_path / "ck")
    assert e.errno == errno.EIO and e.lost and "Connection closed by peer" in str(e)


def test_contact_lost_after_the_write_raises_at_once_without_a_last_barrier(tmp_path):
    """Rank 0 dies while rank 1 waits at the barrier after writing: rank 1 raises that contact was
    lost (no rank named), without waiting at the last barrier a broken group cannot pass."""
    tmp = tmp_path / ".ck.fastckpt-tmp.rank0.dcp"
    tmp.mkdir()

    class LostAfterWrite(Rank1Of2):
        def gather(self, obj, background=False):
            if len(self.sent) == 1:
                self.sent.append(obj)
                raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection reset by peer")
            return super().gather(obj, background)
    ranks = LostAfterWrite((None, str(tmp)))
    with pytest.raises(RanksFailed) as ei:
        _common.atomic_directory(tmp_path / "ck", fill({"mine": b"1"}), ranks=ranks)
    e = ei.value
    assert e.lost and e.errno == errno.EIO and e.filename == str(tmp_path / "ck")
    assert "(writing its files) failed: lost contact with the other processes" in str(e)
    assert len(ranks.sent) == 2  # the temporary directory's exchange and the one that broke: no third
