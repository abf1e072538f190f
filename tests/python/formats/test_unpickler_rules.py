"""The rules of fastckpt's pickle reading are torch's.

- ``fastckpt.load`` (weights-only) loads exactly what ``torch.load`` loads with
  the globals the user allowed (``torch.serialization.add_safe_globals`` and the
  ``safe_globals`` context): module-level classes, nested classes (pickled
  through ``getattr`` at torch.save's protocol 2), ``zoneinfo.ZoneInfo``; the
  safety walk run first only bounds memory and nesting and never refuses what
  torch's unpickler would decide.
- A refusal is torch's message (the blocked global, how to allow it), with
  the user's path added.
- FastReader reads DCP ``.metadata`` that names the classes older torch releases
  wrote (``torch.distributed._shard.sharded_tensor.metadata.TensorProperties``),
  as stock DCP does, and refuses anything outside its allow-list without
  running it.
"""
import os
import pickle
import re
import zoneinfo

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.serialization as ts

import fastckpt
from fastckpt.dcp import FastReader
from fastckpt.formats import unpickler as _unpickle


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is type(self) and vars(other) == vars(self)


class Outer:
    class Inner:
        def __init__(self, v):
            self.v = v

        def __eq__(self, other):
            return type(other) is type(self) and vars(other) == vars(self)


PARIS = zoneinfo.ZoneInfo("Europe/Paris")

# (name, object saved, globals allowed): torch.load decides each; fastckpt.load must agree.
CASES = [
    ("point", {"p": Point(1, 2.5), "w": torch.ones(3)}, [Point]),
    ("point-unallowed", {"p": Point(1, 2.5)}, []),
    ("nested", {"i": Outer.Inner(3), "w": torch.arange(4)}, [getattr, Outer, Outer.Inner]),
    ("nested-only-inner", {"i": Outer.Inner(3)}, [Outer.Inner]),
    ("nested-no-getattr", {"i": Outer.Inner(3)}, [Outer, Outer.Inner]),
    ("zoneinfo", {"tz": PARIS, "w": torch.ones(2)}, [getattr, zoneinfo.ZoneInfo, zoneinfo.ZoneInfo._unpickle]),
    ("zoneinfo-class-only", {"tz": PARIS}, [zoneinfo.ZoneInfo]),
    ("zoneinfo-no-unpickle", {"tz": PARIS}, [getattr, zoneinfo.ZoneInfo]),
    ("getattr-by-name", {"i": Outer.Inner(7)}, [(getattr, "builtins.getattr"), Outer, Outer.Inner]),
]
LOADABLE = {"point", "nested", "zoneinfo", "getattr-by-name"}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _outcome(fn):
    try:
        return "ok", fn()
    except pickle.UnpicklingError as e:
        return "refused", str(e)


def _without_path(msg: str, path: str) -> str:
    """fastckpt's refusal with what it adds to torch's (the path, nothing run) taken out."""
    return msg.replace(f" fastckpt.load({path!r}): nothing from the file was run.", "", 1)


@pytest.mark.parametrize("how", ["add_safe_globals", "safe_globals"])
@pytest.mark.parametrize("name,obj,allowed", CASES, ids=[c[0] for c in CASES])
def test_load_decides_as_torch_load(tmp_path, name, obj, allowed, how):
    path = str(tmp_path / f"{name}.pt")
    torch.save(obj, path)
    saved = ts.get_safe_globals()

    def under_rules(fn):
        if how == "safe_globals":
            with ts.safe_globals(allowed):
                return _outcome(fn)
        ts.add_safe_globals(allowed)
        try:
            return _outcome(fn)
        finally:
            ts.clear_safe_globals()
            ts.add_safe_globals(saved)

    want = under_rules(lambda: torch.load(path))
    got = under_rules(lambda: fastckpt.load(path))
    assert want[0] == ("ok" if name in LOADABLE else "refused"), want  # the case tests what it says
    assert got[0] == want[0], got[1]
    if want[0] == "ok":
        assert _same(got[1], want[1]) and _same(got[1], obj)
        # and the same through the paths that hand the file to torch.load (a file object, mmap)
        with open(path, "rb") as f:
            assert _same(under_rules(lambda: fastckpt.load(f))[1], obj)
        assert _same(under_rules(lambda: fastckpt.load(path, mmap=True))[1], obj)
    else:
        assert _without_path(got[1], path) == want[1]


def test_refusal_names_the_blocked_global_in_torchs_words(tmp_path):
    path = str(tmp_path / "n.pt")
    torch.save({"i": Outer.Inner(1)}, path)
    with ts.safe_globals([Outer.Inner]):
        with pytest.raises(pickle.UnpicklingError) as ei:
            fastckpt.load(path)
    msg = str(ei.value)
    assert msg.startswith("Weights only load failed.")
    assert path in msg
    assert ("Unsupported global: GLOBAL getattr was not an allowed global by default. Please use "
            "`torch.serialization.add_safe_globals([getattr])` or the `torch.serialization.safe_globals([getattr])` "
            "context manager to allowlist this global if you trust this class/function.") in msg
    path2 = str(tmp_path / "p.pt")
    torch.save({"p": Point(1, 2)}, path2)
    with pytest.raises(pickle.UnpicklingError) as ei:
        fastckpt.load(path2)
    full = f"{Point.__module__}.Point"
    assert f"GLOBAL {full} was not an allowed global by default" in str(ei.value)
    assert f"torch.serialization.add_safe_globals([{full}])" in str(ei.value) and path2 in str(ei.value)


