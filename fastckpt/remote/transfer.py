"""Moving one file's bytes between a local file and a store.

:func:`upload` sends a local file (read with ``os.pread``, so the caller may
keep only an open descriptor: a file deleted by local retention meanwhile is
still uploaded whole) as parts of ``part_size`` bytes, ``parallelism`` at a
time: the bytes held in memory never exceed ``parallelism * part_size``. It
computes the file's zip CRC-32 (the engine's ``_engine.crc32``) while reading, caps
the bandwidth if asked, retries each request under the one policy
(:mod:`fastckpt.remote._policy`), and makes the object visible only when it
is complete (:meth:`Store.begin_upload`); on failure the upload is aborted
and an ``OSError`` names the URL, the file and the last cause. A complete
whose answer was lost is checked against the object (:func:`complete_upload`).
Its pieces (:func:`plan_parts`, :func:`split_parts`, :func:`send_parts`,
:func:`complete_upload`) also serve an upload shared by the ranks of a job,
each sending its share of the parts (:mod:`fastckpt.remote.team`).

:func:`download` reads an object with parallel ranged reads into a local
file committed by the engine (temporary name, fdatasync, rename, directory
fsync) only if its size and CRC-32 are the expected ones; else a
:class:`fastckpt.FormatError` names the URL and nothing is left locally.
:func:`download_to_fd` reads an object into a descriptor (an in-memory file
for :func:`fastckpt.load`).
"""

import logging
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._core import engine as _engine
from ..errors import FormatError
from ._policy import Throttle, TransferOptions, retry
from .store import Store, Upload

__all__ = ["upload", "download", "download_to_fd", "TransferStats", "plan_parts", "split_parts", "send_parts",
           "complete_upload", "abort_upload", "remote_crc"]

log = logging.getLogger("fastckpt.remote")

_MAX_PARTS = 10_000  # S3's limit on the parts of one upload


