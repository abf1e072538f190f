"""Fuzzing fastckpt.dcp.FastReader with damaged checkpoints (short run;
FASTCKPT_FUZZ_EXAMPLES raises the count for the long run, as in
test_fuzz_load.py).

A small DCP checkpoint is written once (by FastWriter, and by the stock
FileSystemWriter, whose layout FastReader also reads). Each example damages a
copy of it: its data files (truncation, bit flips, overwritten length and
offset fields, inserted or deleted bytes) or its ``.metadata`` (the pickle's
bytes, or the storage table: offsets, lengths, huge sizes, relative paths that
leave the directory or name a symlink, a FIFO, a directory, wrong types), and
loads it the way ``dcp.load`` does without a process group, stage by stage.

Besides these mutations, crafted structures (tests/support/hostile_pickles.py):
whole ``.metadata`` files and DCP records' ``data.pkl`` built to allocate
(a 9-byte LONG_BINPUT, huge declared sizes and counts, deep nesting,
amplifiers) or to run code, and the same opcode tricks spliced into valid
pickles at any position.

Every damaged checkpoint must give a clean outcome from FastReader: it loads,
or raises fastckpt.FormatError, an OSError, or pickle.UnpicklingError. Never
another exception, a crash, a hang, code from the file run, or a large
allocation: the peak RSS of each input, measured for that input alone (the
kernel's high-water mark is reset before it through /proc/self/clear_refs;
tracemalloc's peak where that is not possible), must stay below
MEMORY_RATIO times the checkpoint's size plus MEMORY_SLACK (and under
tests/fuzz/run_sanitized.sh ASan aborts on any allocation > 2 GiB). With
verify=True, a checkpoint with a single damaged spot that loads must give back
the original values.

The planner (torch's DefaultLoadPlanner) is not under test: when damaged
``.metadata`` still unpickles into a Metadata that no longer matches the state
dict (a renamed key, another shape), torch's own planner refuses it, with its
own exceptions, before FastReader reads anything; such an example counts as
refused by torch and is checked no further.
"""
import dataclasses
import os
import pickle
import shutil
import struct

import pytest
import torch

import torch.distributed as dist

if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.dcp import FastReader, FastWriter
from fastckpt.formats import dcp as _blob  # noqa: E402

import hostile_pickles as H  # noqa: E402
from paths import DATA  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

EXAMPLES = int(os.environ.get("FASTCKPT_FUZZ_EXAMPLES", "100"))
ALLOWED = (fastckpt.FormatError, OSError, pickle.UnpicklingError)
CORPUS = str(DATA / "fuzz_corpus_dcp")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


def _state():
    return {"w": torch.arange(20000, dtype=torch.float32).reshape(200, 100),  # >= 64 KiB: 4 KiB aligned
            "t": torch.arange(60, dtype=torch.float32).reshape(6, 10),
            "c": torch.arange(9, dtype=torch.float32),
            "b": torch.arange(7, dtype=torch.bfloat16),
            "i": torch.arange(-2, 3, dtype=torch.int64),
            "e": torch.empty(0),
            "meta": {"step": 3, "name": "x"}, "n": 5}


def _target():
    return {"w": torch.zeros(200, 100),
            "t": torch.zeros(10, 6).t(),            # not contiguous: read into a buffer, then copied
            "c": torch.zeros(9, dtype=torch.float64),  # another dtype: read, then cast
            "b": torch.zeros(7, dtype=torch.bfloat16),
            "i": torch.zeros(5, dtype=torch.int64),
            "e": torch.empty(0),
            "meta": {"step": 0, "name": ""}, "n": 0}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a.to(b.dtype), b)
    return type(a) is type(b) and a == b


class Ref:
    """A reference checkpoint (a plain class: hypothesis prints dataclasses field by field)."""

    def __init__(self, files: dict, md):
        self.files = files  # name -> bytes of every file of the checkpoint
        self.md = md        # its .metadata, unpickled

    def __repr__(self):  # hypothesis prints the fixtures of a failing example: keep it short
        return f"Ref({sorted(self.files)})"

    @property
    def data_files(self):
        return sorted(n for n in self.files if n != ".metadata")


