"""The engine under test: its configuration, whether io_uring works here, and the page cache."""
import os

from fastckpt import _C


def drop_page_cache(path, offset=0, length=0):
    """Evicts `path`'s pages (a range of them with offset/length) from the page
    cache, so that the engine's next read of them goes to the disk (read_ranges
    serves cached bytes first). Written pages are made clean first."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def make_config(**kw):
    cfg = _C.EngineConfig()
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


_uring_probe = {}


def uring_refusal():
    """None when io_uring works here, else the reason it does not."""
    if "r" not in _uring_probe:
        if not _C.uring_compiled():
            _uring_probe["r"] = "fastckpt was built without liburing"
        else:
            try:
                _C.Engine(make_config(backend="uring", buffer_size=4096, buffer_count=1)).backend
                _uring_probe["r"] = None
            except OSError as e:
                _uring_probe["r"] = f"io_uring refused by the kernel: {e}"
    return _uring_probe["r"]


def record_reads(monkeypatch):
    """The statistics of every `_C.read_ranges` call from now on (a list of dicts: requests,
    direct_requests, bytes_read, ...), recorded by wrapping the binding for the test."""
    calls = []
    real = _C.read_ranges

    def wrapper(*args, **kwargs):
        st = real(*args, **kwargs)
        calls.append(st)
        return st

    monkeypatch.setattr(_C, "read_ranges", wrapper)
    return calls


def record_commits(monkeypatch):
    """The statistics of every AtomicFile commit from now on (a list of the engine's dicts: bytes,
    requests, borrowed_bytes, ...), recorded by wrapping the method for the test."""
    from fastckpt._core.atomic import AtomicFile
    calls = []
    real = AtomicFile.commit

    def wrapper(self):
        st = real(self)
        calls.append(st)
        return st

    monkeypatch.setattr(AtomicFile, "commit", wrapper)
    return calls
