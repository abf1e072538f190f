"""Object stores and shared filesystems behind one small interface, on fsspec.

:func:`open_store` turns an fsspec URL (``s3://bucket/prefix``,
``gs://bucket/prefix``, ``file:///mnt/shared/ckpt``) and its
``storage_options`` (passed to the fsspec filesystem unchanged, as DCP's
fsspec writer and Lightning take them) into a :class:`Store`, and checks at
once that it can be used: wrong credentials or a missing bucket raise here,
naming the URL and the cause, not at the first upload.

A store speaks in keys relative to its root URL and offers what the transfers
(:mod:`fastckpt.remote.transfer`) need: size, ranged read, small atomic put,
listing, delete, and a multipart upload that becomes visible only when it is
complete: S3's multipart upload (CompleteMultipartUpload is atomic), the
engine's commit for ``file://`` (a temporary file in the same directory,
fdatasync, rename, directory fsync), and for other fsspec filesystems one
stream written in order (gcsfs makes an object visible when its upload is
finalized). S3's multipart upload can also be *shared*: one process creates
it, any process that knows its id (:attr:`Upload.token`) sends parts of it
(:meth:`Store.join_upload`), the creator completes it: the ranks of a job
upload one file together (:mod:`fastckpt.remote.team`). The other stores
cannot (``shared_uploads`` is False): a shared upload there is one rank's.

The clients' own retries are turned off (s3fs's loop, botocore's
``max_attempts``) unless ``storage_options`` set them: the transfers retry
with one policy (:mod:`fastckpt.remote._policy`), which bounds how long a
failing store is tried.
"""

import copy
import errno
import hashlib
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

from .._core import engine as _engine
from .._core.atomic import write_file
from .._core.tempnames import is_temp, remove_leftovers_in
from .._core.paths import _URL, is_url  # noqa: F401 (re-exported)
from .._core.engine import fsync_dir
from ..errors import MissingDependencyError
from ._policy import S3_MIN_PART, TransferOptions, retry

__all__ = ["is_url", "open_store", "Store", "Upload", "EXTRAS"]

log = logging.getLogger("fastckpt.remote")

# scheme -> (the module it needs, the pip extra of fastckpt that installs it)
EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


def _scheme(url: str) -> str:
    m = _URL.match(url)
    if not m:
        raise ValueError(f"{url!r} is not a URL (scheme://...)")
    return m.group(1).lower()


def _need(url: str, scheme: str) -> None:
    mod, extra = EXTRAS.get(scheme, (None, None))
    if mod is None:
        return
    try:
        __import__(mod)
    except ImportError as e:
        raise MissingDependencyError(
            f"fastckpt: {url!r} needs {mod}, which is not installed: pip install 'fastckpt-io[{extra}]' "
            f"({type(e).__name__}: {e})", name=mod) from e


def open_store(url: str, storage_options: Optional[Dict[str, Any]] = None,
               transfer: Optional[TransferOptions] = None, validate: bool = True) -> "Store":
    """The store at ``url``, checked (with ``validate``) before it is returned.

    Args:
        url: an fsspec URL: ``s3://bucket[/prefix]``, ``gs://bucket[/prefix]``,
            ``file:///absolute/dir``, or another fsspec protocol.
        storage_options: keyword arguments of the fsspec filesystem (s3fs:
            ``key``, ``secret``, ``token``, ``client_kwargs={"endpoint_url": ...}``,
            ``config_kwargs``, ...), passed unchanged but for the clients' retries.
        transfer: the retry policy of the check (the knobs' when None).

    Raises:
        fastckpt.errors.MissingDependencyError: the scheme's package is not
            installed (the message names the pip extra, ``fastckpt-io[s3]``).
        PermissionError: the credentials are refused.
        FileNotFoundError: the bucket (or, for ``file://``, the directory's
            parent) does not exist.
        OSError: the store cannot be reached (after the retries).
        ValueError: ``url`` is not a URL.
    """
    scheme = _scheme(url)
    _need(url, scheme)
    try:
        import fsspec
    except ImportError as e:  # fsspec comes with torch; a stripped environment
        raise MissingDependencyError(f"fastckpt: {url!r} needs fsspec: pip install 'fastckpt-io[s3]'",
                                     name="fsspec") from e
    opts = copy.deepcopy(dict(storage_options or {}))
    if scheme in ("s3", "s3a"):
        store: Store = S3Store(url, opts)
    elif scheme == "file":
        store = LocalStore(url, opts)
    else:
        try:
            fs_cls = fsspec.get_filesystem_class(scheme)
        except (ImportError, ValueError) as e:
            raise MissingDependencyError(f"fastckpt: {url!r}: fsspec cannot open {scheme}:// here: {e}",
                                         name=scheme) from e
        try:
            store = FsspecStore(url, opts, fs_cls)
        except ImportError as e:  # hdfs:// without pyarrow, ...
            raise MissingDependencyError(f"fastckpt: {url!r} needs {e.name or 'a package'}, which is not installed "
                                         f"({type(e).__name__}: {e})", name=e.name) from e
    if validate:
        store.validate((transfer or TransferOptions()).resolved())
    return store