def _write_ref(d, writer: str) -> Ref:
    sd = _state()
    w = FastWriter(d, thread_count=2) if writer == "fast" else dcp.FileSystemWriter(d)
    dcp.save(sd, storage_writer=w)
    files = {n: (d / n).read_bytes() for n in os.listdir(d)}
    return Ref(files, pickle.loads(files[".metadata"]))


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dcpfuzzref")
    return {w: _write_ref(base / w, w) for w in ("fast", "stock")}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Where the damaged checkpoints go (see _populate), beside a file outside it
    (a target for damaged relative paths)."""
    base = tmp_path_factory.mktemp("dcpfuzz")
    (base / "outside.distcp").write_bytes(b"PK\x03\x04" + bytes(4096))
    return base / "ck"


_on_disk: dict = {}  # checkpoint directory -> {name: bytes} as last written there


def _populate(ck, files: dict) -> None:
    """Make `ck` hold exactly `files` (plus a symlink out, a FIFO and a
    subdirectory); rewrites only what changed since the last call."""
    state = _on_disk.get(ck)
    if state is None:
        if os.path.lexists(ck):
            shutil.rmtree(ck)
        os.mkdir(ck)
        os.symlink("../outside.distcp", ck / "link.distcp")
        os.mkfifo(ck / "fifo.distcp")
        os.mkdir(ck / "sub")
        state = _on_disk[ck] = {}
    for n in [n for n in state if n not in files]:
        os.unlink(ck / n)
        del state[n]
    for n, data in files.items():
        if state.get(n) != data:
            with open(ck / n, "wb") as f:
                f.write(data)
            state[n] = data


def _load(ck, verify: bool):
    """dcp.load without a process group, stage by stage, so that FastReader's
    exceptions arrive as themselves (dcp.load wraps them). Returns the loaded
    state dict, or None when torch's planner refused the metadata."""
    tgt = _target()
    reader = FastReader(ck, verify=verify)
    md = reader.read_metadata()
    planner = DefaultLoadPlanner()
    try:
        planner.set_up_planner(tgt, md, True)
        plan = planner.create_local_plan()
    except ALLOWED:
        raise
    except Exception:
        return None  # torch's planner refuses a checkpoint that does not match the state dict
    reader.set_up_storage_reader(md, True)
    plan = reader.prepare_local_plan(plan)
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()
    return tgt


# The per-input memory oracle: a load may grow the peak RSS by at most this many
# times the checkpoint's size, plus what loading anything costs (the reference
# is < 100 KiB; the crafted inputs ask for 512 MiB .. 1 TiB).
MEMORY_RATIO, MEMORY_SLACK = 64, 48 << 20


def _check(ck, files: dict, verify: bool, intact: bool = False, target=None, loader=None) -> None:
    """Load the checkpoint made of `files`; only a clean outcome is allowed, and
    no large allocation (the peak RSS of this load alone is bounded by the
    checkpoint's size). `intact`: the damage cannot have gone unnoticed (one
    damaged spot, verify=True), so a successful load must give back the original values."""
    _populate(ck, files)
    size = sum(len(v) for v in files.values())
    got, grown = H.peak_growth(loader or _load, ck, verify, traced=False)
    if isinstance(got, BaseException) and not isinstance(got, ALLOWED):
        raise got
    assert grown <= MEMORY_RATIO * size + MEMORY_SLACK, \
        f"the load of a {size}-byte checkpoint raised the peak RSS by {grown >> 20} MiB (a size taken from the file?)"
    if intact and not isinstance(got, BaseException) and got is not None:
        assert _same(_state(), got), "a damaged checkpoint loaded with verify=True, with wrong values"


# ---------------------------------------------------------------- the reference itself

@pytest.mark.parametrize("writer", ["fast", "stock"])
def test_reference_loads(refs, workdir, writer):
    """The harness loads the undamaged checkpoints correctly (else the fuzzing below proves nothing)."""
    _populate(workdir, refs[writer].files)
    assert _same(_state(), _load(workdir, verify=True))
    assert _same(_state(), _load(workdir, verify=False))


# ---------------------------------------------------------------- data files

def _structure_positions(data: bytes):
    """Offsets of zip signatures: the fields after them are the interesting places to damage."""
    out = []
    for sig in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07", b"PK\x07\x08"):
        i = data.find(sig)
        while i >= 0:
            out.append(i)
            i = data.find(sig, i + 1)
    return sorted(out) or [0]


INTERESTING = {
    "u16": [0, 1, 30, 4096, 0x7FFF, 0xFFFF],
    "u32": [0, 1, 46, 4096, 0x7FFFFFFF, 0xFFFFFFFE, 0xFFFFFFFF, 1 << 30],
    "u64": [0, 1, 1 << 32, 1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1],
}


@st.composite
def _damage(draw, ref: Ref):
    """(file name, [mutations]); a mutation is (kind, position, value)."""
    name = draw(st.sampled_from(ref.data_files))
    data = ref.files[name]
    heads = _structure_positions(data)
    near = st.builds(lambda h, k: h + k, st.sampled_from(heads), st.integers(0, 60))
    pos = st.one_of(near, st.integers(0, len(data) + 8))
    mut = st.one_of(
        st.tuples(st.just("truncate"), pos, st.just(0)),
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("byte"), pos, st.integers(0, 255)),
        st.tuples(st.just("u16"), pos, st.sampled_from(INTERESTING["u16"])),
        st.tuples(st.just("u32"), pos, st.sampled_from(INTERESTING["u32"])),
        st.tuples(st.just("u64"), pos, st.sampled_from(INTERESTING["u64"])),
        st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("delete"), pos, st.integers(1, 64)),
        st.tuples(st.just("append"), st.just(0), st.binary(min_size=1, max_size=256)),
    )
    return name, draw(st.lists(mut, min_size=1, max_size=4))


