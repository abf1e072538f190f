"""fastckpt.remote.Replicator: background replication of committed local
checkpoints, the manifest as commit marker, retention, and restore that
never uses an incomplete or damaged step; against moto's real S3 server
(through s3fs and a fault-injecting proxy) and a file:// tier."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

import fastckpt
from fastckpt import FormatError
from fastckpt.remote import Replicator, TransferOptions, open_store, read_manifest
from fastckpt.remote import manifest as mf
from fastckpt.remote import replicator as rep_mod

import fastspawn  # noqa: E402
from states import same_state
from paths import ROOT, SUPPORT
from s3_server import is_part_upload

MiB = 1 << 20
SMALL = TransferOptions(part_size=5 * MiB, parallelism=2, attempts=3, backoff_s=0.01, max_backoff_s=0.05)
HERE = str(SUPPORT)  # the helpers' folder, for the child of test_sigkill_mid_upload


def _hold_step_one(monkeypatch) -> threading.Event:
    """Make the replicator's upload of step 1 wait (at most 30 s) until the returned event is set."""
    gate = threading.Event()
    real = rep_mod.upload_step_files

    def slow(store, step, opened, *a, **kw):
        if step == 1:
            gate.wait(30)
        return real(store, step, opened, *a, **kw)

    monkeypatch.setattr(rep_mod, "upload_step_files", slow)
    return gate


def _open_under(d):
    """This process's descriptors open on files under `d` (a leak check)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(d)):
            out.append(target)
    return out


def _ckpt(path, step, n=300_000):
    sd = {"step": step, "w": torch.arange(n, dtype=torch.float32) * step}
    fastckpt.save(sd, path)
    return sd


def _bk(url, key):
    rest = url.split("://", 1)[1]
    b, pfx = rest.split("/", 1)
    return b, f"{pfx}/{key}"


def _put(srv, url, key, data):
    b, k = _bk(url, key)
    srv.boto3_client().put_object(Bucket=b, Key=k, Body=data)


def _get(srv, url, key):
    b, k = _bk(url, key)
    return srv.boto3_client().get_object(Bucket=b, Key=k)["Body"].read()


def _replicate(url, opts, steps, tmp_path, **kw):
    r = Replicator(url, opts, transfer=SMALL, **kw)
    sds = {}
    for s in steps:
        p = tmp_path / "local" / f"step_{s}.pt"
        p.parent.mkdir(exist_ok=True)
        sds[s] = _ckpt(p, s)
        r.submit(s, p)
        r.wait()
    return r, sds


# ---------------------------------------------------------------- round trips

def test_replicate_and_restore_a_file_step(s3, tmp_path):
    url, opts, proxy, srv = s3
    r, sds = _replicate(url, opts, [1, 2], tmp_path)
    assert r.list_steps() == [1, 2]
    m = read_manifest(r.store, 2)
    local = (tmp_path / "local" / "step_2.pt").read_bytes()
    assert m["kind"] == "file" and m["name"] == "step_2.pt" and m["step"] == 2
    assert m["files"] == [{"path": "step_2.pt", "size": len(local), "crc32": zlib.crc32(local)}]
    assert _get(srv, url, "step_2/step_2.pt") == local
    step, path = r.restore(tmp_path / "fresh")
    assert (step, path) == (2, str(tmp_path / "fresh" / "step_2.pt"))
    assert (tmp_path / "fresh" / "step_2.pt").read_bytes() == local  # bitwise
    assert same_state(fastckpt.load(path), sds[2])
    st = r.status()
    assert st["last_complete"] == 2 and st["last_error"] is None and st["uploading"] is None
    r.close()


def test_manifest_is_written_last(s3, tmp_path, monkeypatch):
    url, opts, proxy, srv = s3
    _ckpt(tmp_path / "c.pt", 1)
    r = Replicator(url, opts, transfer=SMALL)
    r.submit(1, tmp_path / "c.pt").result()
    puts = [p for m, p, _ in proxy.requests if m in ("PUT", "POST")]
    assert puts and mf.MANIFEST in puts[-1] and all(mf.MANIFEST not in p for p in puts[:-1]), puts
    r.close()


def test_replicate_a_directory_step_to_a_file_tier(tmp_path):
    """A DCP-style directory to file:// (a second local directory)."""
    d = tmp_path / "local" / "step_7"
    (d / "sub").mkdir(parents=True)
    files = {"__0_0.distcp": os.urandom(3 * MiB + 7), "sub/x": b"", ".metadata": b"meta" * 100}
    for k, v in files.items():
        (d / k).write_bytes(v)
    (d / "y.fastckpt-tmp.abc").write_bytes(b"a temporary file is no part of it")
    url = "file://" + str(tmp_path / "tier")
    r = Replicator(url, transfer=TransferOptions(part_size=MiB, parallelism=3))
    m = r.submit(7, d).result()
    assert m["kind"] == "directory" and sorted(f["path"] for f in m["files"]) == sorted(files)
    step, path = r.restore(tmp_path / "fresh")
    assert step == 7 and path == str(tmp_path / "fresh" / "step_7")
    for k, v in files.items():
        assert (tmp_path / "fresh" / "step_7" / k).read_bytes() == v
    assert not (tmp_path / "fresh" / "step_7" / "y.fastckpt-tmp.abc").exists()
    assert sorted(os.listdir(tmp_path / "fresh")) == ["step_7"]
    r.close()


