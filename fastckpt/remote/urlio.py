"""``fastckpt.save(obj, URL)`` and ``fastckpt.load(URL)``.

save: the object is serialized by the local save into a temporary directory
(``TMPDIR``: the same bytes as a local save), then uploaded to the URL
(:func:`fastckpt.remote.transfer.upload`: parallel multipart, visible only
when complete, so a reader sees the previous object or the new one, never a
part), and the temporary file is removed. The store is checked (bucket,
credentials) before anything is pickled.

load: the object is read with parallel ranged reads into an in-memory file
(``memfd_create``; a temporary file where there is none), then loaded by the
local load with all its checks (CRC-32 of every storage, the weights-only
rules); errors name the URL, not the in-memory file.
"""

import errno
import os
import posixpath
import tempfile
from typing import Any, Callable, Dict, Optional, Tuple

from ..errors import FormatError, MissingDependencyError
from ._policy import TransferOptions
from .store import Store, open_store
from .transfer import download_to_fd, upload

__all__ = ["save", "load", "split_object_url", "fetch", "put", "exists"]


def split_object_url(url: str) -> Tuple[str, str]:
    """``s3://bucket/dir/x.pt`` -> (``s3://bucket/dir``, ``x.pt``); a URL
    naming no object (ending with '/', or a bare bucket) is IsADirectoryError."""
    scheme, rest = url.split("://", 1)
    parent, name = posixpath.split(rest)
    if not name or not parent.strip("/"):
        raise IsADirectoryError(errno.EISDIR, f"{url!r} names no object (give .../name.pt)", url)
    return f"{scheme}://{parent}", name


def _open(url: str, storage_options: Optional[Dict[str, Any]], transfer: Optional[TransferOptions]
          ) -> Tuple[Store, str]:
    parent, name = split_object_url(url)
    try:
        return open_store(parent, storage_options, transfer), name
    except OSError as e:  # named after the object the user gave
        raise OSError(e.errno, f"cannot use {url}: {e.strerror or e}", url) from e
    except MissingDependencyError as e:
        raise MissingDependencyError(str(e).replace(repr(parent), repr(url)), name=e.name) from e.__cause__


def save(url: str, storage_options: Optional[Dict[str, Any]], save_local: Callable[[str], None],
         transfer: Optional[TransferOptions] = None) -> None:
    """``save_local(path)`` writes the checkpoint; it is uploaded to ``url``."""
    store, name = _open(url, storage_options, transfer)
    with tempfile.TemporaryDirectory(prefix="fastckpt-upload-") as d:
        local = os.path.join(d, name)
        save_local(local)
        _upload(store, name, local, url, transfer)


def _scratch() -> int:
    if hasattr(os, "memfd_create"):
        try:
            return os.memfd_create("fastckpt-load", os.MFD_CLOEXEC)
        except OSError:
            pass
    fd, p = tempfile.mkstemp(prefix="fastckpt-load-")
    os.unlink(p)
    return fd


def load(url: str, storage_options: Optional[Dict[str, Any]], load_local: Callable[[str], Any],
         transfer: Optional[TransferOptions] = None) -> Any:
    """Read ``url`` into memory and return ``load_local(path of that memory)``."""
    store, name = _open(url, storage_options, transfer)
    fd = _scratch()
    try:
        download_to_fd(store, name, fd, transfer)
        path = f"/proc/self/fd/{fd}"
        try:
            return load_local(path)
        except FormatError as e:
            raise type(e)(str(e).replace(path, url)) from None
        except OSError as e:
            if e.filename == path:
                raise OSError(e.errno, (e.strerror or str(e)).replace(path, url), url) from e
            raise
    finally:
        os.close(fd)


def fetch(url: str, storage_options: Optional[Dict[str, Any]], local_dir: str,
          transfer: Optional[TransferOptions] = None) -> str:
    """Download the object ``url`` (a checkpoint file), or every object under
    the prefix ``url`` (a DCP directory), into ``local_dir``; return the local
    path (the URL's last name under ``local_dir``). FileNotFoundError naming
    the URL when there is neither."""
    from .transfer import download
    name = url.rstrip("/").rsplit("/", 1)[-1] or "checkpoint"
    local = os.path.join(local_dir, name)
    try:
        store, key = _open(url.rstrip("/"), storage_options, transfer)
    except IsADirectoryError:
        store, key = open_store(url, storage_options, transfer), ""
    if key:
        try:
            download(store, key, local, opts=transfer)
            return local
        except FileNotFoundError:
            pass  # a prefix, then
    prefix = store.list(key)
    if not prefix:
        raise FileNotFoundError(errno.ENOENT, f"{url}: no such object or prefix", url)
    for k in sorted(prefix):
        download(store, k, os.path.join(local, *k[len(key):].strip("/").split("/")), prefix[k], opts=transfer)
    return local


def exists(url: str, storage_options: Optional[Dict[str, Any]]) -> bool:
    """Whether the object ``url`` exists."""
    store, key = _open(url, storage_options, None)
    try:
        store.size(key)
        return True
    except FileNotFoundError:
        return False


def put(local: str, url: str, storage_options: Optional[Dict[str, Any]],
        transfer: Optional[TransferOptions] = None) -> None:
    """Upload the local file ``local`` to the object ``url`` (visible only complete)."""
    store, key = _open(url, storage_options, transfer)
    _upload(store, key, local, local, transfer)


def _upload(store: Store, key: str, local: str, name: str, transfer: Optional[TransferOptions]) -> None:
    fd = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
    try:
        upload(store, key, fd, os.fstat(fd).st_size, transfer, name=name)
    finally:
        os.close(fd)
