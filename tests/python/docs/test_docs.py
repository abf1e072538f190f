"""The docs say what is true: README.md and docs/**/*.md.

- Every dotted name ``fastckpt.x.y`` they mention resolves, the way a user's
  ``import fastckpt.x; fastckpt.x.y`` would: the longest importable module
  prefix is imported, then every part is looked up as an attribute from the
  top package (so a function that shadows its own module is caught).
- Every ```python block of README.md and docs/guide/*.md runs, in an empty
  directory, unless the HTML comment right before it says why not
  (``<!-- not run: REASON -->``). ``<!-- torchrun: N -->`` runs the block as a
  script on N ranks, twice (the second run resumes). ``<!-- requires: module -->`` skips the block
  when that module is missing; ``<!-- excerpt: PATH -->`` instead checks that
  each of the block's lines is a line of PATH (an excerpt of a file that
  another test runs).
- No issue or tracker references anywhere; README.md is at most 300 lines.
- Every test named in the docs exists (file, and function where one is named),
  and so does every crash-driver kind and power-loss scenario GUARANTEES.md names.
"""
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOC_FILES = [README] + sorted((ROOT / "docs").rglob("*.md"))
RUN_FILES = [README] + sorted((ROOT / "docs" / "guide").glob("*.md"))
README_MAX_LINES = 300


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


# ---------------------------------------------------------------- (a) dotted names

# `fastckpt.` followed by identifiers; not part of a path (`fastckpt/x.py`), a
# longer word (`libfastckpt`), a file name (`.fastckpt-tmp`) or a distribution (`fastckpt-io`).
NAME_RE = re.compile(r"(?<![\w./-])fastckpt(?:\.[A-Za-z_]\w*)+")


def dotted_names(text: str):
    return [m.group(0) for m in NAME_RE.finditer(text)]


def _all_names():
    where = {}
    for f in DOC_FILES:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for n in dotted_names(line):
                where.setdefault(n, []).append(f"{_rel(f)}:{i}")
    return where


# Spelled like a dotted name, but not a Python name: (name, what it is).
NOT_PYTHON_NAMES = {"fastckpt.layout": "the safetensors metadata key that records a converted checkpoint's nesting"}
NAMES = {n: w for n, w in _all_names().items() if n not in NOT_PYTHON_NAMES}


