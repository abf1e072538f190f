"""safetensors' own Python tests, run against fastckpt.safetensors, the drop-in for safetensors.torch.

The test files here are copied unchanged (header comment aside) from huggingface/safetensors,
bindings/python/tests/ (the commit is in each header; Apache-2.0, LICENSE in this folder): the ones
that test the torch API. Left out, as they test no torch API: test_flax_comparison.py,
test_mlx_comparison.py, test_paddle_comparison.py, test_tf_comparison.py (other frameworks, not
installed), test_handle.py (numpy and fsspec file handles), test_threadable.py (numpy's
serialize_file and the GIL).

FASTCKPT_THIRD_PARTY selects what the tests call:

- ``fastckpt`` (the default): ``save``, ``load``, ``save_file``, ``load_file``, ``save_model`` and
  ``load_model`` (what fastckpt.safetensors mirrors) are fastckpt.safetensors's. Everything else
  (``safe_open``, the private helpers that test_pt_model.py and test_simple.py test) stays
  safetensors' own, so that safetensors reads what fastckpt wrote and the other way round.
- ``stock``: nothing is swapped (the reference counts).

How the swap is confined to this folder. The upstream modules bind the functions when they are
imported (``from safetensors.torch import load_file as load_file_pt``), and under pytest-xdist one
worker process also runs tests/python, whose tests compare fastckpt with the stock functions. So
nothing is patched process-wide: an autouse fixture, for each test of this folder only, rebinds the
module globals of the test's own module that ARE safetensors.torch's functions (by identity, so
that test_simple.py's ``load_file`` from safetensors.numpy is left alone) and the same attributes of
``safetensors.torch``, with ``monkeypatch``, which puts everything back when the test ends. The
fixture runs before unittest's ``setUp``, so the files a ``setUp`` writes are fastckpt's too.
Collection checks every module of this folder: each one binds at least one of the four functions,
and every binding is the stock function (a function of that name from safetensors.torch that is
not would mean a wrapper we do not know, and a test that would silently call neither).

Each fastckpt-mode test counts its calls into fastckpt.safetensors, and a run given this folder prints
how many tests called fastckpt in the terminal summary (the counts travel in the reports'
user_properties, so under xdist too; ``make test``, given ``tests/third_party``, does not load this
conftest in the xdist controller and prints nothing).
Each test runs in its own temporary directory with a ``tests/data/`` folder, where the upstream
tests write their files (they expect to run from bindings/python/).

XFAIL lists the upstream tests that fail against fastckpt for a documented reason (strict: a fix
makes the run fail until its entry is removed). Real fastckpt bugs are not listed here.
"""
import functools
import os
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

import fastckpt.safetensors as _fast

HERE = Path(__file__).resolve().parent
MODES = ("fastckpt", "stock")
MODE = os.environ.get("FASTCKPT_THIRD_PARTY", "fastckpt")
if MODE == "async":  # a mode of tests/third_party/lightning; safetensors has no async functions: fastckpt's
    MODE = "fastckpt"
MIRRORED = ("save", "load", "save_file", "load_file", "save_model", "load_model")
RELEASE = "0.8."  # the safetensors release the copied tests are for

try:
    import safetensors
    import safetensors.torch as _stock
except ImportError as e:
    UNSUPPORTED = f"safetensors is not installed ({e})"
else:
    UNSUPPORTED = None if safetensors.__version__.startswith(RELEASE) else (
        f"these are the tests of safetensors {RELEASE}x, safetensors {safetensors.__version__} is installed "
        "(copy the tests of that release)")