class Upload:
    """One object being uploaded; visible under its key only after :meth:`complete`."""

    parallel = True  # parts may be sent at once, in any order
    token: Optional[str] = None  # what another process needs to join it (Store.join_upload), if it can

    def expected_etag(self, parts: List[Tuple[int, Any]]) -> Optional[str]:
        """The ETag the complete object has when ``parts`` (number, what
        put_part returned) made it, where the store's ETags tell that; else None."""
        return None

    def put_part(self, number: int, offset: int, data: bytes) -> Any:
        raise NotImplementedError

    def complete(self, parts: List[Tuple[int, Any]]) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class Store:
    """A root URL and its fsspec filesystem; keys are '/'-separated, relative to the root."""

    min_part = 1  # the smallest part but the last one
    shared_uploads = False  # whether join_upload works: several processes send the parts of one upload

    def __init__(self, url: str, fs, root: str):
        self.url = url.rstrip("/")
        self.fs = fs
        self.root = root.rstrip("/")

    def key_url(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    # --- what every store implements
    def validate(self, opts: TransferOptions) -> None:
        raise NotImplementedError

    def size(self, key: str) -> int:
        """The object's size; FileNotFoundError if there is none."""
        self.fs.invalidate_cache()
        return int(self.fs.size(self._path(key)))

    def head(self, key: str) -> Tuple[int, Optional[str]]:
        """(size, ETag or None) of the object; FileNotFoundError if there is none."""
        return self.size(key), None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(self._path(key), start=start, end=end)

    def put(self, key: str, data: bytes) -> None:
        """A small object, written whole (visible only complete)."""
        self.fs.pipe_file(self._path(key), data)

    def list(self, prefix: str = "") -> Dict[str, int]:
        """Every object under ``prefix`` (recursively): key -> size."""
        self.fs.invalidate_cache()
        base = self._path(prefix).rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for p, info in found.items():
            p = p.lstrip("/") if not self.root.startswith("/") else p
            rel = p[len(self.root.lstrip("/") if not self.root.startswith("/") else self.root):].lstrip("/")
            if info.get("type", "file") == "file":
                out[rel] = int(info.get("size") or 0)
        return out

    def delete(self, keys: List[str]) -> None:
        for k in keys:
            try:
                self.fs.rm_file(self._path(k))
            except FileNotFoundError:
                pass

    def begin_upload(self, key: str, size: int) -> Upload:
        raise NotImplementedError

    def join_upload(self, key: str, token: str) -> Upload:
        """The upload another process began (its :attr:`Upload.token`), to send
        parts of it; only where ``shared_uploads``."""
        raise NotImplementedError(f"{self.url}: uploads cannot be shared between processes here")

    def abort_stale_uploads(self, prefix: str = "") -> int:
        """Remove uploads left unfinished under ``prefix`` (a killed process's);
        return how many. Only safe while no other process uploads there."""
        return 0


# ---------------------------------------------------------------- S3 (s3fs)

class _S3Upload(Upload):
    def __init__(self, store: "S3Store", key: str, upload_id: Optional[str] = None):
        self.s, self.key = store, key
        self.bucket, self.obj = store._bucket_key(key)
        if upload_id is None:
            upload_id = store.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.obj)["UploadId"]
        self.upload_id = self.token = upload_id

    def expected_etag(self, parts):
        """S3's ETag of a multipart object: the MD5 of its parts' binary MD5s
        (their ETags), a dash, the number of parts. None if a part's ETag is
        not an MD5 (SSE-KMS, some S3-compatible stores)."""
        digests = []
        for _, e in sorted(parts):
            e = str(e).strip('"')
            if len(e) != 32:
                return None
            try:
                digests.append(bytes.fromhex(e))
            except ValueError:
                return None
        return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"

    def put_part(self, number, offset, data):
        r = self.s.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.obj, PartNumber=number,
                              UploadId=self.upload_id, Body=data)
        return r["ETag"]

    def complete(self, parts):
        self.s.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.obj, UploadId=self.upload_id,
                          MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in sorted(parts)]})

    def abort(self):
        self.s.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.obj, UploadId=self.upload_id)


