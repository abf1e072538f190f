"""Packaging: the distribution ``fastckpt-io`` (the import name and the command stay
``fastckpt``) builds as a wheel with build isolation (pyproject.toml's build requirements, torch pinned
to the one running) and without it; the wheel, installed outside the checkout, imports its own engine,
saves and loads, and says its version; ``fastckpt --version`` agrees with ``__version__`` and the
installed metadata.
"""
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import fastckpt

from paths import ROOT

REPO = str(ROOT)
DIST = "fastckpt-io"
# What the checkout's copy for the isolated build leaves out: outputs and environments, not sources.
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "build-*", "*.so", "*.egg-info", "__pycache__",
                                      ".pytest_cache", ".hypothesis", ".bench-tmp*", ".whl", ".gl")


def _version_line() -> str:
    return f"fastckpt {fastckpt.__version__} (torch {torch.__version__})"


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def test_version_is_one_figure_everywhere():
    assert re.fullmatch(r"\d+\.\d+\.\d+", fastckpt.__version__)
    assert importlib.metadata.version(DIST) == fastckpt.__version__
    eps = [e for e in importlib.metadata.distribution(DIST).entry_points if e.group == "console_scripts"]
    assert [(e.name, e.value) for e in eps] == [("fastckpt", "fastckpt.cli:main")]
    assert _run([sys.executable, "-m", "fastckpt", "--version"]).stdout.strip() == _version_line()
    exe = shutil.which("fastckpt", path=os.path.dirname(sys.executable))
    if exe is not None:  # the console script of the environment running the tests
        assert _run([exe, "--version"]).stdout.strip() == _version_line()
    # setup.py reads the same line (the one source of the version)
    out = _run([sys.executable, "setup.py", "--version"], cwd=REPO)
    assert out.stdout.strip().splitlines()[-1] == fastckpt.__version__


def _check_wheel(whl: str, tmp_path) -> None:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
        eps = z.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    assert any(re.fullmatch(r"fastckpt/_C\..*\.so", n) for n in names), names
    for n in ("fastckpt/__init__.py", "fastckpt/_C.pyi", "fastckpt/py.typed", "fastckpt/dcp/__init__.py"):
        assert n in names, n
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "csrc/"))]
    assert f"Name: {DIST}\n" in meta and f"Version: {fastckpt.__version__}\n" in meta
    assert "fastckpt = fastckpt.cli:main" in eps
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), whl])
    work = tmp_path / "work"  # outside the checkout: nothing can import the checkout's package by accident
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import os, sys, torch, fastckpt\n"
            "assert fastckpt.__file__.startswith(sys.argv[1]), fastckpt.__file__\n"
            "import fastckpt._C as C; assert C.__file__.startswith(sys.argv[1]), C.__file__\n"
            "sd = {'w': torch.randn(300, 200), 'b': torch.arange(7, dtype=torch.int16), 'step': 3}\n"
            "fastckpt.save(sd, 'ck.pt')\n"
            "back = fastckpt.load('ck.pt')\n"
            "assert torch.equal(back['w'], sd['w']) and torch.equal(back['b'], sd['b']) and back['step'] == 3\n"
            "assert torch.equal(torch.load('ck.pt', weights_only=True)['w'], sd['w'])\n"
            "print('ok')\n")
    assert _run([sys.executable, "-c", code, str(site)], cwd=work, env=env).stdout.strip() == "ok"
    assert _run([sys.executable, "-m", "fastckpt", "--version"], cwd=work, env=env).stdout.strip() == _version_line()


def test_wheel_without_build_isolation(tmp_path):
    """`pip wheel --no-build-isolation` in the checkout (it reuses the build's objects: seconds)."""
    out = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(out), REPO],
         cwd=REPO)
    (whl,) = out.glob("fastckpt_io-*.whl")
    _check_wheel(str(whl), tmp_path)


@pytest.mark.long  # a full build in a fresh environment (2-3 minutes here); the wheel without isolation is in make test
def test_wheel_with_build_isolation(tmp_path):
    """`pip wheel` with build isolation, from a copy of the sources: pip installs pyproject.toml's build
    requirements into a fresh environment, with torch pinned (--build-constraint) to the torch running here,
    whose headers the extension is compiled against (2-3 minutes here: torch installed, a full compile)."""
    pip_version = tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version("pip"))[:2])
    if pip_version < (25, 3):
        pytest.skip(f"pip {importlib.metadata.version('pip')} has no --build-constraint (25.3+; .ci/setup.sh "
                    "upgrades pip)")
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_NOT_SOURCES)
    constraint = tmp_path / "build-constraint.txt"
    constraint.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    out = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--build-constraint", str(constraint),
          "-w", str(out), str(src)], cwd=tmp_path)
    (whl,) = out.glob("fastckpt_io-*.whl")
    _check_wheel(str(whl), tmp_path)
