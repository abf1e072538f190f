"""fastckpt.remote's stores and transfers against a real S3 HTTP endpoint
(moto's server, started by conftest's fixtures) through s3fs, with faults
injected by an HTTP proxy in front of it (tests/support/s3_server.py)."""

import errno
import os
import zlib

import pytest

from fastckpt import FormatError
from fastckpt.errors import MissingDependencyError
from fastckpt.remote import TransferOptions, TransferStats, download, open_store, upload
from fastckpt.remote import _policy

from s3_server import is_complete_upload, is_part_upload

MiB = 1 << 20
FAST = dict(backoff_s=0.01, max_backoff_s=0.05)


def _file(path, size, seed=0):
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    data = bytes((b + seed) % 256 for b in data[:4096]) + data[4096:]
    path.write_bytes(data)
    return data


def _up(store, key, path, opts, stats=None):
    fd = os.open(path, os.O_RDONLY)
    try:
        return upload(store, key, fd, os.fstat(fd).st_size, opts, str(path), stats)
    finally:
        os.close(fd)


def _bucket_key(url, key):
    rest = url.split("://", 1)[1]
    return rest.split("/", 1)[0], (rest.split("/", 1)[1] + "/" + key) if "/" in rest else key


def _objects(srv, url):
    b, k = _bucket_key(url, "")
    r = srv.boto3_client().list_objects_v2(Bucket=b, Prefix=k)
    return {o["Key"][len(k):]: o["Size"] for o in r.get("Contents", [])}


def _unfinished(srv, url):
    b, k = _bucket_key(url, "")
    return srv.boto3_client().list_multipart_uploads(Bucket=b, Prefix=k).get("Uploads", [])


# ---------------------------------------------------------------- construction

def test_wrong_credentials_fail_at_construction(s3):
    url, opts, proxy, _ = s3
    with pytest.raises(PermissionError) as ei:
        open_store(url, dict(opts, key="testing", secret="testing"))
    assert ei.value.filename == url and "refused" in str(ei.value), ei.value
    assert not [r for r in proxy.requests if r[0] == "PUT"]  # nothing was written


def test_missing_bucket_fails_at_construction(s3):
    _, opts, _, _ = s3
    with pytest.raises(FileNotFoundError) as ei:
        open_store("s3://no-such-bucket/run", opts)
    assert ei.value.filename == "s3://no-such-bucket/run" and "does not exist" in str(ei.value)


def test_missing_extra_names_the_pip_extra():
    try:
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed here")
    except ImportError:
        pass
    with pytest.raises(MissingDependencyError) as ei:
        open_store("gs://bucket/run")
    assert isinstance(ei.value, ImportError) and "fastckpt-io[gcs]" in str(ei.value) and "gs://bucket/run" in str(ei.value)


# ---------------------------------------------------------------- upload

def test_multipart_upload_round_trip_and_crc(s3, tmp_path):
    url, opts, proxy, srv = s3
    data = _file(tmp_path / "f", 13 * MiB + 123)
    store = open_store(url, opts)
    crc = _up(store, "d/f", tmp_path / "f", TransferOptions(part_size=5 * MiB, parallelism=2))
    assert crc == zlib.crc32(data)
    parts = [r for r in proxy.requests if is_part_upload(r[0], r[1])]
    assert sorted(r[2] for r in parts) == [3 * MiB + 123, 5 * MiB, 5 * MiB]
    b, k = _bucket_key(url, "d/f")
    assert srv.boto3_client().get_object(Bucket=b, Key=k)["Body"].read() == data


def test_s3_parts_are_at_least_5_mib_as_the_server_demands(s3, tmp_path):
    """moto enforces S3's minimum part size; a smaller part_size is raised to it."""
    url, opts, proxy, srv = s3
    b, k = _bucket_key(url, "raw")
    c = srv.boto3_client()
    uid = c.create_multipart_upload(Bucket=b, Key=k)["UploadId"]
    e1 = c.upload_part(Bucket=b, Key=k, UploadId=uid, PartNumber=1, Body=b"x" * MiB)["ETag"]
    e2 = c.upload_part(Bucket=b, Key=k, UploadId=uid, PartNumber=2, Body=b"y")["ETag"]
    with pytest.raises(Exception, match="EntityTooSmall"):
        c.complete_multipart_upload(Bucket=b, Key=k, UploadId=uid, MultipartUpload={
            "Parts": [{"PartNumber": 1, "ETag": e1}, {"PartNumber": 2, "ETag": e2}]})
    data = _file(tmp_path / "f", 6 * MiB)
    assert _up(open_store(url, opts), "f", tmp_path / "f", TransferOptions(part_size=MiB)) == zlib.crc32(data)
    assert sorted(r[2] for r in proxy.requests if is_part_upload(r[0], r[1])) == [MiB, 5 * MiB]