class S3Store(Store):
    """S3 and S3-compatible stores through s3fs's client (aiobotocore)."""

    min_part = S3_MIN_PART
    shared_uploads = True

    def __init__(self, url: str, opts: Dict[str, Any]):
        import s3fs
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("retries", {"total_max_attempts": 1})  # fastckpt's policy retries (see the module's doc)
        opts["config_kwargs"] = cfg
        opts.setdefault("skip_instance_cache", True)
        fs = s3fs.S3FileSystem(**opts)
        fs.retries = 1
        path = url.split("://", 1)[1].strip("/")
        super().__init__(url, fs, path)
        self.bucket = path.split("/", 1)[0]
        self.prefix = path.split("/", 1)[1] if "/" in path else ""
        if not self.bucket:
            raise ValueError(f"{url!r} names no bucket (s3://bucket/prefix)")

    def _bucket_key(self, key: str) -> Tuple[str, str]:
        obj = f"{self.prefix}/{key}" if self.prefix else key
        return self.bucket, obj.strip("/")

    def validate(self, opts):
        def check():
            try:
                self.fs.call_s3("head_bucket", Bucket=self.bucket)
            except FileNotFoundError as e:
                raise FileNotFoundError(errno.ENOENT, f"bucket {self.bucket!r} does not exist ({e})", self.url) \
                    from e
            except PermissionError as e:
                raise PermissionError(errno.EACCES, f"access to bucket {self.bucket!r} refused: wrong credentials "
                                      f"or no permission ({e})", self.url) from e
        try:
            retry(check, f"cannot use {self.url}", self.url, opts)
        except OSError as e:
            cause = e.__cause__
            if isinstance(cause, (FileNotFoundError, PermissionError)):
                raise cause from None
            raise

    def size(self, key):
        return self.head(key)[0]

    def head(self, key):
        b, k = self._bucket_key(key)
        r = self.fs.call_s3("head_object", Bucket=b, Key=k)
        return int(r["ContentLength"]), (str(r["ETag"]).strip('"') if r.get("ETag") else None)

    def get_range(self, key, start, end):
        return self.fs.cat_file(self._path(key), start=start, end=end)

    def put(self, key, data):
        b, k = self._bucket_key(key)
        self.fs.call_s3("put_object", Bucket=b, Key=k, Body=data)

    def list(self, prefix=""):
        b, k = self._bucket_key(prefix)
        pfx = (k + "/") if k else ""
        out, token = {}, None
        strip = len(self.prefix) + 1 if self.prefix else 0
        while True:
            kw = {"Bucket": b, "Prefix": pfx}
            if token:
                kw["ContinuationToken"] = token
            r = self.fs.call_s3("list_objects_v2", **kw)
            for o in r.get("Contents", []):
                out[o["Key"][strip:]] = int(o["Size"])
            token = r.get("NextContinuationToken")
            if not r.get("IsTruncated") or not token:
                return out

    def delete(self, keys):
        for i in range(0, len(keys), 1000):
            objs = [{"Key": self._bucket_key(k)[1]} for k in keys[i:i + 1000]]
            self.fs.call_s3("delete_objects", Bucket=self.bucket, Delete={"Objects": objs, "Quiet": True})

    def begin_upload(self, key, size):
        return _S3Upload(self, key)

    def join_upload(self, key, token):
        return _S3Upload(self, key, token)

    def abort_stale_uploads(self, prefix=""):
        b, k = self._bucket_key(prefix)
        r = self.fs.call_s3("list_multipart_uploads", Bucket=b, Prefix=(k + "/") if k else "")
        n = 0
        for u in r.get("Uploads", []):
            self.fs.call_s3("abort_multipart_upload", Bucket=b, Key=u["Key"], UploadId=u["UploadId"])
            n += 1
        return n


# ---------------------------------------------------------------- file:// (the engine's commit)

