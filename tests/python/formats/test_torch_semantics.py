"""fastckpt.save / fastckpt.load follow torch.save / torch.load exactly:
weights_only's rules (default None, TORCH_FORCE_* variables, pickle_module),
the refusal message, every argument torch.save takes, skip_data and
torch.utils.serialization.config.save."""

import errno
import inspect
import io
import pickle
import warnings
import zipfile

import pytest
import torch
import torch.serialization as ts
from torch.utils.serialization import config as torch_config

import fastckpt
from fastckpt import _C

from leaks import temp_files


def _touch(path):
    """A harmless 'command' a checkpoint runs when its pickle is trusted."""
    with open(path, "a"):
        pass
    return "ran"


class Runs:
    """Unpickling this calls _touch(marker): code from the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
FORCE_NO = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
NO_WO_WARNING = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected"


# ---------------------------------------------------------------- item 4: weights_only

def test_weights_only_none_refuses_code_as_torch_does(tmp_path):
    """weights_only=None (torch's default) uses the weights-only unpickler:
    nothing from the file runs, and the refusal starts as torch's does."""
    marker = tmp_path / "ran"
    fastckpt.save({"w": torch.ones(2), "x": Runs(marker)}, tmp_path / "c.pt")
    with pytest.raises(pickle.UnpicklingError) as t:
        torch.load(tmp_path / "c.pt", weights_only=None)
    for kw in ({"weights_only": None}, {}):
        with pytest.raises(pickle.UnpicklingError) as ei:
            fastckpt.load(tmp_path / "c.pt", **kw)
        assert not marker.exists(), "weights_only=None ran code from the file"
        msg = str(ei.value)
        assert msg.startswith("Weights only load failed") and str(t.value).startswith("Weights only load failed")
        assert str(tmp_path / "c.pt") in msg and "_touch" in msg and "add_safe_globals" in msg
    assert fastckpt.load(tmp_path / "c.pt", weights_only=False)["x"] == "ran" and marker.exists()


def _outcome(fn):
    """What a load did: ('ok', ran code?) / ('refused',) / ('RuntimeError',),
    plus how many TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD warnings it gave."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            got = fn()
            res = ("ok", isinstance(got, dict) and got.get("x") == "ran")
        except pickle.UnpicklingError as e:
            assert str(e).startswith("Weights only load failed"), str(e)
            res = ("refused",)
        except RuntimeError as e:
            if "mmap" in str(e):
                raise
            res = ("RuntimeError",)
    return res, sum(NO_WO_WARNING in str(x.message) for x in w)


@pytest.mark.parametrize("kind", ["path", "fileobj", "mmap", "legacy"])
@pytest.mark.parametrize("env", ["", FORCE, FORCE_NO, "both"])
def test_weights_only_rules_match_torch_load(tmp_path, monkeypatch, kind, env):
    """For every combination of weights_only (None/True/False), pickle_module
    (None/pickle) and the TORCH_FORCE_* variables, on every path of
    fastckpt.load, the outcome (loaded, code run, refused, error) and the
    warnings are torch.load's."""
    marker = tmp_path / "ran"
    p = tmp_path / "c.pt"
    torch.save({"w": torch.ones(2), "x": Runs(marker)}, p, _use_new_zipfile_serialization=(kind != "legacy"))
    for var in (FORCE, FORCE_NO):
        monkeypatch.delenv(var, raising=False)
    if env == "both":
        monkeypatch.setenv(FORCE, "1")
        monkeypatch.setenv(FORCE_NO, "true")
    elif env:
        monkeypatch.setenv(env, "1")

    def call(load, wo, pm):
        kw = {} if wo == "unset" else {"weights_only": wo}
        if pm is not None:
            kw["pickle_module"] = pm
        if kind == "mmap":
            kw["mmap"] = True
        if kind == "fileobj":
            with open(p, "rb") as fh:
                return load(io.BytesIO(fh.read()), **kw)
        return load(p, **kw)

    for wo in ("unset", None, True, False):
        for pm in (None, pickle):
            if marker.exists():
                marker.unlink()
            want = _outcome(lambda: call(torch.load, wo, pm))
            torch_ran = marker.exists()
            if marker.exists():
                marker.unlink()
            got = _outcome(lambda: call(fastckpt.load, wo, pm))
            assert got == want, f"weights_only={wo} pickle_module={pm} {env or 'no env'}: {got} != torch's {want}"
            assert marker.exists() == torch_ran


def _mapped(path):
    with open("/proc/self/maps") as fh:
        return str(path) in fh.read()


def test_mmap_none_follows_torch_config(tmp_path):
    """mmap=None (torch's default) reads torch's config.load.mmap: with it set,
    the file is mapped, and a legacy file is refused by both, as torch
    refuses mmap for legacy files."""
    fastckpt.save({"w": torch.ones(2)}, tmp_path / "new.pt")
    with torch_config.patch({"load.mmap": True}):
        got = fastckpt.load(tmp_path / "new.pt")
        assert _mapped(tmp_path / "new.pt") and torch.equal(got["w"], torch.ones(2))
        del got
    assert not _mapped(tmp_path / "new.pt")
    got = fastckpt.load(tmp_path / "new.pt")
    assert not _mapped(tmp_path / "new.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with torch_config.patch({"load.mmap": True}):
        with pytest.raises(RuntimeError, match="mmap"):
            torch.load(tmp_path / "old.pt")
        with pytest.raises(RuntimeError, match="mmap"):
            fastckpt.load(tmp_path / "old.pt")
    assert torch.equal(fastckpt.load(tmp_path / "old.pt")["w"], torch.ones(2))


def test_signatures_cover_torch():
    """Every parameter of torch.save / torch.load is accepted, with torch's default."""
    for ours, theirs in ((fastckpt.save, torch.save), (fastckpt.load, torch.load)):
        mine = inspect.signature(ours).parameters
        for name, p in inspect.signature(theirs).parameters.items():
            if p.kind is p.VAR_KEYWORD:
                assert any(q.kind is q.VAR_KEYWORD for q in mine.values())
                continue
            assert name in mine, f"{ours.__name__} lacks torch's argument {name}"
            assert mine[name].default == p.default or name == "pickle_module", (name, mine[name].default, p.default)


# ---------------------------------------------------------------- item 5: torch.save's arguments

def test_save_accepts_torch_save_keywords(tmp_path):
    sd = {"w": torch.arange(10.0)}
    fastckpt.save(sd, tmp_path / "a.pt", _use_new_zipfile_serialization=True)
    fastckpt.save(sd, tmp_path / "b.pt", _use_new_zipfile_serialization=True, _disable_byteorder_record=False)
    fastckpt.save(sd, tmp_path / "c.pt", pickle, 2, True, True)  # positionally, as torch.save's
    for n in "abc":
        assert torch.equal(torch.load(tmp_path / f"{n}.pt")["w"], sd["w"])
        assert torch.equal(fastckpt.load(tmp_path / f"{n}.pt")["w"], sd["w"])
    names = zipfile.ZipFile(tmp_path / "c.pt").namelist()
    assert not any(n.endswith("/byteorder") for n in names), names
    assert any(n.endswith("/byteorder") for n in zipfile.ZipFile(tmp_path / "b.pt").namelist())


@pytest.mark.parametrize("target", ["path", "fileobj"])
def test_legacy_format_is_written(tmp_path, target):
    """_use_new_zipfile_serialization=False writes torch's legacy format, as torch does."""
    sd = {"w": torch.arange(1000.0), "v": torch.ones(3, dtype=torch.int64), "n": 7}
    if target == "path":
        fastckpt.save(sd, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
        data = (tmp_path / "old.pt").read_bytes()
    else:
        buf = io.BytesIO()
        fastckpt.save(sd, buf, _use_new_zipfile_serialization=False)
        data = buf.getvalue()
        (tmp_path / "old.pt").write_bytes(data)
    ref = io.BytesIO()
    torch.save(sd, ref, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(io.BytesIO(data)) and len(data) == len(ref.getvalue())
    for load in (torch.load, fastckpt.load):
        got = load(tmp_path / "old.pt")
        assert torch.equal(got["w"], sd["w"]) and torch.equal(got["v"], sd["v"]) and got["n"] == 7
    assert temp_files(tmp_path) == []


def test_legacy_format_is_atomic_and_durable(tmp_path):
    """The legacy format goes through the engine's commit: a failed fdatasync
    or a failed pickle leaves the old file and no temporary file."""
    p = tmp_path / "old.pt"
    fastckpt.save({"gen": 1}, p, _use_new_zipfile_serialization=False)
    _C.fault_inject("fsync", nth=1, errno=errno.EIO, path_contains="old.pt")
    with pytest.raises(OSError) as ei:
        fastckpt.save({"gen": 2, "w": torch.ones(100)}, p, _use_new_zipfile_serialization=False)
    assert ei.value.errno == errno.EIO and ei.value.filename == str(p)
    assert _C.fault_fired() >= 1
    _C.fault_clear()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        fastckpt.save({"gen": 3, "w": torch.ones(100), "f": lambda: 0}, p, _use_new_zipfile_serialization=False)
    assert fastckpt.load(p) == {"gen": 1} and temp_files(tmp_path) == []


def _data_records(path):
    return [i for i in zipfile.ZipFile(path).infolist() if "/data/" in i.filename and "serialization_id" not in i.filename]


def test_skip_data_writes_no_storage_bytes(tmp_path):
    """Under torch.serialization.skip_data() the storages' bytes are not
    written (zero-filled, CRC 0), as torch.save does; stock torch.load reads it."""
    sd = {"w": torch.arange(1, 2001, dtype=torch.float32), "b": torch.full((7,), 5, dtype=torch.int16)}
    with ts.skip_data():
        fastckpt.save(sd, tmp_path / "f.pt")
        torch.save(sd, tmp_path / "t.pt")
        buf = io.BytesIO()
        fastckpt.save(sd, buf)
    (tmp_path / "b.pt").write_bytes(buf.getvalue())
    for name in ("f.pt", "b.pt"):
        for load in (torch.load, fastckpt.load):
            got = load(tmp_path / name)
            ref = torch.load(tmp_path / "t.pt")
            for k in sd:
                assert got[k].shape == sd[k].shape and got[k].dtype == sd[k].dtype
                assert torch.equal(got[k], ref[k]) and not got[k].any(), f"{name}: {k} holds data"
        assert [i.CRC for i in _data_records(tmp_path / name)] == [0, 0]
    assert temp_files(tmp_path) == []


def test_skip_data_materializes_fake_tensors(tmp_path):
    """skip_data(materialize_fake_tensors=True) saves a FakeTensor state dict
    (no data), as torch.save does."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = {"w": torch.empty(64, 32), "b": torch.empty(32, dtype=torch.float16)}
    with ts.skip_data(materialize_fake_tensors=True):
        torch.save(fake, tmp_path / "t.pt")
        fastckpt.save(fake, tmp_path / "f.pt")
    for load in (torch.load, fastckpt.load):
        got = load(tmp_path / "f.pt")
        assert got["w"].shape == (64, 32) and got["b"].dtype == torch.float16 and not got["w"].any()
    ref = torch.load(tmp_path / "t.pt")
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_skip_data_refuses_legacy_format(tmp_path):
    with ts.skip_data():
        with pytest.raises(RuntimeError, match="skip_data"):
            torch.save({"w": torch.ones(2)}, tmp_path / "t.pt", _use_new_zipfile_serialization=False)
        with pytest.raises(RuntimeError, match="skip_data"):
            fastckpt.save({"w": torch.ones(2)}, tmp_path / "f.pt", _use_new_zipfile_serialization=False)
    assert not (tmp_path / "f.pt").exists() and temp_files(tmp_path) == []


def test_compute_crc32_false_records_no_checksums(tmp_path):
    """config.save.compute_crc32=False: every record's CRC is 0, as torch's;
    torch.load reads it, and verify=True says there is nothing to verify."""
    sd = {"w": torch.arange(3000.0), "s": "text"}
    with torch_config.patch({"save.compute_crc32": False}):
        fastckpt.save(sd, tmp_path / "f.pt")
        torch.save(sd, tmp_path / "t.pt")
    assert {i.CRC for i in zipfile.ZipFile(tmp_path / "t.pt").infolist()} == {0}
    assert {i.CRC for i in zipfile.ZipFile(tmp_path / "f.pt").infolist()} == {0}
    for load in (torch.load, fastckpt.load):
        assert torch.equal(load(tmp_path / "f.pt")["w"], sd["w"])
    with pytest.raises(fastckpt.FormatError, match="no checksums"):
        fastckpt.load(tmp_path / "f.pt", verify=True)
    fastckpt.save(sd, tmp_path / "g.pt")
    assert all(i.CRC for i in _data_records(tmp_path / "g.pt"))
    assert torch.equal(fastckpt.load(tmp_path / "g.pt", verify=True)["w"], sd["w"])


@pytest.mark.parametrize("alignment", [8192, 65536, 12288])
def test_larger_storage_alignment_is_honoured(tmp_path, alignment):
    """config.save.storage_alignment above 4096: every record starts on a
    multiple of it (and of 4096); stock torch.load, with mmap too, reads it."""
    sd = {f"t{i}": torch.arange(i * 100 + 1, dtype=torch.float32) for i in range(5)}
    with torch_config.patch({"save.storage_alignment": alignment}):
        fastckpt.save(sd, tmp_path / "f.pt")
    z = zipfile.ZipFile(tmp_path / "f.pt")
    recorded = int(z.read(next(n for n in z.namelist() if n.endswith(".storage_alignment"))))
    assert recorded % alignment == 0 and recorded % 4096 == 0
    with open(tmp_path / "f.pt", "rb") as fh:
        for info in _data_records(tmp_path / "f.pt"):
            fh.seek(info.header_offset + 26)
            n, m = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
            assert (info.header_offset + 30 + n + m) % recorded == 0, info.filename
    for kw in ({}, {"mmap": True}):
        for load in (torch.load, fastckpt.load):
            got = load(tmp_path / "f.pt", **kw)
            assert all(torch.equal(got[k], sd[k]) for k in sd)


@pytest.mark.parametrize("alignment", [64, 128, 1024])
def test_small_alignment_packs_small_records(tmp_path, alignment):
    """config.save.storage_alignment below 4096 (64 by default): a file with a
    storage of 64 KiB or more and few small ones has every record on
    lcm(4096, alignment), which .storage_alignment states (torch predicts
    storage offsets from it); a file of small storages keeps torch's value."""
    import math
    sd = {"w": torch.ones(3), "big": torch.ones(1 << 14), "b": torch.ones(5, dtype=torch.int8)}
    small = {f"s{i}": torch.ones(3) for i in range(4)}
    for state, want in ((sd, math.lcm(4096, alignment)), (small, alignment)):
        with torch_config.patch({"save.storage_alignment": alignment}):
            fastckpt.save(state, tmp_path / "f.pt")
        z = zipfile.ZipFile(tmp_path / "f.pt")
        assert z.read(next(n for n in z.namelist() if n.endswith(".storage_alignment"))) == str(want).encode()
        starts = {}
        with open(tmp_path / "f.pt", "rb") as fh:
            for info in z.infolist():
                fh.seek(info.header_offset + 26)
                n, m = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
                starts[info.filename.split("/", 1)[1]] = (info.header_offset + 30 + n + m, info.file_size)
        assert all(off % want == 0 for off, _ in starts.values()), starts
    with torch_config.patch({"save.storage_alignment": alignment}):
        fastckpt.save(sd, tmp_path / "f.pt")
    for kw in ({}, {"mmap": True}):
        for load in (torch.load, fastckpt.load):
            got = load(tmp_path / "f.pt", **kw)
            assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_save_refuses_what_torch_refuses(tmp_path):
    with pytest.raises(AttributeError):
        torch.save({"a": 1}, 42)
    with pytest.raises(AttributeError):
        fastckpt.save({"a": 1}, 42)


@pytest.mark.parametrize("how", ["meta", "skip_data", "fake"])
def test_loads_without_data_read_no_data(tmp_path, how):
    """As torch.load: map_location="meta", skip_data() and a FakeTensorMode
    read no storage bytes (an engine read would hit the injected EIO)."""
    sd = {"w": torch.arange(50000.0), "b": torch.ones(3, dtype=torch.int8)}
    fastckpt.save(sd, tmp_path / "x.pt")
    _C.fault_inject("read", nth=1, errno=errno.EIO, times=0, path_contains="x.pt")
    if how == "meta":
        got = fastckpt.load(tmp_path / "x.pt", map_location="meta")
        assert got["w"].device.type == "meta"
    elif how == "skip_data":
        with ts.skip_data():
            got = fastckpt.load(tmp_path / "x.pt")
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            got = fastckpt.load(tmp_path / "x.pt")
    assert got["w"].shape == (50000,) and got["b"].dtype == torch.int8
    assert _C.fault_fired() == 0
    _C.fault_clear()
    with pytest.raises(OSError):  # the hook is live: a load that reads data hits it
        _C.fault_inject("read", nth=1, errno=errno.EIO, times=0, path_contains="x.pt")
        fastckpt.load(tmp_path / "x.pt")


def test_torch_settings_taken_as_their_defaults_while_torch_s_config_is_not_imported(tmp_path):
    """torch.utils.serialization.config is imported by torch's first save or load (10-15 ms: it parses
    its own source). fastckpt.save, fastckpt.load and async_save in a fresh process leave it unimported
    (no setting can differ from a default then) and write torch's default file; the defaults fastckpt
    assumes are torch's own; once the config is imported, a changed setting is followed (the tests above)."""
    import subprocess
    import sys
    from fastckpt.formats import torch_rules
    for name, value in torch_rules.CONFIG_DEFAULTS.items():
        assert torch_config._config[name].default == value, name  # torch's declared default
    script = f"""
import sys, torch, fastckpt
sd = {{"w": torch.arange(1000.0), "n": 3}}
fastckpt.save(sd, {str(tmp_path / "a.pt")!r})
fastckpt.async_save(sd, {str(tmp_path / "b.pt")!r}).result()
got = fastckpt.load({str(tmp_path / "a.pt")!r})
assert torch.equal(got["w"], sd["w"]) and got["n"] == 3
assert "torch.utils.serialization.config" not in sys.modules, "imported"
from torch.utils.serialization import config
assert config.save.storage_alignment == 64 and config.save.compute_crc32 and not config.load.mmap
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
    # the same file as with the config imported (its defaults): records at 64 (and 4096 for large ones), CRCs
    with zipfile.ZipFile(tmp_path / "a.pt") as z:
        assert z.read(next(n for n in z.namelist() if n.endswith(".storage_alignment"))) in (b"64", b"4096")
        assert all(i.CRC != 0 for i in z.infolist() if "/data/" in i.filename)


def test_element_sizes_are_torchs_for_every_dtype():
    # computed once per dtype and kept: the kept value is still torch's, and the second ask too
    from fastckpt.formats.torch_rules import element_size, itemsize
    dtypes = [d for d in vars(torch).values() if isinstance(d, torch.dtype)]
    assert len(dtypes) > 20
    for d in dtypes:
        try:
            want = torch.empty((), dtype=d).element_size()
        except Exception as e:  # noqa: BLE001 - a dtype torch makes no tensor of: raised as torch raises
            with pytest.raises(type(e)):
                itemsize(d)
            continue
        assert itemsize(d) == want and itemsize(d) == want, d
        try:
            want = torch._utils._element_size(d)
        except Exception as e:  # noqa: BLE001 - torch's serialization cannot size it either
            with pytest.raises(type(e)):
                element_size(d)
            continue
        assert element_size(d) == want and element_size(d) == want, d
