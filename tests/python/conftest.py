"""Fixtures of the Python tests: engines and backends, torch's process-wide settings, injected faults, and
a real S3 endpoint. Plain helpers live in tests/support/ (imported by their bare names, `from leaks import
temp_files`; tests/conftest.py puts that folder on sys.path)."""
import os

import torch

import pytest

from fastckpt import _C

from engines import make_config, uring_refusal


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
def _restore_environment():
    """A test leaves the process environment as it found it (the next test on this worker would
    see what it set: the crash driver made inside a test once left FASTCKPT_MEMORY_DIR set, and
    later tests' memory tiers made /dev/shm directories under its name). Every change is undone;
    a change to a FASTCKPT_ variable, a fastckpt setting that later tests would run under,
    fails the test."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    for d in (before, after):
        d.pop("PYTEST_CURRENT_TEST", None)  # pytest's own, set for each phase
    if after == before:
        return
    for k in set(after) - set(before):
        del os.environ[k]
    os.environ.update(before)
    ours = sorted(k for k in set(before) | set(after) if k.startswith("FASTCKPT_") and before.get(k) != after.get(k))
    if ours:
        pytest.fail("the test left fastckpt settings in the process environment: "
                    + ", ".join(f"{k}={after.get(k)!r} (was {before.get(k)!r})" for k in ours), pytrace=False)


@pytest.fixture(autouse=True)
def _clear_faults():
    _C.fault_clear()
    yield
    _C.fault_clear()


# ---------------------------------------------------------------- a real S3 endpoint

@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """moto's standalone S3 server (tests/support/s3_server.py), one per session,
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
