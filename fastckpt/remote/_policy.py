"""The one retry policy and bandwidth cap of every remote request.

A request that fails with a transient error (HTTP 5xx, SlowDown, a timeout, a
reset or refused connection) is tried again after an exponential backoff with
jitter, up to ``attempts`` tries; then, or at once for any other error, an
``OSError`` is raised whose message names what was being done (the URL, the
local file) and the last cause, and whose errno is the cause's (EIO when it
has none). The clients' own retry loops are turned off by the store
(:mod:`fastckpt.remote.store`) so that this is the only one and the time a
failing transfer takes is bounded: about ``attempts`` x (the client's
timeout + backoff).
"""

import dataclasses
import errno
import logging
import random
import socket
import threading
import time
from typing import Callable, Optional, TypeVar

from .. import knobs

__all__ = ["TransferOptions", "transient", "retry", "Throttle"]

log = logging.getLogger("fastckpt.remote")
T = TypeVar("T")

S3_MIN_PART = 5 << 20  # S3: every part but the last is at least 5 MiB


@dataclasses.dataclass
class TransferOptions:
    """How a remote transfer runs; ``None`` fields take the knobs' values
    (:mod:`fastckpt.knobs`: ``remote_part_size``, ``remote_parallelism``,
    ``remote_attempts``, ``remote_bandwidth``).

    Attributes:
        part_size: bytes per uploaded part or ranged read.
        parallelism: parts in flight at once; a transfer holds at most
            ``parallelism * part_size`` bytes of memory.
        attempts: tries of one request before its error is raised.
        bandwidth: bytes per second of one transfer (0: no cap).
        backoff_s: first backoff; doubled after each failed try, capped at
            ``max_backoff_s``, with up to 50% random jitter.
        peer_timeout: seconds without a sign of life from a rank taking part
            in a step's upload (:mod:`fastckpt.remote.team`) before it is
            taken for dead and the step fails.
    """
    part_size: Optional[int] = None
    parallelism: Optional[int] = None
    attempts: Optional[int] = None
    bandwidth: Optional[int] = None
    peer_timeout: Optional[int] = None
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0

    def resolved(self) -> "TransferOptions":
        r = dataclasses.replace(self)
        for f in ("part_size", "parallelism", "attempts", "bandwidth", "peer_timeout"):
            if getattr(r, f) is None:
                setattr(r, f, knobs.get("remote_" + f))
        if r.part_size < 1 or r.parallelism < 1 or r.attempts < 1 or r.bandwidth < 0 or r.peer_timeout <= 0:
            raise ValueError(f"fastckpt.remote: invalid transfer options {r}")
        return r


_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                     getattr(errno, "EREMOTEIO", errno.EIO), errno.EAGAIN, errno.ENETUNREACH, errno.EHOSTUNREACH}
_TRANSIENT_NAMES = {"FSTimeoutError", "ReadTimeoutError", "ConnectTimeoutError", "EndpointConnectionError",
                    "ConnectionClosedError", "ServerDisconnectedError", "ClientPayloadError", "ClientOSError",
                    "ClientConnectionError", "ClientConnectorError", "ServerTimeoutError", "IncompleteRead",
                    "ResponseParserError", "HTTPClientError", "ProxyConnectionError", "ConnectionResetError"}
_TRANSIENT_CODES = {"InternalError", "SlowDown", "ServiceUnavailable", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestLimitExceeded", "503", "500", "502", "504"}


_ERRNO_OF = {FileNotFoundError: errno.ENOENT, PermissionError: errno.EACCES, FileExistsError: errno.EEXIST,
             IsADirectoryError: errno.EISDIR, NotADirectoryError: errno.ENOTDIR, TimeoutError: errno.ETIMEDOUT,
             ConnectionResetError: errno.ECONNRESET, ConnectionRefusedError: errno.ECONNREFUSED}


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def transient(e: BaseException) -> bool:
    """Whether trying again may succeed: a 5xx answer, throttling, a timeout,
    a connection reset or refused (anywhere in the exception's chain).
    Missing objects, refused credentials and other 4xx answers are not."""
    for x in _chain(e):
        if isinstance(x, (FileNotFoundError, PermissionError, FileExistsError)):
            return False
        if isinstance(x, (TimeoutError, ConnectionError, socket.timeout)):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(x).__mro__):
            return True
        resp = getattr(x, "response", None)
        if isinstance(resp, dict):
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
            code = str((resp.get("Error") or {}).get("Code", ""))
            if status >= 500 or code in _TRANSIENT_CODES:
                return True
        status = getattr(x, "status", None)  # aiohttp / gcsfs HttpError
        if isinstance(status, int) and status >= 500:
            return True
        if isinstance(x, OSError) and x.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def _cause(e: BaseException) -> str:
    msg = str(e) or type(e).__name__
    return f"{type(e).__name__}: {msg}"


def error_for(e: BaseException, what: str, url: str, tries: int = 1) -> OSError:
    """An OSError (the subclass for the cause's errno) naming `what` was being
    done, the URL and the cause; raise it ``from e``."""
    code = next((x.errno or _ERRNO_OF.get(type(x)) for x in _chain(e)
                 if isinstance(x, OSError) and (x.errno or type(x) in _ERRNO_OF)), None)
    if code is None:
        code = errno.ETIMEDOUT if any(isinstance(x, (TimeoutError, socket.timeout)) or "Timeout" in type(x).__name__
                                      for x in _chain(e)) else errno.EIO
    after = f" after {tries} attempts" if tries > 1 else ""
    return OSError(code, f"{what} failed{after}: {_cause(e)}", url)


def retry(fn: Callable[[], T], what: str, url: str, opts: TransferOptions,
          is_transient: Callable[[BaseException], bool] = transient) -> T:
    """``fn()`` under the retry policy; the final error is :func:`error_for`'s."""
    for i in range(opts.attempts):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e) or i + 1 == opts.attempts:
                raise error_for(e, what, url, i + 1) from e
            delay = min(opts.max_backoff_s, opts.backoff_s * (2 ** i)) * (1 + 0.5 * random.random())
            log.warning("fastckpt.remote: %s: %s; trying again in %.1f s (attempt %d of %d)", what, _cause(e),
                        delay, i + 2, opts.attempts)
            time.sleep(delay)
    raise AssertionError("not reached")


class Throttle:
    """A bandwidth cap shared by the workers of a transfer: ``take(n)`` sleeps
    until sending n more bytes keeps the average at most ``rate`` bytes/s."""

    def __init__(self, rate: int):
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        if start > now:
            time.sleep(start - now)