class _Skipped(pytest.Module):
    """A test module of this folder where the tests cannot run: one skip with the reason (its import
    would fail, or test another release's behaviour)."""

    def _getobj(self):
        pytest.skip(UNSUPPORTED, allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if UNSUPPORTED is not None:
        return _Skipped.from_parent(parent, path=module_path)
    return None


def _unwrap(fn):
    """The function under wrappers that keep it as ``.original`` (fastckpt.integrations.transformers
    installs such a dispatcher over safetensors.torch.save_file, process-wide, once used)."""
    seen = 0
    while hasattr(fn, "original") and seen < 8:
        fn, seen = fn.original, seen + 1
    return fn


STOCK = {} if UNSUPPORTED else {name: _unwrap(getattr(_stock, name)) for name in MIRRORED}
_BY_ID = {id(fn): name for name, fn in STOCK.items()}

# Strict xfails in fastckpt mode: test id (relative to this folder) -> why.
XFAIL: Dict[str, str] = {
    # file layout, by design: fastckpt pads the header with spaces so that the data starts at 4 KiB
    # (O_DIRECT reads and writes); the files are valid and safetensors reads them (other tests here)
    "test_pt_comparison.py::TorchTestCase::test_serialization":
        "layout: save_file's bytes compared with the reference's 8-byte header padding; fastckpt pads to 4 KiB",
    "test_pt_model.py::TorchModelTestCase::test_save":
        "layout: reads the data at byte 192 of the reference's header size; fastckpt's data starts at 4 KiB",
    "test_pt_comparison.py::TorchTestCase::test_in_memory":
        "layout: save()'s bytes compared with the reference's 8-byte header padding; fastckpt pads to 4 KiB",
    "test_pt_comparison.py::TorchTestCase::test_complex":
        "layout: save()'s bytes compared with the reference's 8-byte header padding; fastckpt pads to 4 KiB",
    # error messages: the exception type is the one the test wants, the text is not the reference's
    "test_pt_comparison.py::TorchTestCase::test_sparse":
        "message: ValueError as upstream, but asserts safetensors' sentence verbatim; fastckpt words it itself",
    "test_pt_comparison.py::TorchTestCase::test_meta_tensor":
        "message: fastckpt refuses a meta tensor up front (NotImplementedError, a RuntimeError) with its own "
        "text; the test wants torch's 'Cannot copy out of meta tensor' from deep inside the copy",
}


def _mine(item) -> bool:
    return HERE in Path(item.path).resolve().parents


def _bindings(module) -> List[Tuple[str, str]]:
    """(global name, mirrored function) for every global of `module` that is safetensors.torch's
    save_file/load_file/save_model/load_model; UsageError for a same-named safetensors.torch function
    that is not the stock one."""
    found = []
    for gname, value in vars(module).items():
        if not callable(value):
            continue
        fn = _unwrap(value)
        name = _BY_ID.get(id(fn))
        if name is not None and fn is STOCK[name]:
            found.append((gname, name))
        elif getattr(fn, "__module__", None) == "safetensors.torch" and getattr(fn, "__name__", None) in MIRRORED:
            raise pytest.UsageError(f"{module.__name__}.{gname} is a safetensors.torch.{fn.__name__} that is not "
                                    "the stock function: the drop-in swap would miss it")
    return found


def _defined(module, names: List[str]) -> bool:
    obj = module
    for name in names:
        obj = getattr(obj, name, None)
        if obj is None:
            return False
    return True


def pytest_configure(config):
    if MODE not in MODES:
        raise pytest.UsageError(f"FASTCKPT_THIRD_PARTY={MODE!r}: expected one of {', '.join(MODES)}")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: the markers go on every test they name
def pytest_collection_modifyitems(session, config, items):
    mine = [it for it in items if _mine(it)]
    if not mine:
        return
    for module in {it.module for it in mine}:
        if not _bindings(module):
            raise pytest.UsageError(f"{module.__name__} binds none of safetensors.torch's {', '.join(MIRRORED)}: "
                                    "nothing of it would run against fastckpt")
    if MODE != "fastckpt":
        return
    ids, modules = {}, {}
    for it in mine:
        rel = Path(it.path).resolve().relative_to(HERE).as_posix()
        ids[rel + "::" + it.nodeid.split("::", 1)[1]] = it
        modules[rel] = it.module
    # an entry whose test no longer exists in its (collected) module: looked up in the module itself,
    # so that a run of a single test or a -k selection does not count the others as missing
    stale = [k for k in XFAIL if k.split("::", 1)[0] in modules
             and not _defined(modules[k.split("::", 1)[0]], k.split("::")[1:])]
    if stale:
        raise pytest.UsageError(f"XFAIL names tests that do not exist (renamed upstream?): {stale}")
    for key, reason in XFAIL.items():
        if key in ids:
            ids[key].add_marker(pytest.mark.xfail(strict=True, reason=reason))


@pytest.fixture(autouse=True)
def _upstream_setting(request, tmp_path, monkeypatch):
    """The test's own directory (with tests/data/), and in fastckpt mode the drop-in swapped in for
    this test only (see the module docstring)."""
    (tmp_path / "tests" / "data").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    if MODE != "fastckpt":
        yield
        return
    calls: Dict[str, int] = {}

    def counted(name):
        fn = getattr(_fast, name)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    swapped = {name: counted(name) for name in MIRRORED}
    for name in MIRRORED:
        monkeypatch.setattr(_stock, name, swapped[name])
    for gname, name in _bindings(request.module):
        monkeypatch.setattr(request.module, gname, swapped[name])
    yield
    request.node.user_properties.append(("fastckpt_calls", sum(calls.values())))


_called: Dict[str, int] = {}


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "fastckpt_calls":
                _called[report.nodeid] = value


def pytest_terminal_summary(terminalreporter):
    if MODE == "fastckpt" and _called:
        n = sum(1 for v in _called.values() if v)
        terminalreporter.write_line(f"third_party/safetensors: {n} of {len(_called)} upstream tests called "
                                    f"fastckpt.safetensors ({sum(_called.values())} calls); the others test "
                                    "safetensors' own functions only")
