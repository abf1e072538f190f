import gc
import os

import torch

import pytest

import fastckpt
from fastckpt import _C

from dist_launch import kill_all


def fd_table():
    """This process's open descriptors -> what they point at, sockets left out:
    the leak checks compare descriptors before and after an operation on files,
    which opens no socket, while sockets of earlier tests' network clients and
    their threads come and go on their own (under xdist such changes made three
    fault tests see the count drop by 1-2 during the test)."""
    gc.collect()  # engines of earlier tests close their io_uring descriptors
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, or one closed meanwhile
            continue
        if not target.startswith("socket:"):
            out[fd] = target
    return out


def fd_count():
    """How many descriptors :func:`fd_table` lists."""
    return len(fd_table())


def temp_files(directory):
    return sorted(n for n in os.listdir(directory) if ".fastckpt-tmp." in n)


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


@pytest.fixture(params=["uring", "threads"])
def backend(request):
    if request.param == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    return request.param


@pytest.fixture
def small_engine(backend):
    """An engine with small buffers so tests cross many buffer boundaries cheaply."""
    return _C.Engine(make_config(backend=backend, buffer_size=64 << 10, buffer_count=4, queue_depth=4))


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    """Frameworks change torch's process-wide settings and leave them (Lightning's
    Trainer(deterministic=True) turns on torch.use_deterministic_algorithms, under which
    torch.empty fills memory and fails for bit dtypes): every test starts from what the
    previous one found."""
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    dtype = torch.get_default_dtype()
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.set_default_dtype(dtype)


@pytest.fixture(autouse=True)
def _clear_faults():
    _C.fault_clear()
    yield
    _C.fault_clear()


def same_state(a, b):
    """Nested dicts of tensors and plain values equal: dtypes, shapes and bytes."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    return a == b


def dcp_unwrapped(fn, *args, **kw):
    """Call fn; dcp wraps a rank's exception in a CheckpointException (a
    BaseException) even without a process group: re-raise the single
    underlying exception as itself."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        return fn(*args, **kw)
    except CheckpointException as ce:
        errors = [f[0] if isinstance(f, tuple) else f for f in ce.failures.values()]
        if len(errors) == 1 and isinstance(errors[0], BaseException):
            raise errors[0] from None
        raise


def wait_for_ranks(procs, scenario, timeout):
    """Wait for the rank processes (stdout piped, stderr merged) of a multi-process
    test, killing any still running at the end, and assert that each exited 0 and
    printed "OK <scenario> rank <r>"; the failure message holds every rank's output."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        kill_all(procs)
    report = "\n".join(f"--- rank {r} (exit {p.returncode})\n{o[-6000:]}" for r, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), report
    for r, o in enumerate(outs):
        assert f"OK {scenario} rank {r}" in o, report


# ---------------------------------------------------------------- a real S3 endpoint (issue 14)

@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """moto's standalone S3 server (tests/python/s3_server.py), one per session,
    with authentication enforced and the bucket s3_server.BUCKET."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        pytest.skip(f"moto[server] or s3fs is not installed ({e}): pip install -r requirements-dev.txt")
    from s3_server import MotoServer
    srv = MotoServer(str(tmp_path_factory.mktemp("moto") / "moto.log"))
    yield srv
    srv.stop()


@pytest.fixture
def s3_proxy(moto_server):
    """A fault-injecting proxy in front of the session's moto server (faults: proxy.add(...))."""
    from s3_server import FaultProxy
    p = FaultProxy(moto_server.port)
    yield p
    p.close()


@pytest.fixture
def s3(moto_server, s3_proxy, request):
    """(URL of a fresh prefix, storage_options through the proxy, the proxy, the server)."""
    import re
    import uuid
    from s3_server import BUCKET
    opts = moto_server.storage_options(s3_proxy.endpoint, config_kwargs={"read_timeout": 5, "connect_timeout": 5})
    name = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:40]
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}", opts, s3_proxy, moto_server
