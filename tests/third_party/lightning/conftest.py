"""Lightning's own checkpoint tests, run with fastckpt's CheckpointIO plugin swapped in.

tests_pytorch/ holds files copied unchanged (header comment aside) from Lightning-AI/pytorch-lightning,
tests/tests_pytorch/, tag 2.6.5 (the closest stored release to the installed lightning 2.6.6;
Apache-2.0, LICENSE in this folder), keeping their package path so that their
``from tests_pytorch.helpers... import`` lines resolve: this folder has no ``__init__.py``, so pytest
puts it on sys.path and names the modules ``tests_pytorch.*``. Copied: the tests that save and load
through the strategy's CheckpointIO (plugins/test_checkpoint_io_plugin.py,
checkpointing/test_trainer_checkpoint.py, checkpointing/test_checkpoint_callback_frequency.py,
checkpointing/test_model_checkpoint.py, trainer/connectors/test_checkpoint_connector.py), the helpers
they import (helpers/__init__.py, helpers/datasets.py, helpers/runif.py), tests_pytorch/__init__.py
and Lightning's own tests_pytorch/conftest.py (its per-test checks: leaked threads, environment
variables, signal handlers, artifacts left in the tests folder). test_model_checkpoint.py imports
jsonargparse, not installed here: a stand-in given only while that module is collected (below) skips
its one CLI test (test_save_last_cli); its tests that need tensorboard, and the ddp_spawn one whose
children import the module, are environment xfails in every mode. Left out: models/test_restore.py
(it needs MNIST downloads, tests_pytorch/loops and more helpers).

FASTCKPT_THIRD_PARTY selects the CheckpointIO a strategy gets when none is given (Lightning's default
``TorchCheckpointIO``, built in ``Strategy.checkpoint_io``, also as the inner plugin of a bare
``AsyncCheckpointIO``):

- ``fastckpt`` (the default): ``fastckpt.integrations.lightning.FastCheckpointIO``;
- ``async``: ``AsyncFastCheckpointIO`` (its writer thread runs only while a save is pending, a daemon
  with ``stop()``, which upstream's thread check calls on a daemon thread a test leaves running);
- ``stock``: nothing swapped (the reference counts for ``fastckpt``);
- ``stock-async``: Lightning's own ``AsyncCheckpointIO`` around a ``TorchCheckpointIO`` (the reference
  counts for ``async``: what fails there fails because the save is in the background, not because of
  fastckpt).

The swap is confined to this folder's tests: an autouse fixture, for each of them only, rebinds the
name ``TorchCheckpointIO`` in ``lightning.pytorch.strategies.strategy`` (the one place that builds the
default) with ``monkeypatch``, which puts it back when the test ends; tests/python, run by the same
xdist worker, see Lightning untouched. Tests that construct ``TorchCheckpointIO`` themselves or patch
its methods keep it (``lightning.fabric.plugins.TorchCheckpointIO`` is not touched). Each test counts
its calls into the plugin's save/load/remove, and the terminal summary of a run given this folder
says how many tests called fastckpt.

XFAIL lists the upstream tests that fail with the swap for a documented reason, per mode (strict in
fastckpt mode; the async entries depend on when the background writer runs, so they are not; the
stock-async entries are the same tests failing with Lightning's own asynchronous plugin). The
environment entries (a package missing here: tensorboard, jsonargparse) apply in every mode, stock
too, and only while the package is missing.

Run directly (``pytest tests/third_party/lightning``) without lightning installed, pytest still loads
tests_pytorch/conftest.py (its initial-conftest rule loads ``<arg>/test*/conftest.py``) and fails to
import it; given ``tests/third_party`` or ``tests``, the folder is ignored with a warning.
"""
import functools
import os
from pathlib import Path
from typing import Dict

import pytest

HERE = Path(__file__).resolve().parent
MODES = ("fastckpt", "async", "stock", "stock-async")
MODE = os.environ.get("FASTCKPT_THIRD_PARTY", "fastckpt")
RELEASE = "2.6."  # the Lightning release the copied tests are for

try:
    import lightning
    import lightning.pytorch.strategies.strategy as _strategy_mod
except ImportError as e:
    UNSUPPORTED = f"lightning is not installed ({e})"
else:
    UNSUPPORTED = None if lightning.__version__.startswith(RELEASE) else (
        f"these are the tests of lightning {RELEASE}x, lightning {lightning.__version__} is installed "
        "(copy the tests of that release)")