def _apply(data: bytes, muts) -> bytes:
    buf = bytearray(data)
    for kind, pos, val in muts:
        if kind == "append":
            buf += val
            continue
        if not buf:
            break
        pos %= len(buf)
        if kind == "truncate":
            del buf[pos:]
        elif kind == "flip":
            buf[pos] ^= 1 << val
        elif kind == "byte":
            buf[pos] = val
        elif kind == "insert":
            buf[pos:pos] = val
        elif kind == "delete":
            del buf[pos:pos + val]
        else:
            fmt = {"u16": "<H", "u32": "<I", "u64": "<Q"}[kind]
            n = struct.calcsize(fmt)
            if pos + n <= len(buf):
                buf[pos:pos + n] = struct.pack(fmt, val)
    return bytes(buf)


@FUZZ
@given(data=st.data(), verify=st.booleans())
def test_damaged_data_files_fail_cleanly(refs, workdir, data, verify):
    ref = refs[data.draw(st.sampled_from(["fast", "stock"]))]
    name, muts = data.draw(_damage(ref))
    files = dict(ref.files)
    files[name] = _apply(files[name], muts)
    _check(workdir, files, verify, intact=verify and len(muts) == 1)


# ---------------------------------------------------------------- .metadata: the storage table

INTS = [0, 1, -1, 7, 63, 64, 4096, 1 << 31, 1 << 32, 1 << 40, 1 << 63, 1 << 64, -(1 << 63)]
PATHS = ["", ".", "..", "/", "../outside.distcp", "/etc/passwd", "sub/../__0_0.distcp", "./__0_0.distcp",
         "__0_0.distcp/", "link.distcp", "fifo.distcp", "sub", "missing.distcp", "a\0b", ".metadata",
         "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "//__0_0.distcp", "x" * 5000]
ODD = [None, "0", 1.5, b"0", [], {}, True]


@st.composite
def _table_damage(draw, ref: Ref):
    """A list of (entry index, field, value) edits of .metadata's storage table."""
    n = len(ref.md.storage_data)
    edit = st.one_of(
        st.tuples(st.integers(0, n - 1), st.sampled_from(["offset", "length"]),
                  st.one_of(st.sampled_from(INTS), st.sampled_from(ODD), st.integers(-(1 << 70), 1 << 70))),
        st.tuples(st.integers(0, n - 1), st.sampled_from(["offset", "length"]), st.integers(-300, 300)
                  .map(lambda d: ("delta", d))),
        st.tuples(st.integers(0, n - 1), st.just("relative_path"),
                  st.one_of(st.sampled_from(PATHS), st.sampled_from(ODD), st.text(max_size=20))),
        st.tuples(st.integers(0, n - 1), st.just("transform_descriptors"),
                  st.sampled_from([None, [], ["zstd"], "abc", 5, [None]])),
        st.tuples(st.integers(0, n - 1), st.sampled_from(["drop", "swap", "none"]), st.integers(0, n - 1)),
        st.tuples(st.just(0), st.just("table"), st.sampled_from([None, [], {}, "x"])),
    )
    return draw(st.lists(edit, min_size=1, max_size=3))


def _edit_table(md, edits):
    md = pickle.loads(pickle.dumps(md))  # a deep copy
    keys = list(md.storage_data)
    for i, what, val in edits:
        if not isinstance(md.storage_data, dict) or i >= len(keys) or keys[i] not in md.storage_data:
            continue
        k = keys[i]
        if what == "table":
            md.storage_data = val
        elif what == "drop":
            del md.storage_data[k]
        elif what == "none":
            md.storage_data[k] = None
        elif what == "swap":
            other = keys[val]
            if other in md.storage_data:
                md.storage_data[k], md.storage_data[other] = md.storage_data[other], md.storage_data[k]
        else:
            info = md.storage_data[k]
            if info is None:
                continue
            if isinstance(val, tuple) and val[0] == "delta":
                old = getattr(info, what)
                val = old + val[1] if isinstance(old, int) else val[1]
            md.storage_data[k] = dataclasses.replace(info, **{what: val})
    return md


@FUZZ
@given(data=st.data(), verify=st.booleans())
def test_damaged_storage_table_fails_cleanly(refs, workdir, data, verify):
    ref = refs[data.draw(st.sampled_from(["fast", "stock"]))]
    md = _edit_table(ref.md, data.draw(_table_damage(ref)))
    files = dict(ref.files)
    files[".metadata"] = pickle.dumps(md)
    _check(workdir, files, verify)


# ---------------------------------------------------------------- .metadata: its bytes

@FUZZ
@given(data=st.data(), verify=st.booleans())
def test_damaged_metadata_bytes_fail_cleanly(refs, workdir, data, verify):
    ref = refs[data.draw(st.sampled_from(["fast", "stock"]))]
    raw = ref.files[".metadata"]
    pos = st.integers(0, len(raw) + 8)
    mut = st.one_of(
        st.tuples(st.just("truncate"), pos, st.just(0)),
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("byte"), pos, st.integers(0, 255)),
        st.tuples(st.just("u32"), pos, st.sampled_from(INTERESTING["u32"])),
        st.tuples(st.just("u64"), pos, st.sampled_from(INTERESTING["u64"])),
        st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), pos, st.integers(1, 16)),
    )
    files = dict(ref.files)
    files[".metadata"] = _apply(raw, data.draw(st.lists(mut, min_size=1, max_size=3)))
    _check(workdir, files, verify)