def test_memory_is_bounded_by_parallelism_times_part_size(s3, tmp_path):
    url, opts, proxy, _ = s3
    _file(tmp_path / "f", 40 * MiB)
    stats = TransferStats()
    _up(open_store(url, opts), "f", tmp_path / "f", TransferOptions(part_size=5 * MiB, parallelism=3), stats)
    assert stats.parts == 8 and stats.bytes == 40 * MiB
    assert 5 * MiB < stats.peak_buffered <= 3 * 5 * MiB, stats  # parallel, and bounded
    assert 1 < proxy.max_parts_in_progress <= 3


@pytest.mark.parametrize("kind", ["500", "reset"])
def test_transient_errors_are_retried(s3, tmp_path, kind):
    url, opts, proxy, srv = s3
    data = _file(tmp_path / "f", 11 * MiB)
    # three in a row: more than aiohttp's own one retry of a dropped keep-alive connection
    fault = proxy.add(kind, nth=2, count=3, match=is_part_upload)
    crc = _up(open_store(url, opts), "f", tmp_path / "f", TransferOptions(part_size=5 * MiB, attempts=4, **FAST))
    assert fault.fired == 3 and crc == zlib.crc32(data)
    assert _objects(srv, url) == {"f": len(data)}


def test_persistent_500_fails_clearly_and_leaves_nothing(s3, tmp_path):
    url, opts, proxy, srv = s3
    _file(tmp_path / "f", 11 * MiB)
    before = (tmp_path / "f").read_bytes()
    fault = proxy.add("500", count=None, match=is_part_upload)
    with pytest.raises(OSError) as ei:
        _up(open_store(url, opts), "f", tmp_path / "f", TransferOptions(part_size=5 * MiB, parallelism=1, attempts=3,
                                                                          **FAST))
    msg = str(ei.value)
    assert ei.value.filename == url + "/f" and str(tmp_path / "f") in msg and "after 3 attempts" in msg, msg
    assert "injected by the test proxy" in msg, msg  # the last cause
    assert fault.fired == 3  # attempts bound the time spent
    assert _objects(srv, url) == {} and _unfinished(srv, url) == []  # aborted: nothing visible, nothing left
    assert (tmp_path / "f").read_bytes() == before