if UNSUPPORTED is None:
    # tests_pytorch/__init__.py (unchanged upstream) prepends its project root, here tests/third_party,
    # to os.environ["PYTHONPATH"] when imported: child processes of any later test in the worker
    # (tests/python) would then import tests/third_party/safetensors as `safetensors`. Import it here,
    # before pytest does, and put PYTHONPATH back.
    import sys
    _saved = os.environ.get("PYTHONPATH")
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import tests_pytorch  # noqa: F401
    if _saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = _saved

    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

    from fastckpt.integrations.lightning import AsyncFastCheckpointIO, FastCheckpointIO

    _STRATEGY_CHECKPOINT_IO = _strategy_mod.Strategy.checkpoint_io

    def _stock_async_default(strategy):
        """Strategy.checkpoint_io in stock-async mode: none given means AsyncCheckpointIO(TorchCheckpointIO())
        (the default is not a wrapper class: the property hands every wrapper a new TorchCheckpointIO,
        and a wrapper refuses another wrapper)."""
        if strategy._checkpoint_io is None:
            strategy._checkpoint_io = AsyncCheckpointIO(_strategy_mod.TorchCheckpointIO())
        return _STRATEGY_CHECKPOINT_IO.fget(strategy)


def pytest_ignore_collect(collection_path, config):
    if UNSUPPORTED is not None and collection_path.name != "conftest.py" and HERE in collection_path.parents:
        return True
    return None


def pytest_configure(config):
    if MODE not in MODES:
        raise pytest.UsageError(f"FASTCKPT_THIRD_PARTY={MODE!r}: expected one of {', '.join(MODES)}")
    if UNSUPPORTED is not None:
        config.issue_config_time_warning(pytest.PytestWarning(f"tests/third_party/lightning skipped: {UNSUPPORTED}"),
                                         stacklevel=2)


# xfails: test id (relative to this folder; without [params]: every parametrization) -> (modes, strict: a bool
# or the modes where it is strict, why), or a list of those (the first naming the mode applies). The async entries are not strict: their outcome depends on when the
# background writer runs.
BOTH = ("fastckpt", "async")
FREQ = "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py::"
CONN = "tests_pytorch/trainer/connectors/test_checkpoint_connector.py::"
MOCKS_TORCH_SAVE = ("test assumes internals: counts calls of a mocked torch.save; fastckpt's plugin writes "
                    "through fastckpt.save, never torch.save (so 0 calls)")
ASYNC_PENDING = ("async by design: trainer.save_checkpoint() returns with the save still pending and the test "
                 "then reads or lists the file; fails the same with Lightning's own AsyncCheckpointIO "
                 "(stock-async mode; racy: not strict)")
ASYNC = ("async", "stock-async")
XFAIL: Dict[str, tuple] = {
    # async: some of these pass, depending on when the background writer ran (strict in fastckpt mode only)
    FREQ + "test_default_checkpoint_freq": (BOTH, ("fastckpt",), MOCKS_TORCH_SAVE),
    FREQ + "test_top_k": (BOTH, ("fastckpt",), MOCKS_TORCH_SAVE),
    "tests_pytorch/checkpointing/test_trainer_checkpoint.py::test_trainer_save_checkpoint_storage_options": [
        (("stock-async",), False, "async by design: the test asserts a mocked TorchCheckpointIO.save_checkpoint "
                                  "was called as soon as trainer.save_checkpoint() returns; the call runs on "
                                  "the writer thread (racy: not strict)"),
        (BOTH, True, "test assumes internals: mock.patch of TorchCheckpointIO.save_checkpoint, the default "
                     "class's method, so the storage_options call reaches fastckpt's plugin, which refuses it "
                     "(TypeError, as TorchCheckpointIO would)")],
    CONN + "test_ckpt_for_fsspec": (("stock-async",), False, ASYNC_PENDING),
    CONN + "test_hpc_restore_attempt": (ASYNC, False, ASYNC_PENDING),
    CONN + "test_hpc_max_ckpt_version": (ASYNC, False, ASYNC_PENDING),
    CONN + "test_strict_loading": (ASYNC, False, ASYNC_PENDING),
    CONN + "test_restore_callbacks_in_non_fit_phases": (ASYNC, False, ASYNC_PENDING),
}
MC = "tests_pytorch/checkpointing/test_model_checkpoint.py::"
XFAIL.update({
    MC + "test_none_monitor_not_alternating": (
        ASYNC, False, "async by design: the model lists the checkpoint folder at the next epoch's start, while "
                      "ModelCheckpoint's save of the last epoch may still be pending; fails the same with "
                      "Lightning's own AsyncCheckpointIO (stock-async mode; racy: not strict)"),
    MC + "test_none_monitor_saves_correct_best_model_path": (ASYNC, False, ASYNC_PENDING),
    MC + "test_save_last_saves_correct_last_model_path": (ASYNC, False, ASYNC_PENDING),
    MC + "test_ckpt_version_after_rerun_same_trainer": (
        ASYNC, False, "async by design: ModelCheckpoint picks a name's next -vN suffix by checking whether the file "
                      "exists, and the earlier save of that name may still be pending, so the name is reused; "
                      "fails the same with Lightning's own AsyncCheckpointIO (stock-async mode; racy: not strict)"),
})
# Environment, every mode stock included (strict: listed only while the package is missing): upstream's CI has
# these packages, so upstream does not mark the tests.
import importlib.util as _ilu  # noqa: E402