def resolve(name: str):
    """The object `name` denotes, as user code spelling it would get it.
    Raises ImportError (a module is missing) or AttributeError (it is not there)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # import the longest importable prefix
        mod = ".".join(parts[:i])
        try:
            importlib.import_module(mod)
            break
        except ModuleNotFoundError as e:
            if e.name is None or not (mod == e.name or mod.startswith(e.name + ".")):
                raise  # the module exists but needs something that is missing
    obj = importlib.import_module(parts[0])
    for k, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):
            raise AttributeError(f"{'.'.join(parts[:k])} ({type(obj).__name__}) has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", sorted(NAMES))
def test_dotted_name_resolves(name):
    try:
        resolve(name)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("fastckpt"):
            pytest.skip(f"{name} needs {e.name!r}, which is not installed")
        raise AssertionError(f"{name} (mentioned at {', '.join(NAMES[name])}) does not resolve: {e}") from None
    except (ImportError, AttributeError) as e:
        raise AssertionError(f"{name} (mentioned at {', '.join(NAMES[name])}) does not resolve: {e}") from None


def test_the_name_check_can_fail():
    assert dotted_names("see `fastckpt.load(f)`, fastckpt/x.py, fastckpt-io and .fastckpt-tmp.") == ["fastckpt.load"]
    resolve("fastckpt.load")
    for bad in ("fastckpt.no_such_name", "fastckpt.no_such_module.x", "fastckpt.load.nothing"):
        with pytest.raises((AttributeError, ImportError)):
            resolve(bad)


# ---------------------------------------------------------------- (b) examples

FENCE_RE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARK_RE = re.compile(r"<!--\s*(not run|requires|excerpt|torchrun)\s*:\s*(.*?)\s*-->")


def python_blocks(text: str):
    """(first line number, code, {marker: value}) of every ```python block;
    markers are the HTML comments on the lines right before the fence."""
    out = []
    for m in FENCE_RE.finditer(text):
        if m.group(1) != "python":
            continue
        before = text[:m.start()].splitlines()
        marks = {}
        while before and (before[-1].strip() == "" or before[-1].strip().startswith("<!--")):
            for k, v in MARK_RE.findall(before.pop()):
                marks[k] = v
        out.append((text.count("\n", 0, m.start()) + 2, m.group(2), marks))
    return out


BLOCKS = [(f, line, code, marks) for f in RUN_FILES for line, code, marks in python_blocks(f.read_text())]


def run_block(code: str, marks: dict, label: str) -> None:
    if "not run" in marks:
        assert marks["not run"], f"{label}: `not run` needs a reason"
        pytest.skip(f"{label}: not run: {marks['not run']}")
    if "excerpt" in marks:
        src = (ROOT / marks["excerpt"]).read_text().splitlines()
        have = {l.strip() for l in src}
        missing = [l for l in code.splitlines() if l.strip() and l.strip() != "..." and l.strip() not in have]
        assert not missing, f"{label}: lines not in {marks['excerpt']}: {missing}"
        return
    for mod in filter(None, re.split(r"[,\s]+", marks.get("requires", ""))):
        pytest.importorskip(mod)
    if "torchrun" in marks:  # a script for N ranks: run as torchrun runs it
        script = Path(f"docs_example_{os.getpid()}.py")
        script.write_text(code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               marks["torchrun"], str(script)]
        for _ in range(2):  # twice: the second run resumes from what the first saved
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
            assert r.returncode == 0, f"{label} under torchrun: {r.stdout}{r.stderr}"
        return
    exec(compile(code, label, "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("f,line,code,marks", BLOCKS, ids=[f"{_rel(f)}:{line}" for f, line, _, _ in BLOCKS])
def test_example_runs(f, line, code, marks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # A memory tier of an example keeps its snapshots in a shared-memory directory of the test's
    # own, never in the default one (/dev/shm/fastckpt) that a job on this machine may be using.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    mem = tempfile.mkdtemp(prefix="fastckpt-docs-", dir=shm or str(tmp_path))
    monkeypatch.setenv("FASTCKPT_MEMORY_DIR", mem)
    try:
        run_block(code, marks, f"{_rel(f)}:{line}")
    finally:
        shutil.rmtree(mem, ignore_errors=True)


def test_every_guide_page_and_the_readme_have_examples_that_run():
    assert {f for f, _, _, m in BLOCKS if not m} >= {README}, "README shows no example that runs"


def test_the_example_check_can_fail(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = "x\n<!-- excerpt: README.md -->\n```python\nnot a line of the README\n```\n\n```python\nraise ValueError('x')\n```\n"
    (b1, b2) = python_blocks(text)
    assert b1[2] == {"excerpt": "README.md"} and b2[2] == {} and b2[0] == 8
    with pytest.raises(AssertionError, match="lines not in README.md"):
        run_block(b1[1], b1[2], "excerpt")
    with pytest.raises(ValueError):
        run_block(b2[1], b2[2], "plain")
    with pytest.raises(AssertionError, match="needs a reason"):
        run_block("pass", {"not run": ""}, "no reason")


# ---------------------------------------------------------------- (c) issue references, README's length

ISSUE_RE = re.compile(r"\b(?:issues?|Issues?|ISSUES?|tickets?|PR)\b|(?<![\w&])#\d+")


def issue_references(text: str):
    return [(i, m.group(0)) for i, line in enumerate(text.splitlines(), 1) for m in ISSUE_RE.finditer(line)]


@pytest.mark.parametrize("f", DOC_FILES, ids=_rel)
def test_no_issue_references(f):
    found = issue_references(f.read_text())
    assert not found, f"{_rel(f)}: issue or tracker references at lines {found}"


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: the rest belongs in docs/)"


def test_the_reference_check_can_fail():
    assert issue_references("fixed in issue 12\nsee #7\nIssue 3") == [(1, "issue"), (2, "#7"), (3, "Issue")]
    assert issue_references("a copy is issued on a stream; `#include <x>`; [a](#section-2); &#39;") == []


# ---------------------------------------------------------------- (d) the tests the docs name

