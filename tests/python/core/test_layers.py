"""The package's layers and its extension rule hold (import-linter, the contracts
in pyproject.toml), and the contracts do fail on a package that breaks them."""

import os
import shutil
import subprocess
import sys
import textwrap
import pytest

from paths import ROOT


def _lint(cwd, config=None):
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("import-linter is not installed (requirements-dev.txt)")
    cmd = [exe, "--no-cache"] + (["--config", str(config)] if config else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(cwd), str(ROOT)]))
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_fastckpt_keeps_its_contracts():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kept, 0 broken" in r.stdout


def test_the_contracts_fail_on_a_package_that_breaks_them(tmp_path):
    pkg = tmp_path / "toy"
    (pkg / "_core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_core" / "__init__.py").write_text("")
    (pkg / "_core" / "engine.py").write_text("from .. import _C\nfrom .. import api\n")   # up a layer
    (pkg / "api.py").write_text("from . import _C\n")                                    # not allowed the extension
    cfg = tmp_path / "contracts.toml"
    cfg.write_text(textwrap.dedent("""
        [tool.importlinter]
        root_package = "toy"
        contract_types = ["extension: tests.support.import_contracts.ExtensionContract"]

        [[tool.importlinter.contracts]]
        name = "layers"
        type = "layers"
        containers = ["toy"]
        layers = ["api", "_core"]
        ignore_imports = ["toy.** -> toy"]

        [[tool.importlinter.contracts]]
        name = "extension"
        type = "extension"
        extension = "toy._C"
        allowed = ["toy._core"]
    """))
    r = _lint(tmp_path, cfg)
    assert r.returncode != 0
    assert "toy._core is not allowed to import toy.api" in r.stdout, r.stdout
    assert "toy.api:1: from . import _C" in r.stdout, r.stdout
    assert "0 kept, 2 broken" in r.stdout, r.stdout
