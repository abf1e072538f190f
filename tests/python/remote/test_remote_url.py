"""fastckpt.save(obj, URL) / fastckpt.load(URL) against moto's real S3
server through s3fs, and file:// URLs."""

import io
import os

import pytest
import torch

import fastckpt
from fastckpt import FormatError, knobs
from fastckpt.errors import MissingDependencyError

from states import same_state
from s3_server import is_part_upload

MiB = 1 << 20


def _state(n=3_500_000):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(n, generator=g), "i": torch.arange(100), "meta": {"step": 3, "name": "x"}}


def _bk(url):
    rest = url.split("://", 1)[1]
    return rest.split("/", 1)


def test_save_load_round_trip_multipart(s3, tmp_path):
    url, opts, proxy, srv = s3
    sd = _state()  # 14 MB: three 5 MiB parts
    with knobs.override(remote_part_size=5 * MiB):
        fastckpt.save(sd, url + "/ckpt.pt", storage_options=opts)
    assert len([r for r in proxy.requests if is_part_upload(r[0], r[1])]) == 3
    b, k = _bk(url + "/ckpt.pt")
    blob = srv.boto3_client().get_object(Bucket=b, Key=k)["Body"].read()
    assert same_state(torch.load(io.BytesIO(blob), weights_only=True), sd)  # a torch checkpoint, whole
    fastckpt.save(sd, tmp_path / "local.pt")
    assert len(blob) == (tmp_path / "local.pt").stat().st_size  # the local save's bytes (but its random id)
    out = fastckpt.load(url + "/ckpt.pt", storage_options=opts)
    assert same_state(out, sd)  # bitwise
    gets = [r for r in proxy.requests if r[0] == "GET" and r[1].split("?")[0].endswith("/ckpt.pt")]
    assert len(gets) >= 1
    assert same_state(fastckpt.load(url + "/ckpt.pt", storage_options=opts, map_location="cpu", mmap=True), sd)


def test_load_checks_every_crc(s3):
    url, opts, proxy, srv = s3
    sd = _state(300_000)
    fastckpt.save(sd, url + "/c.pt", storage_options=opts)
    b, k = _bk(url + "/c.pt")
    c = srv.boto3_client()
    blob = bytearray(c.get_object(Bucket=b, Key=k)["Body"].read())
    raw = sd["w"].numpy().tobytes()
    at = bytes(blob).find(raw[:64])
    assert at > 0
    blob[at + 1000] ^= 0xFF
    c.put_object(Bucket=b, Key=k, Body=bytes(blob))
    with pytest.raises(FormatError, match="checksum mismatch") as ei:
        fastckpt.load(url + "/c.pt", storage_options=opts)
    assert url + "/c.pt" in str(ei.value) and "/proc/self/fd" not in str(ei.value)


def test_failed_save_leaves_the_previous_object(s3):
    url, opts, proxy, srv = s3
    old = _state(1000)
    fastckpt.save(old, url + "/c.pt", storage_options=opts)
    proxy.add("500", count=None, match=lambda m, p: m == "PUT")
    with knobs.override(remote_attempts=2), pytest.raises(OSError) as ei:
        fastckpt.save(_state(), url + "/c.pt", storage_options=opts)
    assert ei.value.filename == url + "/c.pt" and "after 2 attempts" in str(ei.value)
    proxy.clear()
    assert same_state(fastckpt.load(url + "/c.pt", storage_options=opts), old)


class Counted:
    n = 0

    def __reduce__(self):
        Counted.n += 1
        return (int, ())


def test_store_is_checked_before_pickling(s3):
    url, opts, proxy, _ = s3
    Counted.n = 0
    with pytest.raises(PermissionError) as ei:
        fastckpt.save({"c": Counted()}, url + "/c.pt", storage_options=dict(opts, key="testing", secret="testing"))
    assert ei.value.filename == url + "/c.pt"
    with pytest.raises(FileNotFoundError) as ei:
        fastckpt.save({"c": Counted()}, "s3://no-such-bucket/c.pt", storage_options=opts)
    assert ei.value.filename == "s3://no-such-bucket/c.pt"
    assert Counted.n == 0
    with pytest.raises(FileNotFoundError) as ei:
        fastckpt.load(url + "/missing.pt", storage_options=opts)
    assert ei.value.filename == url + "/missing.pt"


def test_file_url_round_trip(tmp_path):
    sd = _state(10_000)
    url = "file://" + str(tmp_path / "shared" / "c.pt")
    (tmp_path / "shared").mkdir()
    fastckpt.save(sd, url)
    assert same_state(torch.load(tmp_path / "shared" / "c.pt", weights_only=True), sd)
    assert same_state(fastckpt.load(url), sd)
    assert os.listdir(tmp_path / "shared") == ["c.pt"]


def test_url_misuse():
    with pytest.raises(IsADirectoryError):
        fastckpt.save({}, "file:///tmp/")
    with pytest.raises(ValueError, match="storage_options"):
        fastckpt.save({}, "/tmp/x.pt", storage_options={"key": "k"})
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match=r"fastckpt-io\[gcs\]"):
            fastckpt.load("gs://bucket/x.pt")


class Thing:
    def __init__(self):
        self.x = 7


def test_load_arguments_pass_through(tmp_path):
    """weights_only=False with an object only full unpickling rebuilds, an
    explicit pickle_module, map_location: the same call as for a path."""
    import pickle
    import collections
    (tmp_path / "t").mkdir()
    url = "file://" + str(tmp_path / "t" / "c.pt")
    obj = {"od": collections.OrderedDict(a=torch.ones(2)), "t": Thing()}
    fastckpt.save(obj, url)
    out = fastckpt.load(url, weights_only=False, pickle_module=pickle, map_location="cpu")
    assert out["t"].x == 7 and torch.equal(out["od"]["a"], torch.ones(2))
    with pytest.raises(pickle.UnpicklingError):
        fastckpt.load(url, weights_only=True)


def test_empty_object_round_trip(s3, tmp_path):
    from fastckpt.remote import download, open_store, upload
    url, opts, _, _ = s3
    (tmp_path / "e").write_bytes(b"")
    store = open_store(url, opts)
    fd = os.open(tmp_path / "e", os.O_RDONLY)
    try:
        assert upload(store, "e", fd, 0) == 0
    finally:
        os.close(fd)
    assert download(store, "e", str(tmp_path / "back"), 0, 0) == 0 and (tmp_path / "back").read_bytes() == b""