def test_walk_refusal_before_torch_says_what_and_where(tmp_path):
    """A pickle the walk refuses itself (an opcode torch.save never writes)
    still gets torch's opening and the path, and no request to file an issue."""
    import zipfile
    path = str(tmp_path / "c.pt")
    torch.save({"w": torch.ones(1)}, path)
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        recs = {n: z.read(n) for n in names}
    pkl = [n for n in names if n.endswith("/data.pkl")][0]
    recs[pkl] = b"\x80\x02(c" + b"builtins\nlist\n" + b"o."  # OBJ: protocol 1 instantiation
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n in names:
            z.writestr(n, recs[n])
    with pytest.raises(pickle.UnpicklingError) as ei:
        fastckpt.load(path)
    msg = str(ei.value)
    assert msg.startswith("Weights only load failed.") and path in msg and "OBJ" in msg
    assert "file an issue" not in msg


# ---------------------------------------------------------------- the walk before torch's unpickler

def test_walk_accepts_calls_of_what_getattr_returned():
    """torch's unpickler decides which callables are allowed (by value), so the
    walk before it accepts calls of constructed objects (getattr's results);
    the restricted unpickler's walk still refuses them."""
    data = pickle.dumps({"i": Outer.Inner(1), "tz": PARIS}, protocol=2)
    assert _unpickle.check(data, "x") == _unpickle.check_reference(data, "x")
    with pytest.raises(_unpickle.Refused, match="calls a constructed object"):
        _unpickle.loads(data, "x", lambda m, n: getattr if n == "getattr" else None)


# ---------------------------------------------------------------- DCP metadata of older torch releases

def _legacy_metadata(d):
    """`d`/.metadata rewritten as older torch releases wrote it: TensorProperties
    (and its MEM_FORMAT_ENCODING) from torch.distributed._shard.sharded_tensor.metadata."""
    from torch.distributed._shard.sharded_tensor import metadata as old
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = FastReader(d).read_metadata()
    for v in md.state_dict_metadata.values():
        if isinstance(v, TensorStorageMetadata):
            p = v.properties
            v.properties = old.TensorProperties(dtype=p.dtype, layout=p.layout, requires_grad=p.requires_grad,
                                                memory_format=p.memory_format, pin_memory=p.pin_memory)
    md.storage_meta = None  # releases before StorageMeta
    data = pickle.dumps(md)
    assert b"torch.distributed._shard.sharded_tensor.metadata" in data and b"MEM_FORMAT_ENCODING" in data
    with open(os.path.join(d, ".metadata"), "wb") as f:
        f.write(data)


def test_fastreader_reads_metadata_of_older_releases_as_stock_dcp(tmp_path):
    d = str(tmp_path / "ck")
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16), "n": 3}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(d))
    _legacy_metadata(d)
    stock = {"w": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "n": 0}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(d))
    fast = {"w": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "n": 0}
    dcp.load(fast, storage_reader=FastReader(d))
    assert _same(stock, state) and _same(fast, state)


class _RunsOnLoad:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_fastreader_refuses_what_it_does_not_allow_without_running_it(tmp_path):
    d = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(d))
    md = FastReader(d).read_metadata()
    marker = str(tmp_path / "ran")
    md.planner_data = {"x": _RunsOnLoad(marker)}
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(pickle.UnpicklingError, match=r"global (io|builtins)\.open is not a DCP metadata class") as ei:
        FastReader(d).read_metadata()
    assert d in str(ei.value) and not os.path.exists(marker)


def test_fastreader_takes_classes_the_user_allowed_but_not_functions(tmp_path):
    """add_safe_globals extends the .metadata allow-list with classes (a nested
    one too, named as torch names it); a function allowed for torch.load
    (getattr) is not taken for .metadata, where no per-object check follows."""
    d = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(d))
    md = FastReader(d).read_metadata()
    md.planner_data = {"p": Point(1, 2), "i": Outer.Inner(5)}
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(pickle.UnpicklingError, match=re.escape(f"{__name__}.Point is not a DCP metadata class")):
        FastReader(d).read_metadata()
    with ts.safe_globals([Point, Outer.Inner]):
        got = FastReader(d).read_metadata()
    assert got.planner_data == {"p": Point(1, 2), "i": Outer.Inner(5)}
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f, protocol=2)  # Outer.Inner through getattr
    with ts.safe_globals([getattr, Point, Outer, Outer.Inner]):  # the walk refuses the call first
        with pytest.raises(pickle.UnpicklingError, match="NEWOBJ calls a constructed object"):
            FastReader(d).read_metadata()
    md.planner_data = {"g": getattr}  # getattr itself, as a value
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with ts.safe_globals([getattr]):
        with pytest.raises(pickle.UnpicklingError, match=r"global builtins\.getattr is allowed by "
                           r"torch\.serialization\.add_safe_globals but is not a class") as ei:
            FastReader(d).read_metadata()
    assert d in str(ei.value)


def test_fastreader_value_refusal_names_the_global_in_torchs_words(tmp_path):
    from fastckpt.dcp import FastWriter
    from torch.distributed.checkpoint.api import CheckpointException
    d = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(2), "p": Point(1, 2)}, storage_writer=FastWriter(d))
    target = {"w": torch.zeros(2), "p": None}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(target, storage_reader=FastReader(d))
    full = f"{Point.__module__}.Point"
    msg = str(ei.value)
    assert f"GLOBAL {full} was not an allowed global by default" in msg, msg
    assert f"torch.serialization.add_safe_globals([{full}])" in msg and d in msg
    with ts.safe_globals([Point]):
        target = {"w": torch.zeros(2), "p": None}
        dcp.load(target, storage_reader=FastReader(d))
    assert target["p"] == Point(1, 2)