class TransferStats:
    """What a transfer did: bytes moved, parts, the most bytes it held in
    memory at once (``peak_buffered`` <= parallelism * part_size) and retries."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = 0
        self.parts = 0
        self.buffered = 0
        self.peak_buffered = 0

    def hold(self, n: int) -> None:
        with self._lock:
            self.buffered += n
            self.peak_buffered = max(self.peak_buffered, self.buffered)

    def release(self, n: int) -> None:
        with self._lock:
            self.buffered -= n
            self.bytes += n
            self.parts += 1

    def __repr__(self):
        return f"TransferStats(bytes={self.bytes}, parts={self.parts}, peak_buffered={self.peak_buffered})"


def _pread_exact(fd: int, n: int, off: int, name: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], off + got)
        if k == 0:
            raise OSError(5, f"{name} is shorter than expected ({off + got} of {off + n} bytes): it changed during "
                             "the upload", name)
        got += k
    return bytes(buf) if n < 1 << 16 else buf


def _plan(size: int, part: int, min_part: int) -> List[Tuple[int, int, int]]:
    part = max(part, min_part)
    if size > part * _MAX_PARTS:
        part = -(-size // _MAX_PARTS)
    return [(i + 1, off, min(part, size - off)) for i, off in enumerate(range(0, size, part))] or [(1, 0, 0)]


Part = Tuple[int, int, int]          # (part number, offset, length)
Sent = Dict[int, Tuple[Any, int, int]]  # part number -> (what the store returned for it, CRC-32, length)


def plan_parts(store: Store, size: int, opts: TransferOptions) -> List[Part]:
    """The parts of an upload of ``size`` bytes to ``store``: (number, offset,
    length), numbered from 1; one part means one request (no multipart upload)."""
    return _plan(size, opts.resolved().part_size, store.min_part)


def split_parts(parts: List[Part], world: int) -> List[List[Part]]:
    """``parts`` cut into ``world`` contiguous shares, as even as whole parts
    allow (share r: parts[r*n//world : (r+1)*n//world]; some are empty when
    there are fewer parts than ranks)."""
    n = len(parts)
    return [parts[r * n // world:(r + 1) * n // world] for r in range(world)]


def send_parts(up: Upload, fd: int, parts: List[Part], opts: TransferOptions, name: str, url: str,
               stats: Optional[TransferStats] = None, total: Optional[int] = None) -> Sent:
    """Send ``parts`` of the open file ``fd`` as parts of ``up``,
    ``opts.parallelism`` at a time (at most parallelism x part size bytes held),
    under the retry policy and the bandwidth cap; return what each part
    returned with its CRC-32. The first failure is raised (OSError naming the
    URL, the file and the part) once the parts in flight end; nothing is aborted here."""
    opts = opts.resolved()
    stats = stats or TransferStats()
    throttle = Throttle(opts.bandwidth)
    what = f"upload of {name or 'fd %d' % fd} to {url}"
    total = total or (parts[-1][0] if parts else 0)
    sent: Sent = {}
    lock = threading.Lock()

    def send(p):
        number, off, n = p
        stats.hold(n)
        try:
            data = _pread_exact(fd, n, off, name)
            c = _engine.crc32(data) if n else 0
            throttle.take(n)
            etag = retry(lambda: up.put_part(number, off, data), f"{what} (part {number} of {total})", url, opts)
        finally:
            stats.release(n)
        with lock:
            sent[number] = (etag, c, n)

    _parallel(parts, send, opts.parallelism if up.parallel else 1)
    return sent


def complete_upload(store: Store, up: Upload, key: str, sent: Sent, size: int, opts: TransferOptions,
                    what: str) -> int:
    """Complete ``up`` from every part's ``sent`` entry (all of the object's
    parts, whichever process sent them); return the object's CRC-32.

    A complete whose answer is lost (a reset or timed-out connection after the
    store did it; its retry then finds no such upload) is not a failure if the
    object is there as uploaded: its size, and its ETag (S3's multipart form,
    computed from the parts' ETags) or, where that cannot tell, the CRC-32 of
    a ranged read of it. Otherwise the complete's error is raised, an OSError
    naming the URL, its cause and what the check found."""
    opts = opts.resolved()
    url = store.key_url(key)
    etags = sorted((number, e) for number, (e, _, _) in sent.items())
    crc = _combine({number: (c, n) for number, (_, c, n) in sent.items()})
    try:
        retry(lambda: up.complete(etags), what, url, opts)
    except OSError as e:
        ok, found = _check_object(store, key, size, up.expected_etag(etags), crc, opts)
        if not ok:
            raise OSError(e.errno, f"{e.strerror} (and {found})", url) from e
        log.warning("fastckpt.remote: %s: the answer to completing it was lost (%s), but the object is complete "
                    "(%s)", url, e, found)
    return crc


def _check_object(store: Store, key: str, size: int, etag: Optional[str], crc: int,
                  opts: TransferOptions) -> Tuple[bool, str]:
    """Whether the object at ``key`` is the one uploaded (its size, then its
    ETag if the store's tells, else the CRC-32 of its bytes), and what was found."""
    url = store.key_url(key)
    try:
        got_size, got_etag = retry(lambda: store.head(key), f"checking {url}", url, opts)
    except OSError as e:
        if isinstance(e, FileNotFoundError) or isinstance(e.__cause__, FileNotFoundError):
            return False, f"{url} does not exist"
        return False, f"{url} could not be checked: {e}"
    if got_size != size:
        return False, f"{url} has {got_size} bytes, not the {size} uploaded"
    if etag is not None and got_etag == etag:
        return True, f"its size and ETag {etag} are the upload's"
    try:  # no ETag to tell by, or another one (an older object of that size?): the bytes decide
        got = remote_crc(store, key, size, opts)
    except (OSError, FormatError) as e:
        return False, f"{url} could not be read back: {e}"
    if got != crc:
        return False, f"{url} holds other bytes (CRC-32 {got:08x}, not {crc:08x})"
    return True, f"its size and the CRC-32 {crc:08x} of its bytes, read back, are the upload's"


def remote_crc(store: Store, key: str, size: int, opts: Optional[TransferOptions] = None) -> int:
    """The CRC-32 of the object's ``size`` bytes, read with parallel ranged reads (nothing kept)."""
    opts = (opts or TransferOptions()).resolved()
    url = store.key_url(key)
    crcs: Dict[int, Tuple[int, int]] = {}
    lock = threading.Lock()

    def fetch(p):
        number, off, n = p
        data = retry(lambda: store.get_range(key, off, off + n), f"reading {url} (bytes {off}-{off + n})", url, opts)
        if len(data) != n:
            raise FormatError(f"{url}: a ranged read of bytes {off}-{off + n} returned {len(data)} bytes")
        with lock:
            crcs[number] = (_engine.crc32(data) if n else 0, n)

    _parallel(_plan(size, opts.part_size, 1), fetch, opts.parallelism)
    return _combine(crcs)


def upload(store: Store, key: str, fd: int, size: int, opts: Optional[TransferOptions] = None,
           name: str = "", stats: Optional[TransferStats] = None) -> int:
    """Upload ``size`` bytes of the open file ``fd`` (``name`` for messages)
    to ``key``; return their zip CRC-32. Raises OSError naming the URL, the
    file and the last cause (the upload aborted, nothing visible)."""
    opts = (opts or TransferOptions()).resolved()
    url = store.key_url(key)
    stats = stats or TransferStats()
    what = f"upload of {name or 'fd %d' % fd} to {url}"
    parts = plan_parts(store, size, opts)
    if len(parts) == 1:  # one request (S3 put_object, a local commit): atomic
        data = _pread_exact(fd, size, 0, name)
        stats.hold(size)
        crc = _engine.crc32(data) if size else 0
        Throttle(opts.bandwidth).take(size)
        retry(lambda: store.put(key, data), what, url, opts)
        stats.release(size)
        return crc
    up = retry(lambda: store.begin_upload(key, size), what, url, opts)
    try:
        sent = send_parts(up, fd, parts, opts, name, url, stats)
        return complete_upload(store, up, key, sent, size, opts, what)
    except BaseException:
        abort_upload(up)
        raise


def abort_upload(up: Upload) -> None:
    """Abort ``up``, quietly: the store's own expiry (or the next Replicator's cleanup) removes what is left."""
    try:
        up.abort()
    except Exception:  # noqa: BLE001
        pass


def _combine(crcs: Dict[int, Tuple[int, int]]) -> int:
    crc = None
    for number in sorted(crcs):
        c, n = crcs[number]
        crc = c if crc is None else _engine.crc32_combine(crc, c, n)
    return crc or 0


def _parallel(parts, work: Callable, n: int) -> None:
    """work(part) for every part, at most n at once; the first error stops
    the parts not yet started and is raised once the running ones end."""
    if n <= 1:
        for p in parts:
            work(p)
        return
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="fastckpt-remote") as pool:
        pending: set = set()
        err = None
        for p in parts:
            if len(pending) >= n:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                err = next((f.exception() for f in done if f.exception() is not None), None)
                if err is not None:
                    break
            pending.add(pool.submit(work, p))
        done, _ = wait(pending)
        err = err or next((f.exception() for f in done if f.exception() is not None), None)
        if err is not None:
            raise err


def download(store: Store, key: str, path: str, size: Optional[int] = None, crc32: Optional[int] = None,
             opts: Optional[TransferOptions] = None, stats: Optional[TransferStats] = None) -> int:
    """Download ``key`` to the local ``path`` (committed by the engine) and
    return its CRC-32. With ``size``/``crc32`` (a manifest's), an object of
    another size or CRC raises FormatError naming the URL and leaves no file.
    Network errors raise OSError naming the URL (after the retries)."""
    opts = (opts or TransferOptions()).resolved()
    url = store.key_url(key)
    what = f"download of {url} to {path}"
    actual = retry(lambda: store.size(key), what, url, opts)
    if size is not None and actual != size:
        raise FormatError(f"{url}: the object has {actual} bytes, the manifest says {size} (incomplete or "
                          "replaced)")
    size = actual
    stats = stats or TransferStats()
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    w = _engine.region_file(path, create=True, size=size)
    lock = threading.Lock()
    crcs: Dict[int, Tuple[int, int]] = {}
    parts = _plan(size, opts.part_size, 1)
    throttle = Throttle(opts.bandwidth)

    def fetch(p):
        number, off, n = p
        stats.hold(n)
        try:
            throttle.take(n)
            data = retry(lambda: store.get_range(key, off, off + n), f"{what} (bytes {off}-{off + n})", url, opts)
            if len(data) != n:
                raise FormatError(f"{url}: a ranged read of bytes {off}-{off + n} returned {len(data)} bytes "
                                  "(the object changed or is truncated)")
            with lock:
                c = w.write_at(data, off, True) if n else 0
                crcs[number] = (c, n)
        finally:
            stats.release(n)

    try:
        _parallel(parts, fetch, opts.parallelism)
        crc = _combine(crcs)
        if crc32 is not None and crc != crc32:
            raise FormatError(f"{url}: CRC-32 {crc:08x} of the downloaded bytes differs from the manifest's "
                              f"{crc32:08x} (damaged remote object)")
        w.commit()
    except BaseException:
        w.abort()
        raise
    return crc


def download_to_fd(store: Store, key: str, fd: int, opts: Optional[TransferOptions] = None) -> int:
    """Read all of ``key`` into the open file ``fd`` (from offset 0) with
    parallel ranged reads; return its size."""
    opts = (opts or TransferOptions()).resolved()
    url = store.key_url(key)
    what = f"download of {url}"
    size = retry(lambda: store.size(key), what, url, opts)
    os.ftruncate(fd, size)

    def fetch(p):
        _, off, n = p
        data = retry(lambda: store.get_range(key, off, off + n), f"{what} (bytes {off}-{off + n})", url, opts)
        if len(data) != n:
            raise FormatError(f"{url}: a ranged read of bytes {off}-{off + n} returned {len(data)} bytes")
        view = memoryview(data)
        while view:
            k = os.pwrite(fd, view, off)
            view, off = view[k:], off + k

    _parallel([p for p in _plan(size, opts.part_size, 1) if p[2]], fetch, opts.parallelism)
    return size