# ---------------------------------------------------------------- crafted structures

def _load_record(ck, verify: bool):
    """Load a checkpoint made by H.record_ckpt (one float32 tensor "w" of 3 elements)."""
    tgt = {"w": torch.zeros(3)}
    reader = FastReader(ck, verify=verify)
    md = reader.read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(tgt, md, True)
    plan = planner.create_local_plan()
    reader.set_up_storage_reader(md, True)
    plan = reader.prepare_global_plan(planner.create_global_plan([reader.prepare_local_plan(plan)]))[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()
    return tgt


def _record_files(pkl: bytes) -> dict:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        H.record_ckpt(d, pkl)
        return _read_dir(d)


@pytest.fixture(scope="module")
def marker(tmp_path_factory):
    return tmp_path_factory.mktemp("marker") / "pwned"


def test_crafted_whole_pickles_fail_cleanly(refs, workdir, marker):
    """Every crafted pickle as .metadata and as a record's data.pkl: a clean
    refusal, little memory, no code run."""
    crafted = {**H.SIZE_ATTACKS, **H.AMPLIFIERS, **H.code_attacks(str(marker))}
    for name, pkl in crafted.items():
        files = dict(refs["fast"].files)
        files[".metadata"] = pkl
        _check(workdir, files, verify=True)
        _check(workdir, _record_files(pkl), verify=True, loader=_load_record)
        assert not marker.exists(), name


@FUZZ
@given(data=st.data(), verify=st.booleans())
def test_crafted_tricks_spliced_into_pickles_fail_cleanly(refs, workdir, marker, data, verify):
    """An opcode trick (huge memo index or counted size, deep nesting, a call of
    os.system / eval, ...) spliced into a valid .metadata or data.pkl."""
    name = data.draw(st.sampled_from(sorted(H.tricks(str(marker)))))
    trick = H.tricks(str(marker))[name]
    if data.draw(st.booleans()):
        ref = refs[data.draw(st.sampled_from(["fast", "stock"]))]
        raw = ref.files[".metadata"]
        at = data.draw(st.integers(0, len(raw)))
        files = dict(ref.files)
        files[".metadata"] = raw[:at] + trick + raw[at:]
        _check(workdir, files, verify)
    else:
        raw = _blob.tensor_pickle(torch.float32, (3,))
        at = data.draw(st.integers(0, len(raw)))
        _check(workdir, _record_files(raw[:at] + trick + raw[at:]), verify, loader=_load_record)
    assert not marker.exists(), name


# ---------------------------------------------------------------- regressions
#
# tests/support/data/fuzz_corpus_dcp/base/ is a checkpoint written by FastWriter from _state();
# every other directory there holds the files of one checkpoint that once broke
# FastReader, minus those it shares with base/.

def _read_dir(d) -> dict:
    files = {}
    for n in sorted(os.listdir(d)):
        with open(os.path.join(d, n), "rb") as f:
            files[n] = f.read()
    return files


def _corpus():
    return sorted(n for n in os.listdir(CORPUS) if n != "base") if os.path.isdir(CORPUS) else []


def test_corpus_base_loads(workdir):
    _populate(workdir, _read_dir(os.path.join(CORPUS, "base")))
    assert _same(_state(), _load(workdir, verify=True))


@pytest.mark.parametrize("name", _corpus())
def test_corpus_regressions(name, workdir):
    """Checkpoints that once broke FastReader stay fixed."""
    files = _read_dir(os.path.join(CORPUS, "base"))
    files.update(_read_dir(os.path.join(CORPUS, name)))
    _check(workdir, files, verify=True)
    _check(workdir, files, verify=False)
