"""Hostile files and unreadable paths.

- No pickle fastckpt reads outside torch's own weights_only path runs code:
  DCP ``.metadata`` whose pickle reduces to os.system / subprocess /
  builtins.eval / a file-writing callable, through FastReader (+ dcp.load) and
  through ``fastckpt inspect`` / ``verify`` / ``convert``; non-tensor DCP
  values (BYTE_IO records), which torch's DefaultLoadPlanner unpickles with
  ``weights_only=False``, are refused by FastReader(weights_only=True), the
  default. The marker file such a pickle would create must not exist.
- Crafted pickles (a 9-byte LONG_BINPUT, huge declared sizes, deep nesting,
  allocation amplifiers) as ``.metadata`` and as a DCP record's ``data.pkl``
  are refused with fastckpt.FormatError, quickly, and the peak RSS of each
  input, measured alone in a subprocess (VmHWM reset before it), stays small.
- ``fastckpt inspect`` of a path behind a directory this user may not enter
  says "permission denied" with the path, never "no such file".
"""
import ctypes
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

import fastckpt
from fastckpt.cli import main

import hostile_pickles as H

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)

from fastckpt.dcp import FastReader, FastWriter  # noqa: E402
import fastspawn  # noqa: E402
from paths import ROOT, SUPPORT  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

REPO = str(ROOT)
TESTS_PATH = [os.path.dirname(os.path.abspath(__file__)), str(SUPPORT)]  # for the scripts that import this module
NOTHING_RUN = "nothing from the file was run"
# The per-input memory bound: a small multiple of the input's size, plus what
# opening and refusing anything costs (well under this; the attacks below ask
# for 512 MiB .. 1 TiB).
RATIO, SLACK = 64, 48 << 20


def _env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _write_dcp(d, state=None):
    dcp.save(state if state is not None else {"w": torch.arange(6.0), "n": 3}, storage_writer=FastWriter(d))


def _run_cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- no code runs

ATTACKS = sorted(H.code_attacks("/nonexistent").keys())


def test_the_attacks_are_real(tmp_path):
    """Unpickled by a plain unpickler, every attack pickle creates its marker
    (else the tests below would prove nothing)."""
    for name in ATTACKS:
        marker = tmp_path / f"m-{name}"
        data = H.code_attacks(str(marker))[name]
        fastspawn.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                       input=data, capture_output=True)
        assert marker.exists(), name


@pytest.mark.parametrize("name", ATTACKS)
def test_restricted_unpickler_runs_no_code(tmp_path, name):
    from fastckpt.formats import unpickler as _unpickle
    marker = tmp_path / "pwned"
    data = H.code_attacks(str(marker))[name]
    with pytest.raises(pickle.UnpicklingError) as ei:
        _unpickle.loads(data, "/ckpt/.metadata", _unpickle.dcp_metadata_class)
    assert isinstance(ei.value, _unpickle.Refused)
    msg = str(ei.value)
    assert msg.startswith("/ckpt/.metadata: refused to unpickle: global ") and NOTHING_RUN in msg, msg
    assert "is not a DCP metadata class" in msg
    assert not marker.exists()


@pytest.mark.parametrize("name", ATTACKS)
def test_fastreader_metadata_runs_no_code(tmp_path, name):
    d = tmp_path / "ck"
    _write_dcp(d)
    marker = tmp_path / "pwned"
    (d / ".metadata").write_bytes(H.code_attacks(str(marker))[name])
    with pytest.raises(pickle.UnpicklingError) as ei:
        FastReader(d).read_metadata()
    assert str(d / ".metadata") in str(ei.value) and NOTHING_RUN in str(ei.value)
    assert not marker.exists()
    with pytest.raises(CheckpointException) as ei:  # dcp.load wraps FastReader's exception
        dcp.load({"w": torch.zeros(6), "n": 0}, storage_reader=FastReader(d))
    assert "is not a DCP metadata class" in str(ei.value)
    assert not marker.exists()