def test_a_lost_answer_to_complete_is_checked_not_failed(s3, tmp_path, caplog):
    """CompleteMultipartUpload done by the server, its answer lost (the connection reset after it was
    forwarded): the retry finds no such upload, the object is checked (size, multipart ETag) and the
    upload succeeds."""
    url, opts, proxy, srv = s3
    data = _file(tmp_path / "f", 11 * MiB)
    fault = proxy.add("drop_reply", count=None, match=is_complete_upload)
    with caplog.at_level("WARNING", logger="fastckpt.remote"):
        crc = _up(open_store(url, opts), "d/f", tmp_path / "f",
                  TransferOptions(part_size=5 * MiB, attempts=3, **FAST))
    assert crc == zlib.crc32(data) and fault.fired >= 1
    b, k = _bucket_key(url, "d/f")
    assert srv.boto3_client().get_object(Bucket=b, Key=k)["Body"].read() == data
    assert _unfinished(srv, url) == []  # completed, not aborted
    assert any("answer to completing it was lost" in r.getMessage() and "ETag" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_failed_complete_stays_a_failure(s3, tmp_path):
    """A complete that the server refuses every time (500, never forwarded) is an OSError naming the
    URL and the cause, with what the check of the object found; a same-sized older object at the key
    is told apart by its bytes (its ETag differs, the CRC-32 read back too)."""
    url, opts, proxy, srv = s3
    _file(tmp_path / "f", 11 * MiB)
    store = open_store(url, opts)
    topts = TransferOptions(part_size=5 * MiB, attempts=2, **FAST)
    proxy.add("500", count=None, match=is_complete_upload)
    with pytest.raises(OSError) as ei:
        _up(store, "f", tmp_path / "f", topts)
    msg = str(ei.value)
    assert ei.value.filename == url + "/f" and "injected by the test proxy" in msg and "does not exist" in msg, msg
    assert _objects(srv, url) == {} and _unfinished(srv, url) == []
    b, k = _bucket_key(url, "f")
    srv.boto3_client().put_object(Bucket=b, Key=k, Body=b"o" * (11 * MiB))  # an older object, same size
    with pytest.raises(OSError) as ei:
        _up(store, "f", tmp_path / "f", topts)
    assert "holds other bytes" in str(ei.value), ei.value
    assert srv.boto3_client().get_object(Bucket=b, Key=k)["Body"].read() == b"o" * (11 * MiB)


def test_stalled_server_times_out_with_a_clear_error(s3, tmp_path):
    url, opts, proxy, srv = s3
    _file(tmp_path / "f", 6 * MiB)
    opts = dict(opts, config_kwargs={"read_timeout": 1, "connect_timeout": 1})
    fault = proxy.add("stall", count=None, match=is_part_upload)
    with pytest.raises(OSError) as ei:
        _up(open_store(url, opts), "f", tmp_path / "f", TransferOptions(part_size=5 * MiB, parallelism=1, attempts=2,
                                                                          **FAST))
    assert ei.value.filename == url + "/f" and "after 2 attempts" in str(ei.value), ei.value
    assert "timeout" in str(ei.value).lower(), ei.value
    assert fault.fired == 2
    assert _objects(srv, url) == {}


def test_bandwidth_cap_paces_the_parts(monkeypatch):
    """The throttle asks to sleep what keeps the average at the cap (a fake clock: no timing assertion)."""
    now = [100.0]
    slept = []
    monkeypatch.setattr(_policy.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(_policy.time, "sleep", lambda s: slept.append(s))
    t = _policy.Throttle(1000)
    for _ in range(4):
        t.take(500)
    assert slept == [0.5, 1.0, 1.5]
    assert _policy.Throttle(0).take(10**9) is None


def test_transient_classification():
    assert _policy.transient(OSError(errno.ECONNRESET, "reset"))
    assert _policy.transient(TimeoutError())
    assert not _policy.transient(FileNotFoundError(errno.ENOENT, "x"))
    assert not _policy.transient(PermissionError(errno.EACCES, "x"))
    assert not _policy.transient(ValueError("x"))


# ---------------------------------------------------------------- download

def test_download_checks_size_and_crc(s3, tmp_path):
    url, opts, proxy, srv = s3
    data = _file(tmp_path / "f", 12 * MiB)
    store = open_store(url, opts)
    crc = _up(store, "f", tmp_path / "f", TransferOptions(part_size=5 * MiB))
    o = TransferOptions(part_size=5 * MiB, parallelism=3)
    assert download(store, "f", str(tmp_path / "out" / "g"), len(data), crc, o) == crc
    assert (tmp_path / "out" / "g").read_bytes() == data
    gets = [r for r in proxy.requests if r[0] == "GET" and "/f" in r[1]]
    assert len(gets) >= 3  # ranged reads
    # damaged remote bytes (same size): refused, nothing left locally
    b, k = _bucket_key(url, "f")
    bad = bytearray(data)
    bad[7 * MiB] ^= 1
    srv.boto3_client().put_object(Bucket=b, Key=k, Body=bytes(bad))
    with pytest.raises(FormatError, match="CRC-32.*damaged remote object") as ei:
        download(store, "f", str(tmp_path / "out" / "h"), len(data), crc, o)
    assert url + "/f" in str(ei.value)
    assert sorted(os.listdir(tmp_path / "out")) == ["g"]
    with pytest.raises(FormatError, match="manifest says"):
        download(store, "f", str(tmp_path / "out" / "h"), len(data) + 1, crc, o)
    assert sorted(os.listdir(tmp_path / "out")) == ["g"]


def test_file_url_store(tmp_path):
    """file:// on a second local directory: the engine commits each upload."""
    data = _file(tmp_path / "f", 3 * MiB + 5)
    url = "file://" + str(tmp_path / "tier")
    store = open_store(url)
    crc = _up(store, "step_1/f", tmp_path / "f", TransferOptions(part_size=MiB, parallelism=3))
    assert crc == zlib.crc32(data)
    assert (tmp_path / "tier" / "step_1" / "f").read_bytes() == data
    assert store.list() == {"step_1/f": len(data)}
    assert download(store, "step_1/f", str(tmp_path / "back"), len(data), crc) == crc
    assert (tmp_path / "back").read_bytes() == data
    assert [n for n in os.listdir(tmp_path / "tier" / "step_1") if "tmp" in n] == []