def test_keep_last_remote(s3, tmp_path):
    url, opts, _, _ = s3
    r, _ = _replicate(url, opts, [1, 2, 3, 4], tmp_path, keep_last_remote=2)
    assert r.list_steps() == [3, 4]
    assert sorted(mf.list_step_prefixes(r.store)) == [3, 4]  # the files went too
    r.close()


def test_a_newer_step_supersedes_a_queued_one(s3, tmp_path, monkeypatch):
    url, opts, _, _ = s3
    gate = _hold_step_one(monkeypatch)
    for s in (1, 2, 3):
        _ckpt(tmp_path / f"s{s}.pt", s, 1000)
    r = Replicator(url, opts, transfer=SMALL)
    f1 = r.submit(1, tmp_path / "s1.pt")
    while r.status()["uploading"] != 1:
        time.sleep(0.01)
    f2 = r.submit(2, tmp_path / "s2.pt")
    f3 = r.submit(3, tmp_path / "s3.pt")
    os.unlink(tmp_path / "s3.pt")  # local retention may delete it: its files are open
    assert f2.cancelled() and r.status()["queued"] == 3
    assert sorted(os.path.basename(p) for p in _open_under(tmp_path)) == ["s1.pt", "s3.pt (deleted)"]
    gate.set()
    assert r.wait() == 3
    assert _open_under(tmp_path) == []
    assert f1.result()["step"] == 1 and f3.result()["step"] == 3
    assert r.list_steps() == [1, 3]
    r.close()


# ---------------------------------------------------------------- failures

def test_upload_failure_is_reported_and_local_untouched(s3, tmp_path):
    url, opts, proxy, srv = s3
    _ckpt(tmp_path / "c.pt", 1, 2_000_000)
    before = (tmp_path / "c.pt").read_bytes()
    proxy.add("500", count=None, match=is_part_upload)
    r = Replicator(url, opts, transfer=SMALL)
    fut = r.submit(5, tmp_path / "c.pt")
    with pytest.raises(OSError) as ei:
        r.wait()
    assert url + "/step_5/c.pt" in str(ei.value) and "after 3 attempts" in str(ei.value), ei.value
    assert isinstance(fut.exception(), OSError)
    st = r.status()
    assert st["last_error_step"] == 5 and "injected by the test proxy" in st["last_error"], st
    assert r.wait() is None  # reported once
    assert (tmp_path / "c.pt").read_bytes() == before
    assert _open_under(tmp_path) == []  # the step's descriptors were closed
    assert r.list_steps() == []
    with pytest.raises(FileNotFoundError):
        r.restore(tmp_path / "fresh")
    r.close()


def test_wrong_credentials_and_missing_bucket_at_construction(s3, tmp_path):
    url, opts, proxy, _ = s3
    with pytest.raises(PermissionError) as ei:
        Replicator(url, dict(opts, secret="wrong"))
    assert ei.value.filename == url
    with pytest.raises(FileNotFoundError) as ei:
        Replicator("s3://no-such-bucket/x", opts)
    assert "no-such-bucket" in str(ei.value)


