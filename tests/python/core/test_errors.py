"""Careless callers get clear errors: the message and ``filename`` name the
path the user gave and the cause, and what can be checked is checked before
anything is pickled, staged or written (fastckpt/_paths.py)."""

import errno
import os
import pickle
import select
import signal
import stat

import pytest
import torch

import fastckpt
from fastckpt import _C
from fastckpt.errors import MissingDependencyError, UnsupportedURLError

from leaks import temp_files

pickled = {"n": 0}


def _rebuild():
    return "rebuilt"


class Counted:
    """Counts how often it is pickled: a refused save must not get that far."""

    def __reduce__(self):
        pickled["n"] += 1
        return (_rebuild, ())


@pytest.fixture
def state():
    pickled["n"] = 0
    return {"w": torch.ones(1000), "c": Counted()}


def _check(err, path, *words):
    assert err.filename == str(path), (err.filename, str(path))
    msg = str(err)
    assert str(path) in msg and ".fastckpt-tmp" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)


SAVERS = ["save", "async_save"]


def _save(how, obj, path):
    if how == "save":
        return fastckpt.save(obj, path)
    return fastckpt.async_save(obj, path).result()  # the check raises before a future exists


# ---------------------------------------------------------------- what is checked first

@pytest.mark.parametrize("how", SAVERS)
def test_missing_parent_directory(tmp_path, state, how):
    p = tmp_path / "no-such-dir" / "x.pt"
    with pytest.raises(FileNotFoundError) as ei:
        _save(how, state, p)
    assert ei.value.errno == errno.ENOENT
    _check(ei.value, p, "parent directory", str(tmp_path / "no-such-dir"), "does not exist")
    assert pickled["n"] == 0, "pickled before the target was checked"


@pytest.mark.parametrize("how", SAVERS)
def test_target_is_an_existing_directory(tmp_path, state, how):
    """Refused at once: nothing pickled, staged or written (it used to write
    the whole checkpoint, then fail at the rename)."""
    d = tmp_path / "ckpt.pt"
    d.mkdir()
    with pytest.raises(IsADirectoryError) as ei:
        _save(how, state, d)
    assert ei.value.errno == errno.EISDIR
    _check(ei.value, d, "directory")
    assert pickled["n"] == 0 and temp_files(tmp_path) == [] and os.listdir(d) == []
    with pytest.raises(IsADirectoryError):
        fastckpt.save(state, str(tmp_path / "fresh") + "/")  # a name that can only be a directory
    (tmp_path / "link.pt").symlink_to(d)  # a link to a directory is one too
    with pytest.raises(IsADirectoryError):
        fastckpt.save(state, tmp_path / "link.pt")
    assert pickled["n"] == 0


def test_parent_is_a_file(tmp_path, state):
    (tmp_path / "f").write_bytes(b"x")
    p = tmp_path / "f" / "x.pt"
    with pytest.raises(NotADirectoryError) as ei:
        fastckpt.save(state, p)
    assert ei.value.errno == errno.ENOTDIR
    _check(ei.value, p, "not a directory")
    assert pickled["n"] == 0


@pytest.mark.parametrize("url", ["s3://bucket/ckpt/x.pt", "gs://b/x.pt", "hdfs://nn:8020/x.pt", "file:///tmp/x.pt"])
def test_url_is_refused_clearly(tmp_path, state, url):
    """async_save writes local paths only; fastckpt.save/load send URLs to
    fastckpt.remote (tests/python/remote/test_remote_url.py), which names a missing
    optional dependency before anything is pickled."""
    with pytest.raises(UnsupportedURLError) as ei:
        _save("async_save", state, url)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, NotImplementedError)
    assert url in str(ei.value) and "not supported" in str(ei.value)
    if url.startswith(("gs:", "hdfs:")):
        for call in (lambda: fastckpt.save(state, url), lambda: fastckpt.load(url)):
            try:
                call()
            except MissingDependencyError as e:
                assert url in str(e) and "not installed" in str(e), e
            except Exception as e:  # the package is installed here: then the store is unreachable
                assert isinstance(e, OSError) and url in str(e), e
    assert pickled["n"] == 0