TESTS = ROOT / "tests"
TICK_RE = re.compile(r"`([^`\n]+)`")
FILE_RE = re.compile(r"^((?:[\w.-]+/)*)(test_\w+|crash_driver|scenarios)\.(py|cc)(?:::(\S+))?$")
FUNC_RE = re.compile(r"^(?:::)?(test_\w*\*?\w*|[a-z]\w*_\w+\*?)(\[[^\]]*\])?$")


def _find_file(folder: str, name: str):
    if folder:
        p = ROOT / folder / name
        return [p] if p.is_file() else []
    return sorted(TESTS.rglob(name))


def _has_function(files, func: str) -> bool:
    pat = re.compile(r"\b(?:def\s+|TEST\(\s*)" + ".*?".join(map(re.escape, func.split("*"))) + r"\w*\b")
    return any(pat.search(p.read_text()) for p in files)


def test_references(text: str):
    """Problems with the tests `text` names: files that do not exist and
    functions their file does not define."""
    problems, current = [], None
    for tok in TICK_RE.findall(text):
        tok = tok.strip()
        m = FILE_RE.match(tok)
        if m:
            folder, stem, ext, func = m.groups()
            current = _find_file(folder, f"{stem}.{ext}")
            if not current:
                problems.append(f"no file {tok.split('::')[0]}")
            elif func and not _has_function(current, re.sub(r"\[.*\]$", "", func)):
                problems.append(f"{tok}: no such test")
            continue
        m = FUNC_RE.match(tok)
        if m and current and (tok.startswith("::") or tok.startswith("test_")):
            if not _has_function(current, m.group(1)):
                problems.append(f"{current[0].name}{'' if tok.startswith('::') else '::'}{tok}: no such test")
        elif tok.startswith("::"):
            problems.append(f"{tok}: no file before it")
    return problems


test_references.__test__ = False  # a helper, not a test


def _kinds(text: str, word: str):
    """The backticked names after `word` ('kind', 'kinds', 'scenario', ...)."""
    out = []
    for m in re.finditer(rf"\b{word}s?((?:\s*(?:,|and)?\s*`\w+`)+)", text):
        out += re.findall(r"`(\w+)`", m.group(1))
    return out


@pytest.mark.parametrize("f", DOC_FILES, ids=_rel)
def test_named_tests_exist(f):
    text = f.read_text()
    problems = test_references(text)
    driver = (TESTS / "crash" / "crash_driver.py").read_text()
    powerloss = (TESTS / "powerloss" / "test_powerloss.py").read_text()
    problems += [f"crash driver kind {k!r}" for k in _kinds(text, "kind") if f'"{k}"' not in driver]
    problems += [f"power-loss scenario {s!r}" for s in _kinds(text, "scenario") if f'"{s}"' not in powerloss]
    assert not problems, f"{_rel(f)} names tests that do not exist: {problems}"


def test_the_test_reference_check_can_fail():
    ok = "`test_docs.py::test_readme_is_short`, `::test_the_reference_check_can_fail`, `test_docs.py` (`test_named_tests_exist`)"
    assert test_references(ok) == []
    bad = "`test_docs.py::test_no_such_thing`, `::test_nor_this`, `test_no_such_file.py`"
    assert test_references(bad) == ["test_docs.py::test_no_such_thing: no such test",
                                    "test_docs.py::test_nor_this: no such test", "no file test_no_such_file.py"]
    assert _kinds("crash driver kinds `dcp2`, `nope` and `x`", "kind") == ["dcp2", "nope", "x"]


# ---------------------------------------------------------------- (e) links between the docs

LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(f: Path, text: str):
    out = []
    for target in LINK_RE.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (f.parent / target.split("#", 1)[0]).exists():
            out.append(target)
    return out


@pytest.mark.parametrize("f", DOC_FILES, ids=_rel)
def test_links_lead_somewhere(f):
    bad = broken_links(f, f.read_text())
    assert not bad, f"{_rel(f)} links to files that do not exist: {bad}"


def test_the_link_check_can_fail():
    assert broken_links(README, "[a](docs/guide/README.md#x) [b](https://x.org) [c](#s) [d](docs/nothing.md)") == ["docs/nothing.md"]