if _ilu.find_spec("tensorboard") is None and _ilu.find_spec("tensorboardX") is None:
    _NO_TB = (MODES, True, "environment: the test's TensorBoardLogger needs tensorboard or tensorboardX, neither is "
                           "installed here")
    XFAIL.update({MC + "test_model_checkpoint_path": _NO_TB,
                  MC + "test_checkpoint_repeated_strategy_extended": _NO_TB})
if _ilu.find_spec("jsonargparse") is None:
    XFAIL[MC + "test_model_checkpoint_no_extraneous_invocations"] = (
        MODES, True, "environment: ddp_spawn's child processes import the test module, which imports jsonargparse "
                     "(not installed here; the stand-in below covers this process's collection only)")


def _mine(item) -> bool:
    return HERE in Path(item.path).resolve().parents


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    mine = [it for it in items if _mine(it)]
    if not mine:  # stock mode too: the environment entries name it
        return
    ids = {}
    for it in mine:
        ids[Path(it.path).resolve().relative_to(HERE).as_posix() + "::" + it.nodeid.split("::", 1)[1]] = it
    for tid, item in ids.items():
        entries = XFAIL.get(tid) or XFAIL.get(tid.split("[", 1)[0]) or []
        if isinstance(entries, tuple):
            entries = [entries]
        entry = next((e for e in entries if MODE in e[0]), None)
        if entry is not None:
            strict = entry[1] if isinstance(entry[1], bool) else MODE in entry[1]
            item.add_marker(pytest.mark.xfail(strict=strict, reason=entry[2]))


@pytest.fixture(autouse=True)
def _fastckpt_checkpoint_io(request, monkeypatch):
    """The default CheckpointIO is fastckpt's for this test (see the module docstring)."""
    if MODE == "stock" or not _mine(request.node):
        yield
        return
    cls = {"fastckpt": FastCheckpointIO, "async": AsyncFastCheckpointIO, "stock-async": AsyncCheckpointIO}[MODE]
    calls: Dict[str, int] = {}

    def counted(name):
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    for name in ("save_checkpoint", "load_checkpoint", "remove_checkpoint"):
        monkeypatch.setattr(cls, name, counted(name))
    if MODE == "stock-async":
        monkeypatch.setattr(_strategy_mod.Strategy, "checkpoint_io",
                            property(_stock_async_default, _STRATEGY_CHECKPOINT_IO.fset))
    else:
        monkeypatch.setattr(_strategy_mod, "TorchCheckpointIO", cls)
    yield
    request.node.user_properties.append(("fastckpt_calls", sum(calls.values())))


_called: Dict[str, int] = {}


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "fastckpt_calls":
                _called[report.nodeid] = value


def pytest_terminal_summary(terminalreporter):
    if MODE != "stock" and _called:
        n = sum(1 for v in _called.values() if v)
        terminalreporter.write_line(f"third_party/lightning ({MODE}): {n} of {len(_called)} upstream tests called the "
                                    f"swapped-in CheckpointIO ({sum(_called.values())} calls)")


# test_model_checkpoint.py does ``from jsonargparse import ArgumentParser`` at import time, for one test
# (test_save_last_cli, Lightning's CLI parsing ``save_last``), and jsonargparse is not installed here. While that
# module is imported (only then: sys.modules is put back after), a stand-in ``jsonargparse`` is given whose
# ArgumentParser skips the test that builds one; with jsonargparse installed, nothing is stubbed.
_NEEDS_JSONARGPARSE = HERE / "tests_pytorch" / "checkpointing" / "test_model_checkpoint.py"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    import importlib.util
    import sys
    import types

    stub = (getattr(collector, "path", None) == _NEEDS_JSONARGPARSE and "jsonargparse" not in sys.modules
            and importlib.util.find_spec("jsonargparse") is None)
    if stub:
        mod = types.ModuleType("jsonargparse")

        class ArgumentParser:
            def __init__(self, *args, **kwargs):
                pytest.skip("jsonargparse is not installed (stand-in from tests/third_party/lightning/conftest.py)")

        mod.ArgumentParser = ArgumentParser
        sys.modules["jsonargparse"] = mod
    try:
        yield
    finally:
        if stub:
            sys.modules.pop("jsonargparse", None)