def test_url_lookalikes_are_local_paths(tmp_path, monkeypatch):
    """Only scheme:// is a URL: 's3:/x.pt' and 'c:x.pt' are relative local paths."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:").mkdir()
    for p in ("s3:/x.pt", "c:x.pt", "s3:x.pt"):
        fastckpt.save({"w": torch.ones(2)}, p)
        assert torch.equal(fastckpt.load(p)["w"], torch.ones(2))
    assert (tmp_path / "s3:" / "x.pt").is_file()


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(IsADirectoryError) as ei:
        fastckpt.load(tmp_path)
    assert ei.value.filename == str(tmp_path)
    with pytest.raises(FileNotFoundError) as ei:
        fastckpt.load(tmp_path / "nope.pt")
    assert ei.value.filename == str(tmp_path / "nope.pt")


# ---------------------------------------------------------------- errors of the engine, mid-save

@pytest.mark.parametrize("op,code", [("write", errno.ENOSPC), ("fsync", errno.EIO), ("open", errno.EMFILE)])
def test_engine_errors_name_the_target(tmp_path, op, code):
    """An error the engine raises for its temporary file names the user's path
    (message and filename), keeps its errno and type, and leaves the old file
    and no temporary file."""
    p = tmp_path / "x.pt"
    fastckpt.save({"gen": 1}, p)
    _C.fault_inject(op, nth=1, errno=code, path_contains="x.pt")
    with pytest.raises(OSError) as ei:
        fastckpt.save({"gen": 2, "w": torch.ones(100000)}, p)
    e = ei.value
    assert e.errno == code and type(e) is type(OSError(code, "x")), (type(e), code)
    assert e.filename == str(p) and str(p) in str(e)  # the engine's own name, if it is another, is in filename2
    _C.fault_clear()
    assert fastckpt.load(p) == {"gen": 1} and temp_files(tmp_path) == []


def test_async_save_errors_name_the_target(tmp_path):
    p = tmp_path / "a.pt"
    _C.fault_inject("write", nth=1, errno=errno.ENOSPC, path_contains="a.pt")
    fut = fastckpt.async_save({"w": torch.ones(100000)}, p)
    e = fut.exception(timeout=60)
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename == str(p), repr(e)
    assert temp_files(tmp_path) == []


# ---------------------------------------------------------------- permissions (as an unprivileged user)

NOBODY = 65534


def _as_nobody(fn, timeout=60):
    """Run fn() in a child process with effective uid/gid nobody; return
    ("ok",) or (exception type name, errno, filename, message)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            os.setgroups([])
            os.setegid(NOBODY)
            os.seteuid(NOBODY)
            try:
                fn()
                res = ("ok",)
            except BaseException as e:  # noqa: BLE001
                res = (type(e).__name__, getattr(e, "errno", None), getattr(e, "filename", None), str(e))
            os.write(w, pickle.dumps(res))
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the unprivileged save did not finish")
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return pickle.loads(data)