def test_damaged_remote_object_is_not_restored(s3, tmp_path):
    url, opts, proxy, srv = s3
    r, sds = _replicate(url, opts, [1, 2], tmp_path)
    data = bytearray(_get(srv, url, "step_2/step_2.pt"))
    data[len(data) // 2] ^= 0xFF  # same size: only the CRC tells
    _put(srv, url, "step_2/step_2.pt", bytes(data))
    with pytest.warns(RuntimeWarning, match="step 2.*CRC-32"):
        step, path = r.restore(tmp_path / "fresh")
    assert step == 1 and path.endswith("step_1.pt")
    assert sorted(os.listdir(tmp_path / "fresh")) == ["step_1.pt"]  # nothing of step 2
    assert _open_under(tmp_path / "fresh") == []
    assert same_state(fastckpt.load(path), sds[1])
    with pytest.raises(FileNotFoundError, match="CRC-32"):
        r.restore(tmp_path / "fresh2", step=2)
    r.close()


def test_manifest_naming_a_missing_file(s3, tmp_path):
    url, opts, proxy, srv = s3
    r, _ = _replicate(url, opts, [1, 2], tmp_path)
    b, k = _bk(url, "step_2/step_2.pt")
    srv.boto3_client().delete_object(Bucket=b, Key=k)
    with pytest.warns(RuntimeWarning, match="does not exist"):
        assert r.restore(tmp_path / "fresh")[0] == 1
    r.close()


def test_malformed_manifest(s3, tmp_path):
    url, opts, proxy, srv = s3
    r, _ = _replicate(url, opts, [1, 2], tmp_path)
    good = json.loads(_get(srv, url, mf.manifest_key(2)))
    for bad in (b"{not json", json.dumps(dict(good, step=3)).encode(), json.dumps(dict(good, files=[])).encode(),
                json.dumps(dict(good, name="../x")).encode(), json.dumps(dict(good, version=99)).encode()):
        _put(srv, url, mf.manifest_key(2), bad)
        with pytest.raises(FormatError) as ei:
            read_manifest(r.store, 2)
        assert url + "/" + mf.manifest_key(2) in str(ei.value)
        with pytest.warns(RuntimeWarning):
            assert r.restore(tmp_path / "fresh")[0] == 1
    r.close()


def test_step_without_manifest_is_never_restored(s3, tmp_path):
    url, opts, proxy, srv = s3
    r, _ = _replicate(url, opts, [1], tmp_path)
    _put(srv, url, "step_9/step_9.pt", (tmp_path / "local" / "step_1.pt").read_bytes())
    assert r.list_steps() == [1]
    assert r.restore(tmp_path / "fresh")[0] == 1
    with pytest.raises(FileNotFoundError):
        r.restore(tmp_path / "fresh", step=9)
    r.close()
    Replicator(url, opts)  # the next start cleans incomplete steps
    assert sorted(mf.list_step_prefixes(r.store)) == [1]


_KILLED = r"""
import sys
sys.path.insert(0, {here!r})
from fastckpt.remote import Replicator, TransferOptions
r = Replicator({url!r}, {opts!r}, transfer=TransferOptions(part_size=5 << 20, parallelism=1))
r.submit(3, {path!r})
r.wait()
print("finished")
"""


def test_sigkill_mid_upload(s3, tmp_path):
    url, opts, proxy, srv = s3
    r, sds = _replicate(url, opts, [1], tmp_path)
    _ckpt(tmp_path / "big.pt", 3, 4_000_000)  # 16 MB: 4 parts
    proxy.add("stall", nth=3, count=None, match=is_part_upload)  # holds the upload after two parts
    code = _KILLED.format(here=HERE, url=url, opts=opts, path=str(tmp_path / "big.pt"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), HERE]))
    p = fastspawn.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while sum(1 for m, q, _ in proxy.requests if is_part_upload(m, q)) < 2:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    proxy.clear()
    b, k = _bk(url, "")
    c = srv.boto3_client()
    assert len(c.list_multipart_uploads(Bucket=b, Prefix=k).get("Uploads", [])) == 1
    assert r.list_steps() == [1]  # no manifest: never restored
    assert r.restore(tmp_path / "fresh")[0] == 1
    Replicator(url, opts)  # the next start aborts the killed upload
    assert c.list_multipart_uploads(Bucket=b, Prefix=k).get("Uploads", []) == []
    assert sorted(mf.list_step_prefixes(r.store)) == [1]
    r.close()


