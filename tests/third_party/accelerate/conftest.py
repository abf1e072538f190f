"""Accelerate's own state-checkpointing tests, run with fastckpt.integrations.accelerate.use_fastckpt.

test_state_checkpointing.py is copied unchanged (header comment aside) from huggingface/accelerate
(the commit is in its header; Apache-2.0, LICENSE in this folder). It imports
``accelerate.test_utils``, which ships inside the installed accelerate package.

FASTCKPT_THIRD_PARTY selects what the tests run against:

- ``fastckpt`` (the default): every ``Accelerator`` a test creates gets ``use_fastckpt`` applied
  right after its ``__init__``, so its ``save_state`` / ``load_state`` are fastckpt's.
- ``stock``: nothing is swapped (the reference counts).

How the swap is confined to this folder: an autouse fixture, for each test of this folder only,
replaces ``accelerate.Accelerator.__init__`` with ``monkeypatch`` (the test module binds the class
itself, ``from accelerate import Accelerator``, so patching the class reaches it); monkeypatch puts
the original back when the test ends, so tests/python, run by the same xdist worker, never sees it.
Each test counts the ``save_state`` / ``load_state`` calls that went through fastckpt; a test that
calls either but never through fastckpt fails (the swap would have missed it).

The one test that launches processes (``test_map_location``: ``accelerate launch`` of the test file
as a script) is ``require_non_cpu`` upstream: it skips on a CPU-only machine in both modes, and the
swap does not reach that subprocess (nothing here would make it).

``parameterized`` is not one of fastckpt's test dependencies: where it is missing, _parameterized.py
stands in for the one function the file uses (``parameterized_class``).
"""
import functools
import os
import sys
from pathlib import Path
from typing import Dict

import pytest

HERE = Path(__file__).resolve().parent
MODES = ("fastckpt", "stock")
MODE = os.environ.get("FASTCKPT_THIRD_PARTY", "fastckpt")
RELEASE = "1.15."  # the accelerate release the copied tests are for

try:
    import accelerate
except ImportError as e:
    UNSUPPORTED = f"accelerate is not installed ({e})"
else:
    UNSUPPORTED = None if accelerate.__version__.startswith(RELEASE) else (
        f"these are the tests of accelerate {RELEASE}x, accelerate {accelerate.__version__} is installed "
        "(copy the tests of that release)")

if UNSUPPORTED is None:
    try:
        import parameterized  # noqa: F401
    except ImportError:
        from . import _parameterized
        sys.modules["parameterized"] = _parameterized


class _Skipped(pytest.Module):
    def _getobj(self):
        pytest.skip(UNSUPPORTED, allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if UNSUPPORTED is not None and module_path.name.startswith("test_"):
        return _Skipped.from_parent(parent, path=module_path)
    return None


def pytest_configure(config):
    if MODE not in MODES:
        raise pytest.UsageError(f"FASTCKPT_THIRD_PARTY={MODE!r}: expected one of {', '.join(MODES)}")


# Strict xfails in fastckpt mode: test id (relative to this folder) -> why. Real fastckpt bugs are not listed.
XFAIL: Dict[str, str] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    if MODE != "fastckpt":
        return
    for it in items:
        if HERE in Path(it.path).resolve().parents:
            key = Path(it.path).resolve().relative_to(HERE).as_posix() + "::" + it.nodeid.split("::", 1)[1]
            if key in XFAIL:
                it.add_marker(pytest.mark.xfail(strict=True, reason=XFAIL[key]))


@pytest.fixture(autouse=True)
def _use_fastckpt(request, monkeypatch):
    if MODE != "fastckpt" or HERE not in Path(request.node.path).resolve().parents:
        yield
        return
    from fastckpt.integrations import accelerate as integ

    calls = {"fast": 0, "state": 0}
    original_init = accelerate.Accelerator.__init__
    for name, impl in (("_save_state", integ._save_state), ("_load_state", integ._load_state)):
        @functools.wraps(impl)
        def counted(*args, _impl=impl, **kwargs):
            calls["fast"] += 1
            return _impl(*args, **kwargs)
        monkeypatch.setattr(integ, name, counted)

    for name in ("save_state", "load_state"):
        stock = getattr(accelerate.Accelerator, name)

        @functools.wraps(stock)
        def any_call(self, *args, _stock=stock, **kwargs):  # reached only when the swap missed
            calls["state"] += 1
            return _stock(self, *args, **kwargs)
        monkeypatch.setattr(accelerate.Accelerator, name, any_call)

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        integ.use_fastckpt(self)
    monkeypatch.setattr(accelerate.Accelerator, "__init__", init)
    yield
    request.node.user_properties.append(("fastckpt_calls", calls["fast"]))
    assert calls["state"] == 0, f"{calls['state']} save_state/load_state calls bypassed fastckpt"


_called: Dict[str, int] = {}


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "fastckpt_calls":
                _called[report.nodeid] = value


def pytest_terminal_summary(terminalreporter):
    if MODE == "fastckpt" and _called:
        n = sum(1 for v in _called.values() if v)
        terminalreporter.write_line(f"third_party/accelerate: {n} of {len(_called)} upstream tests called "
                                    f"save_state/load_state through fastckpt ({sum(_called.values())} calls)")
