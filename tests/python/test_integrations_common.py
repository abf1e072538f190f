"""fastckpt.integrations._common.atomic_directory: the directory commit every integration uses."""
import errno
import os

import pytest

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
    d = tmp_path / "ck"
    _common.atomic_directory(d, fill({"old": b"o"}))
    probe_a, probe_b = tmp_path / "pa", tmp_path / "pb"
    probe_a.mkdir()
    probe_b.mkdir()
    if not _common._exchange(str(probe_a), str(probe_b)):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not offered by this C library or filesystem")

    def no_two_step(tmp, final):
        raise AssertionError("the two-rename fallback was used")
    monkeypatch.setattr(_common, "_replace_dir", no_two_step)
    _common.atomic_directory(d, fill({"new": b"n"}))
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