def test_sharded_mode_each_rank_uploads_its_files(tmp_path):
    """Sharded (DCP) mode as the manager drives it: each rank uploads its own
    files, rank 0 writes the manifest with every rank's entries last."""
    from fastckpt.remote import LocalCheckpoint, commit_step, restore_step, upload_step_files
    d = tmp_path / "step_4"
    d.mkdir()
    files = {"__0_0.distcp": os.urandom(1000), "__1_0.distcp": os.urandom(2000), ".metadata": b"m"}
    for k, v in files.items():
        (d / k).write_bytes(v)
    store = open_store("file://" + str(tmp_path / "tier"))
    entries = []
    for mine in (["__0_0.distcp", ".metadata"], ["__1_0.distcp"]):  # rank 0's, rank 1's
        ck = LocalCheckpoint(d, files=mine)
        entries += upload_step_files(store, 4, ck)
        ck.close()
        assert mf.list_steps(store) == []  # not complete before the manifest
    commit_step(store, 4, "directory", "step_4", entries)
    assert mf.list_steps(store) == [4]
    step, path = restore_step(store, str(tmp_path / "fresh"))
    assert step == 4 and all((tmp_path / "fresh" / "step_4" / k).read_bytes() == v for k, v in files.items())
    with pytest.raises(FileNotFoundError):
        LocalCheckpoint(d, files=["nope"])


def test_manifest_parser_refuses_any_bytes_cleanly():
    from hypothesis import given, settings, strategies as st

    good = json.dumps(mf.make_manifest(1, "file", "a.pt", [{"path": "a.pt", "size": 1, "crc32": 2}])).encode()
    assert mf.parse_manifest(good, "u", 1)["step"] == 1

    @settings(max_examples=200, deadline=None)
    @given(st.one_of(st.binary(max_size=300), st.binary(max_size=30).map(lambda b: good[:len(good) // 2] + b),
                     st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                                  lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                      max_size=4)).map(
                         lambda v: json.dumps(v).encode())))
    def check(data):
        try:
            m = mf.parse_manifest(data, "u")
        except FormatError as e:
            assert str(e).startswith("u: ")
        else:
            assert m["format"] == mf.FORMAT

    check()
    deep = b"[" * 100000 + b"]" * 100000
    with pytest.raises(FormatError):
        mf.parse_manifest(deep, "u")


def test_other_fsspec_filesystems_stream_in_order(tmp_path):
    """A filesystem with no multipart API (fsspec's memory://, as gcsfs): one
    stream, parts in order; the same manifest, CRC and restore."""
    import uuid
    url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    sd = _ckpt(tmp_path / "step_1.pt", 1, 1_000_000)
    r = Replicator(url, transfer=TransferOptions(part_size=MiB, parallelism=4))
    m = r.submit(1, tmp_path / "step_1.pt").result()
    assert m["files"][0]["crc32"] == zlib.crc32((tmp_path / "step_1.pt").read_bytes())
    assert r.list_steps() == [1]
    step, path = r.restore(tmp_path / "fresh")
    assert step == 1 and same_state(fastckpt.load(path), sd)
    r.close()


def test_a_step_cancelled_by_its_caller_does_not_hang_wait(tmp_path, monkeypatch):
    gate = _hold_step_one(monkeypatch)
    for s in (1, 2):
        _ckpt(tmp_path / f"s{s}.pt", s, 1000)
    r = Replicator("file://" + str(tmp_path / "tier"))
    r.submit(1, tmp_path / "s1.pt")
    while r.status()["uploading"] != 1:
        time.sleep(0.01)
    assert r.submit(2, tmp_path / "s2.pt").cancel()
    gate.set()
    assert r.wait(timeout=60) == 1
    assert r.list_steps() == [1] and _open_under(tmp_path) == []
    r.close()