@pytest.mark.parametrize("cmd", ["inspect", "verify", "convert"])
def test_command_metadata_runs_no_code(tmp_path, capsys, cmd):
    d = tmp_path / "ck"
    _write_dcp(d)
    marker = tmp_path / "pwned"
    for name, data in H.code_attacks(str(marker)).items():
        (d / ".metadata").write_bytes(data)
        argv = [cmd, d] + ([tmp_path / "out.pt"] if cmd == "convert" else [])
        rc, out, err = _run_cli(capsys, *argv)
        text = out if cmd == "verify" else err
        assert rc == 1, (name, out, err)
        assert str(d / ".metadata") in text and NOTHING_RUN in text and "Traceback" not in err, (name, text)
        assert not marker.exists(), name
    assert not (tmp_path / "out.pt").exists()


class _Evil:
    """A non-tensor value whose unpickling would create the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_fastreader_refuses_code_in_values(tmp_path):
    """DCP stores non-tensor values as torch.save records that torch's
    DefaultLoadPlanner unpickles with weights_only=False: FastReader checks them
    with the weights-only unpickler first (weights_only=True, the default)."""
    d = tmp_path / "ck"
    marker = tmp_path / "pwned"
    _write_dcp(d, {"w": torch.arange(4.0), "x": _Evil(marker), "ok": {"lr": 0.1}})
    assert not marker.exists()
    target = {"w": torch.zeros(4), "x": None, "ok": {"lr": 0.0}}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(target, storage_reader=FastReader(d))
    assert "Weights only load failed" in str(ei.value) and "Nothing from the checkpoint was run" in str(ei.value)
    assert str(d) in str(ei.value)
    assert not marker.exists()
    # the stock behaviour, for a checkpoint one trusts
    target = {"w": torch.zeros(4), "x": None, "ok": {"lr": 0.0}}
    dcp.load(target, storage_reader=FastReader(d, weights_only=False))
    assert marker.exists() and target["ok"] == {"lr": 0.1} and torch.equal(target["w"], torch.arange(4.0))


def test_fastreader_values_that_weights_only_accepts_load(tmp_path):
    d = tmp_path / "ck"
    state = {"w": torch.arange(4.0), "meta": {"step": 3, "name": "x", "betas": (0.9, 0.99), "t": torch.ones(2)}}
    _write_dcp(d, state)
    target = {"w": torch.zeros(4), "meta": {"step": 0, "name": "", "betas": (0, 0), "t": torch.zeros(2)}}
    dcp.load(target, storage_reader=FastReader(d))
    assert target["meta"]["step"] == 3 and target["meta"]["betas"] == (0.9, 0.99)
    assert torch.equal(target["meta"]["t"], torch.ones(2)) and torch.equal(target["w"], torch.arange(4.0))


# ---------------------------------------------------------------- the walk accepts what DCP writes

def _big_metadata(tensors=600, chunks=4):
    import pathlib
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
    sdm, sd, pd = {}, {}, {}
    for i in range(tensors):
        fqn = f"model.layers.{i // 10}.mlp.w{i % 10}.weight"
        cs = [ChunkStorageMetadata(torch.Size([k * 64, 0]), torch.Size([64, 512])) for k in range(chunks)]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([64 * chunks, 512]), cs)
        for k, c in enumerate(cs):
            sd[MetadataIndex(fqn, c.offsets)] = _StorageInfo(f"__{k}_0.distcp", i * 100000, 99999)
        pd[fqn] = tuple(fqn.split("."))
    for i in range(50):
        sdm[f"opt.{i}.step"] = BytesStorageMetadata()
        sd[MetadataIndex(f"opt.{i}.step")] = _StorageInfo("__0_0.distcp", 1, 2)
    return Metadata(sdm, pd, sd, StorageMeta(pathlib.Path("/x/y"), "abc"))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_real_metadata_passes_the_walk(protocol):
    from fastckpt.formats import unpickler as _unpickle
    md = _big_metadata()
    data = pickle.dumps(md, protocol=protocol)
    cost = _unpickle._walk(data, "x", _unpickle.dcp_metadata_class, False)
    assert cost < _unpickle.MAX_RATIO * len(data) / 2, cost / len(data)  # a wide margin below the refusal
    assert _unpickle.loads(data, "x", _unpickle.dcp_metadata_class) == md


def test_user_safe_globals_are_allowed_in_metadata():
    import torch.serialization as ts
    from fastckpt.formats import unpickler as _unpickle

    md = _big_metadata(2, 1)
    md.planner_data = {"k": fastckpt.FormatError("x")}  # a class DCP metadata does not use
    data = pickle.dumps(md)
    with pytest.raises(_unpickle.Refused, match="fastckpt.errors.FormatError is not a DCP metadata class"):
        _unpickle.loads(data, "x", _unpickle.dcp_metadata_class)
    with ts.safe_globals([fastckpt.FormatError]):
        got = _unpickle.loads(data, "x", _unpickle.dcp_metadata_class)
    assert isinstance(got.planner_data["k"], fastckpt.FormatError)


# ---------------------------------------------------------------- crafted sizes, per input, in a subprocess

_record_ckpt = H.record_ckpt


def _load_staged(d, target):
    """dcp.load without a process group, stage by stage (FastReader's exceptions arrive unwrapped)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    reader = FastReader(d)
    md = reader.read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, md, True)
    plan = planner.create_local_plan()
    reader.set_up_storage_reader(md, True)
    plan = reader.prepare_global_plan(planner.create_global_plan([reader.prepare_local_plan(plan)]))[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()
    return reader


def test_record_builder_takes_the_fast_path(tmp_path):
    from fastckpt.formats import dcp as _blob
    d = tmp_path / "ck"
    _record_ckpt(d, _blob.tensor_pickle(torch.float32, (3,)))
    target = {"w": torch.zeros(3)}
    reader = _load_staged(d, target)
    assert torch.equal(target["w"], torch.arange(3.0)) and reader.last_read_stats["fast"] == 1


_SCRIPT = """
import contextlib, io, os, sys, json, warnings
warnings.simplefilter("ignore")
import torch
sys.path[:0] = {tests!r}  # this module's folder and tests/support
import test_hostile as T
from fastckpt.cli import main
import hostile_pickles as H

def one(kind, d):
    if kind == "fastreader":
        T.FastReader(d).read_metadata()
    elif kind == "record":
        T._load_staged(d, {{"w": torch.zeros(3)}})
    else:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            rc = main([kind, d])
        raise RuntimeError(f"rc={{rc}} {{err.getvalue()}}")

def status(k):
    for line in open("/proc/self/status"):
        if line.startswith(k + ":"):
            return int(line.split()[1]) * 1024

try:
    one({kind!r}, {warm!r})  # imports and first-use caches, not counted
except RuntimeError:
    pass
for d in {dirs!r}:
    open("/proc/self/clear_refs", "w").write("5")
    base = status("VmRSS")
    try:
        one({kind!r}, d)
        err, msg = None, ""
    except BaseException as e:
        err, msg = type(e).__name__, str(e)
    print(json.dumps({{"dir": d, "error": err, "message": msg, "grown": status("VmHWM") - base}}), flush=True)
"""

CRAFTED = {**H.SIZE_ATTACKS, **H.AMPLIFIERS}


@pytest.fixture(scope="module")
def crafted_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("crafted")
    out = {"metadata": {}, "record": {}}
    for name, data in CRAFTED.items():
        d = base / f"md-{name}"
        _write_dcp(d)
        (d / ".metadata").write_bytes(data)
        out["metadata"][name] = str(d)
        d = base / f"rec-{name}"
        _record_ckpt(d, data)
        out["record"][name] = str(d)
    warm = base / "warm"
    _write_dcp(warm)
    out["warm"] = str(warm)
    from fastckpt.formats import dcp as _blob
    _record_ckpt(base / "warm-record", _blob.tensor_pickle(torch.float32, (3,)))
    out["warm-record"] = str(base / "warm-record")
    return out


def _run_crafted(kind, dirs, warm):
    if not H.rss_oracle_available():
        pytest.skip("needs /proc/self/status and a writable /proc/self/clear_refs (Linux >= 4.0) to measure "
                    "the peak RSS of each input")
    code = _SCRIPT.format(tests=TESTS_PATH, kind=kind, warm=warm,
                          dirs=list(dirs.values()))
    r = fastspawn.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=600)
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == len(dirs), (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    return {name: row for name, row in zip(dirs, rows)}


def _bound(path) -> int:
    return RATIO * H.file_size(path) + SLACK


@pytest.mark.parametrize("kind", ["fastreader", "inspect", "verify"])
def test_crafted_metadata_is_refused_in_small_memory(crafted_dirs, kind):
    """A crafted .metadata (9-byte LONG_BINPUT, huge declared sizes, deep nesting,
    amplifiers) is refused with FormatError, each input in little memory (the
    command's reader allocated > 512 MiB for the 9-byte one)."""
    dirs = crafted_dirs["metadata"]
    got = _run_crafted(kind, dirs, crafted_dirs["warm"])
    problems = []
    for name, row in got.items():
        p = os.path.join(dirs[name], ".metadata")
        # deep_lists (nested through the memo, not refused by the walk) is refused as "not DCP metadata"
        said = p in row["message"] and (NOTHING_RUN in row["message"] or name == "deep_lists")
        if kind == "fastreader":
            ok = row["error"] == "FormatError" and said
        else:
            ok = ("rc=1" in row["message"] and said
                  and (kind == "verify" or "damaged or not a checkpoint" in row["message"]))
        if not ok:
            problems.append(f"{name}: {row['error']}: {row['message'][:300]}")
        if row["grown"] > _bound(p):
            problems.append(f"{name}: peak RSS grew by {row['grown'] >> 20} MiB for a {os.path.getsize(p)}-byte file")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", ["record", "verify"])
def test_crafted_record_pickle_is_refused_in_small_memory(crafted_dirs, kind):
    """The same pickles as the data.pkl of a DCP tensor record (CRCs correct), read
    by FastReader's fast path, which unpickled it without a memo guard."""
    dirs = crafted_dirs["record"]
    got = _run_crafted(kind, dirs, crafted_dirs["warm-record"])
    problems = []
    for name, row in got.items():
        where = os.path.join(dirs[name], "__0_0.distcp")
        # refused by the walk (data.pkl: ...), or, for what the fast path leaves to torch.load
        # (a global it does not know, such as builtins.set), by torch's weights-only unpickler
        said = where in row["message"] and ("data.pkl" in row["message"]
                                            or "Weights only load failed" in row["message"])
        ok = said and (row["error"] == "FormatError" if kind == "record" else "rc=1" in row["message"])
        if not ok:
            problems.append(f"{name}: {row['error']}: {row['message'][:300]}")
        if row["grown"] > _bound(dirs[name]):
            problems.append(f"{name}: peak RSS grew by {row['grown'] >> 20} MiB for a "
                            f"{H.file_size(dirs[name])}-byte checkpoint")
    assert not problems, "\n".join(problems)


_DEEP_SCRIPT = """
import sys, warnings
warnings.simplefilter("ignore")
import torch
sys.path[:0] = {tests!r}  # this module's folder and tests/support
import test_hostile as T
try:
    T._load_staged({d!r}, {target})
    print("loaded")
except Exception as e:
    print(type(e).__name__, str(e)[:500])
"""


@pytest.mark.parametrize("where", ["value", "fallback-record"])
def test_deep_nesting_for_torch_unpickler_is_refused_not_a_crash(tmp_path, where):
    """A 1 MB data.pkl whose dict key is a tuple nested a million deep: torch's
    weights-only unpickler hashes it and overflows the C stack (SIGSEGV). FastReader
    hands it such pickles for non-tensor values (its weights-only check) and for
    tensor records its fast path leaves to torch.load (here: one with a global
    the fast path does not know): it walks them first."""
    deep = b"\x85" * 1_000_000
    if where == "value":
        H.value_ckpt(tmp_path / "ck", H.PROTO2 + b"}" + b"N" + deep + b"N" + b"s" + b".")
        target = '{"x": None}'
    else:
        H.record_ckpt(tmp_path / "ck", H.PROTO2 + b"cbuiltins\nset\n0" + b"}" + b"N" + deep + b"N" + b"s" + b".")
        target = '{"w": torch.zeros(3)}'
    code = _DEEP_SCRIPT.format(tests=TESTS_PATH, d=str(tmp_path / "ck"),
                               target=target)
    r = fastspawn.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("FormatError") and re.search(r"nested more than \d+ deep", r.stdout), r.stdout
    assert str(tmp_path / "ck") in r.stdout


# ---------------------------------------------------------------- permission problems are not "no such file"

def _drop_dac():
    """In the child: give up CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so that
    root obeys permission bits as any user does."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone from the exec'd program
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _as_unprivileged(argv):
    kw = {}
    if os.geteuid() == 0:
        try:
            subprocess.run(["true"], preexec_fn=_drop_dac, check=True)
        except (OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"running as root and cannot drop CAP_DAC_OVERRIDE ({e}): permission bits do not apply")
        kw["preexec_fn"] = _drop_dac
    return fastspawn.run([sys.executable, "-m", "fastckpt"] + [str(a) for a in argv], capture_output=True,
                          text=True, env=_env(), **kw)


@pytest.fixture
def locked(tmp_path):
    """tmp_path/locked (mode 000) holding a DCP checkpoint ck and a file x.pt;
    tmp_path/open/ck: a checkpoint directory (mode 000) in a readable one."""
    _write_dcp(tmp_path / "locked" / "ck")
    fastckpt.save({"w": torch.ones(2)}, tmp_path / "locked" / "x.pt")
    _write_dcp(tmp_path / "open" / "ck")
    os.chmod(tmp_path / "open" / "ck", 0)
    os.chmod(tmp_path / "locked", 0)
    yield tmp_path
    os.chmod(tmp_path / "locked", 0o755)
    os.chmod(tmp_path / "open" / "ck", 0o755)


@pytest.mark.parametrize("cmd", ["inspect", "verify", "convert"])
def test_unreadable_directory_is_not_reported_missing(locked, cmd):
    for target, blocked in [(locked / "locked" / "ck", locked / "locked"),
                            (locked / "locked" / "x.pt", locked / "locked"),
                            (locked / "open" / "ck", None)]:
        argv = [cmd, target] + ([locked / "out.pt"] if cmd == "convert" else [])
        r = _as_unprivileged(argv)
        text = r.stdout + r.stderr
        assert r.returncode == 1, (target, r.returncode, text)
        assert "no such file" not in text.lower() and "does not exist" not in text, (target, text)
        assert "Permission denied" in text or "permission denied" in text, (target, text)
        assert str(target) in text, (target, text)
        if blocked is not None:
            assert f"may not look into directory {blocked}" in text, (target, text)
        assert "Traceback" not in text


_DEEP_LOAD_SCRIPT = """
import io, sys, pickle
sys.path[:0] = {tests!r}  # this module's folder and tests/support
import fastckpt
path = {path!r}
how = {how!r}
try:
    if how == "path":
        fastckpt.load(path)
    elif how == "fileobj":
        with open(path, "rb") as fh:
            fastckpt.load(io.BytesIO(fh.read()))
    else:
        fastckpt.load(path, mmap=True)
    print("LOADED")
except Exception as e:
    print(type(e).__name__, str(e)[:500])
"""


@pytest.mark.parametrize("how", ["path", "fileobj", "mmap"])
def test_deep_nesting_in_a_torch_save_file_is_refused_not_a_crash(tmp_path, how):
    """The same million-deep tuple key as the data.pkl of a plain .pt file: torch's
    weights-only unpickler (torch.load, and fastckpt.load before the walk) dies of
    SIGSEGV; fastckpt.load refuses it on every path (engine read, file object and
    mmap=True, the last two handed to torch.load after the check)."""
    path = tmp_path / "deep.pt"
    path.write_bytes(H.record(H.deep_tuple_key(1_000_000)))
    code = _DEEP_LOAD_SCRIPT.format(tests=TESTS_PATH, path=str(path), how=how)
    r = fastspawn.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("FormatError") and re.search(r"nested more than \d+ deep", r.stdout), r.stdout
    assert "data.pkl" in r.stdout, r.stdout