@pytest.fixture
def shared_dir(tmp_path_factory):
    """A directory an unprivileged user can reach (pytest's base is 0700)."""
    import tempfile
    d = tempfile.mkdtemp(prefix="fastckpt-perm-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    for root, dirs, _ in os.walk(d):
        for x in dirs:
            os.chmod(os.path.join(root, x), 0o755)
    import shutil
    shutil.rmtree(d)


def test_read_only_directory(shared_dir):
    ro = os.path.join(shared_dir, "ro")
    os.mkdir(ro, 0o555)
    os.chmod(ro, 0o555)
    p = os.path.join(ro, "x.pt")
    for how in SAVERS:
        res = _as_nobody(lambda: _save(how, {"w": torch.ones(10)}, p))
        assert res[:3] == ("PermissionError", errno.EACCES, p), res
        assert p in res[3] and "no permission" in res[3] and ".fastckpt-tmp" not in res[3], res
    assert os.listdir(ro) == []


def test_permission_problem_is_not_no_such_file(shared_dir):
    """A parent that cannot be looked up (a 0700 directory of another user on
    the way) is a PermissionError, not 'does not exist'."""
    locked = os.path.join(shared_dir, "locked")
    os.mkdir(locked, 0o700)
    os.mkdir(os.path.join(locked, "run"))
    for p in (os.path.join(locked, "run", "x.pt"), os.path.join(locked, "missing", "x.pt")):
        res = _as_nobody(lambda: fastckpt.save({"w": torch.ones(10)}, p))
        assert res[:3] == ("PermissionError", errno.EACCES, p), res
        assert "permission denied" in res[3] and "does not exist" not in res[3], res
    assert os.listdir(os.path.join(locked, "run")) == []


# ---------------------------------------------------------------- DCP FastWriter

def test_fastwriter_refuses_bad_targets_at_once(tmp_path):
    from fastckpt.dcp import FastWriter
    for url in ("s3://bucket/step_1", "gs://b/c"):
        with pytest.raises(UnsupportedURLError):
            FastWriter(url)
        w = FastWriter(tmp_path / "ok")
        with pytest.raises(UnsupportedURLError):
            w.reset(url)  # what dcp.save(..., checkpoint_id=url) does
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError) as ei:
        FastWriter(tmp_path / "file")
    _check(ei.value, tmp_path / "file", "not a directory")
    with pytest.raises(NotADirectoryError):
        FastWriter(tmp_path / "file" / "sub")
    FastWriter(tmp_path / "new" / "nested")  # created with its parents when saving, as stock DCP does
    FastWriter("s3:/local")  # a relative local path


def test_fastwriter_read_only_directory(shared_dir):
    ro = os.path.join(shared_dir, "ro")
    os.mkdir(ro)
    os.chmod(ro, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)

    def make():
        from fastckpt.dcp import FastWriter
        FastWriter(os.path.join(ro, "step_1"))

    res = _as_nobody(make)
    assert res[:3] == ("PermissionError", errno.EACCES, os.path.join(ro, "step_1")), res


def test_command_reports_permission_not_missing(shared_dir, capsys):
    """`fastckpt inspect` through a directory the user cannot search says
    "Permission denied", not "no such file or directory"."""
    from fastckpt.cli import command as cli
    locked = os.path.join(shared_dir, "locked")
    os.mkdir(locked, 0o700)
    p = os.path.join(locked, "x.pt")
    fastckpt.save({"w": torch.ones(3)}, p)
    missing = os.path.join(shared_dir, "missing.pt")

    def run():
        import contextlib
        import io
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = cli.main(["inspect", p])
            rc2 = cli.main(["inspect", missing])
        raise RuntimeError(f"{rc} {rc2} {err.getvalue()}")

    res = _as_nobody(run)
    assert res[0] == "RuntimeError", res
    rc, rc2, out = res[3].split(" ", 2)
    lines = out.strip().splitlines()
    assert rc == "1" and "permission denied" in lines[0].lower() and p in lines[0], out
    assert "no such file" not in lines[0], out
    assert rc2 == "2" and "no such file" in lines[-1] and missing in lines[-1], out


@pytest.fixture
def read_only_fs(tmp_path):
    """A read-only tmpfs mounted for the test (root bypasses permission bits,
    not a read-only filesystem)."""
    import subprocess
    d = tmp_path / "ro-mount"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def test_read_only_filesystem(read_only_fs, state):
    p = read_only_fs / "x.pt"
    for how in SAVERS:
        with pytest.raises(OSError) as ei:
            _save(how, state, p)
        assert ei.value.errno == errno.EROFS
        _check(ei.value, p, "read-only filesystem", str(read_only_fs))
    assert pickled["n"] == 0
