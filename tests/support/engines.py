"""The engine under test: its configuration, whether io_uring works here, and the page cache."""
import contextlib
import ctypes
import mmap
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


@contextlib.contextmanager
def held_in_page_cache(path):
    """Keeps every page of `path` in the page cache while the block runs: the file is mapped
    (MAP_POPULATE, which reads in what is not cached yet) and locked (mlock). Unmapped page-cache
    pages can be evicted at any moment, also in the middle of a read that a test expects to find
    them cached: by the kernel's reclaim, by another test's drop_caches, or by the host's own
    proactive reclaim (this VM runs a DAMON `pageout` scheme on unmapped file pages). Mapped and
    locked pages are taken by none of them. Raises OSError where the file cannot be locked
    (RLIMIT_MEMLOCK without CAP_IPC_LOCK): the caller skips with the reason."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.mlock.argtypes = libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    if size == 0:
        yield
        return
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | MAP_POPULATE, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            e = ctypes.get_errno()
            raise OSError(e, f"mmap: {os.strerror(e)}", os.fspath(path))
    finally:
        os.close(fd)
    try:
        if libc.mlock(addr, size) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mlock: {os.strerror(e)}", os.fspath(path))
        yield
    finally:
        libc.munmap(addr, size)  # unlocks too


MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


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