class _LocalUpload(Upload):
    def __init__(self, path: str, size: int):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.w = _engine.region_file(path, create=True, size=size)
        import threading
        self._lock = threading.Lock()

    def put_part(self, number, offset, data):
        with self._lock:
            self.w.write_at(data, offset)
        return number

    def complete(self, parts):
        self.w.commit()  # fdatasync, rename over the key, fsync the directory

    def abort(self):
        self.w.abort()


class LocalStore(Store):
    """``file:///dir``: a local or shared (NFS, Lustre) filesystem; uploads
    are committed by the engine (temporary name, fdatasync, rename, directory fsync)."""

    def __init__(self, url: str, opts: Dict[str, Any]):
        import fsspec
        path = url.split("://", 1)[1]
        if not path.startswith("/"):
            raise ValueError(f"{url!r}: a file:// URL needs an absolute path (file:///dir)")
        super().__init__(url, fsspec.filesystem("file", **opts), os.path.normpath(path))

    def validate(self, opts):
        d = self.root
        probe = d
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            raise NotADirectoryError(errno.ENOTDIR, f"cannot use {self.url}: {probe!r} is not a directory", self.url)
        if not os.access(probe, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"cannot use {self.url}: no permission to write in {probe!r}",
                                  self.url)

    def size(self, key):
        return os.stat(self._path(key)).st_size

    def get_range(self, key, start, end):
        with open(self._path(key), "rb") as f:
            return os.pread(f.fileno(), end - start, start)

    def put(self, key, data):
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file(path, data)

    def list(self, prefix=""):
        base = self._path(prefix)
        out = {}
        for d, _, files in os.walk(base):
            for f in files:
                if is_temp(f):
                    continue  # an upload in progress or left by a killed process
                p = os.path.join(d, f)
                try:
                    out[os.path.relpath(p, self.root)] = os.stat(p).st_size
                except FileNotFoundError:
                    pass
        return out

    def delete(self, keys):
        dirs = set()
        for k in keys:
            p = self._path(k)
            try:
                os.unlink(p)
                dirs.add(os.path.dirname(p))
            except FileNotFoundError:
                pass
        for d in sorted(dirs, key=len, reverse=True):  # empty step directories go too
            while d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                fsync_dir(os.path.dirname(d))
                d = os.path.dirname(d)
        for d in dirs:
            if os.path.isdir(d):
                fsync_dir(d)

    def begin_upload(self, key, size):
        return _LocalUpload(self._path(key), size)

    def abort_stale_uploads(self, prefix=""):
        n = 0
        for d, _, files in os.walk(self._path(prefix)):
            if any(is_temp(f) for f in files):
                n += len(remove_leftovers_in(d))
        return n


# ---------------------------------------------------------------- any other fsspec filesystem

class _StreamUpload(Upload):
    parallel = False  # one stream, parts in order

    def __init__(self, store: "FsspecStore", key: str):
        self.f = store.fs.open(store._path(key), "wb")

    def put_part(self, number, offset, data):
        self.f.write(data)
        return number

    def complete(self, parts):
        self.f.close()

    def abort(self):
        discard = getattr(self.f, "discard", None)
        if discard is not None:
            discard()


class FsspecStore(Store):
    """Another fsspec filesystem (gcsfs, ...): uploads are one stream, which
    such object stores make visible only when it is closed."""

    def __init__(self, url: str, opts: Dict[str, Any], fs_cls):
        opts.setdefault("skip_instance_cache", True)
        fs = fs_cls(**opts)
        super().__init__(url, fs, fs._strip_protocol(url))

    def validate(self, opts):
        def check():
            self.fs.invalidate_cache()
            if getattr(self.fs, "root_marker", "") == "":  # an object store: bucket/prefix; the bucket must exist
                bucket = self.root.split("/", 1)[0]
                if not self.fs.exists(bucket):
                    raise FileNotFoundError(errno.ENOENT, f"bucket {bucket!r} does not exist", self.url)
                return
            probe = self.root  # a filesystem: the nearest existing ancestor is a directory
            while probe not in ("", "/") and not self.fs.exists(probe):
                probe = probe.rsplit("/", 1)[0]
            if probe not in ("", "/") and not self.fs.isdir(probe):
                raise NotADirectoryError(errno.ENOTDIR, f"{probe!r} is not a directory", self.url)
        try:
            retry(check, f"cannot use {self.url}", self.url, opts)
        except OSError as e:
            if isinstance(e.__cause__, (FileNotFoundError, NotADirectoryError, PermissionError)):
                raise e.__cause__ from None
            raise

    def begin_upload(self, key, size):
        return _StreamUpload(self, key)
