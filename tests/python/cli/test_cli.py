"""The fastckpt command: inspect, verify, convert, doctor, clean-memory (docs/CLI.md).

Most tests call ``fastckpt.cli.main(argv)`` in this process; a few run the
command as a subprocess (``python -m fastckpt`` and the console script) to check
the exit status, stdout/stderr and the bounded memory of a conversion.
Checkpoints are written by independent writers where one exists (torch.save,
safetensors' own save_file, the stock DCP FileSystemWriter) and results are read
back by stock readers (torch.load, safetensors.torch.load_file, dcp.load with
FileSystemReader) as well as by fastckpt.
"""

import collections
import errno
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

import fastckpt
from fastckpt import _C
from fastckpt.formats import zip as _zip
from fastckpt.cli import main

import fastspawn  # noqa: E402
from leaks import temp_files
from engines import uring_refusal
from memory_layout import age, dead_pid, make_namespace, tree
import hostile_pickles as H
from paths import ROOT
import states

REPO = str(ROOT)
VENV_BIN = os.path.dirname(sys.executable)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402

safetensors_torch = pytest.importorskip("safetensors.torch")


def run(capsys, *argv):
    """main(argv) in this process: (exit status, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def cli_env(**extra):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


# ---------------------------------------------------------------- states and comparison

def full_state():
    """What fastckpt/torch.save files hold: nesting, views, tied weights, odd dtypes, non-tensors."""
    torch.manual_seed(0)
    base = torch.randn(6, 8)
    tied = torch.randn(5, 3)
    return {
        "model": collections.OrderedDict([
            ("embed.weight", tied),
            ("head.weight", tied),                       # the same tensor twice (tied weights)
            ("view.t", base[1:5, 2:].t()),               # a non-contiguous view...
            ("view.row", base[2]),                       # ...and another view of the same storage
            ("bf16", torch.randn(4, 4).to(torch.bfloat16)),
            ("half", torch.randn(3).half()),
            ("i64", torch.arange(10)),
            ("i8", torch.tensor([-3, 0, 7], dtype=torch.int8)),
            ("u16", torch.tensor([1, 65535], dtype=torch.uint16)),
            ("mask", torch.tensor([True, False, True])),
            ("scalar", torch.tensor(2.5)),
            ("empty", torch.zeros(0, 4)),
        ]),
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 3)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "name": "all"}]},
        "layers": [torch.ones(2), torch.full((3,), 7, dtype=torch.int32)],
        "step": 100,
        "epoch": 1.5,
        "tag": None,
    }


def dcp_state():
    """What a DCP checkpoint holds (string keys at every level; no empty dicts)."""
    s = full_state()
    s["optim"]["state"] = {"0": s["optim"]["state"][0]}
    return s


def flat_tensors():
    """What safetensors files hold: a flat dict of tensors (no sharing)."""
    torch.manual_seed(1)
    return {"a.weight": torch.randn(4, 5), "a.bias": torch.randn(5).to(torch.bfloat16),
            "ids": torch.arange(7, dtype=torch.int32), "flags": torch.tensor([True, False]),
            "zero_d": torch.tensor(-1.25, dtype=torch.float64), "none": torch.zeros(0), "u8": torch.arange(5).byte()}


def assert_same(a, b, path="root", ordered=True):
    """Nested containers equal, plain values of the same type; dict keys in order unless not `ordered`."""
    states.assert_same(a, b, path, ordered=ordered, exact_types=True)


def tensors_only(s):
    """`s` with its non-tensor values left out, and the containers that held only those."""
    if isinstance(s, torch.Tensor):
        return s
    if isinstance(s, dict):
        out = {k: tensors_only(v) for k, v in s.items()}
        out = {k: v for k, v in out.items() if v is not None}
        return out if out or not s else None
    if type(s) in (list, tuple) and any(isinstance(v, (torch.Tensor, dict)) for v in s):
        out = [tensors_only(v) for v in s]
        return None if all(v is None for v in out) else type(s)(out)
    return None


def string_keys(s):
    if isinstance(s, dict):
        return {str(k): string_keys(v) for k, v in s.items()}
    if type(s) in (list, tuple):
        return type(s)(string_keys(v) for v in s)
    return s


def write_source(kind, path, state=None):
    """A checkpoint of `kind` at `path`, written by that format's own writer."""
    if kind == "fastckpt":
        fastckpt.save(state or full_state(), path)
    elif kind == "torch":
        torch.save(state or full_state(), path)
    elif kind == "safetensors":
        safetensors_torch.save_file(state or flat_tensors(), str(path), metadata={"origin": "test"})
    elif kind == "dcp":
        dcp.save(state or dcp_state(), storage_writer=FileSystemWriter(str(path)))
    else:
        raise ValueError(kind)
    return state or {"fastckpt": full_state, "torch": full_state, "safetensors": flat_tensors,
                     "dcp": dcp_state}[kind]()


def load_any(path):
    """Read back with fastckpt: files with fastckpt.load, anything through a conversion to a file."""
    return fastckpt.load(path, weights_only=True)


EXT = {"fastckpt": ".pt", "torch": ".pt", "safetensors": ".safetensors", "dcp": ".dcp"}


# ---------------------------------------------------------------- inspect

def _entries(report):
    return {e["key"]: e for e in report["entries"]}


def test_inspect_fastckpt_text_and_json(tmp_path, capsys, monkeypatch):
    p = tmp_path / "ckpt.pt"
    state = {**full_state(), "big": torch.zeros(1 << 15)}  # a 128 KiB storage: fastckpt's 4 KiB layout
    fastckpt.save(state, p)
    from fastckpt.sources import ZipSource

    def no_data(self, *a):  # inspect must not read tensor data
        raise AssertionError("inspect read tensor data")
    monkeypatch.setattr(ZipSource, "read", no_data)

    rc, out, err = run(capsys, "inspect", p)
    assert rc == 0, err
    assert out.startswith(f"{p}: fastckpt checkpoint")
    lines = out.splitlines()
    row = next(line for line in lines if line.strip().startswith("bf16"))
    assert row.split()[1:4] == ["bfloat16", "[4,", "4]"] and "32 B" in row and row.rstrip().endswith("cpu")
    assert any(line.split()[:3] == ["step", "int", "100"] for line in lines)
    assert any("storage shared by" in line for line in lines if line.strip().startswith("view.t"))

    rc, out, err = run(capsys, "inspect", "--json", p)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["format"] == "fastckpt" and rep["archive"]["alignment"] == 4096
    assert rep["archive"]["large_alignment"] == 4096 and rep["archive"]["large_min"] == 65536
    e = _entries(rep)
    assert e["model.view.t"]["shape"] == [6, 4] and e["model.view.t"]["stride"] == [1, 8]
    assert e["model.view.t"]["storage_offset"] == 10 and e["model.view.t"]["storage"] == e["model.view.row"]["storage"]
    assert e["model.u16"]["dtype"] == "uint16" and e["model.u16"]["nbytes"] == 4
    assert e["model.scalar"]["shape"] == [] and e["model.empty"]["nbytes"] == 0
    assert e["model.mask"]["device"] == "cpu"
    assert e["optim.state.0.step"]["path"] == ["optim", "state", 0, "step"]
    assert e["optim.param_groups.0.betas"]["value"] == [0.9, 0.999]
    assert e["step"] == {**e["step"], "type": "int", "value": 100}
    assert e["tag"]["type"] == "NoneType" and e["tag"]["value"] is None
    t = rep["totals"]
    tensors = [v for v in _walk_tensors(state)]
    assert t["tensors"] == len(tensors)
    assert t["tensor_bytes"] == sum(x.numel() * x.element_size() for x in tensors)
    assert t["by_dtype"]["bfloat16"] == {"tensors": 1, "bytes": 32}
    assert t["by_device"] == {"cpu": {"tensors": len(tensors), "bytes": t["tensor_bytes"]}}


def _walk_tensors(o):
    if isinstance(o, torch.Tensor):
        yield o
    elif isinstance(o, dict):
        for v in o.values():
            yield from _walk_tensors(v)
    elif isinstance(o, (list, tuple)):
        for v in o:
            yield from _walk_tensors(v)


def test_inspect_stock_torch_save_and_cuda_location(tmp_path, capsys):
    p = tmp_path / "stock.pt"
    torch.save({"w": torch.ones(3, 2), "n": 3}, p)
    rc, out, err = run(capsys, "inspect", "--json", p)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["format"] == "torch" and rep["archive"]["alignment"] == 64
    assert _entries(rep)["w"]["shape"] == [3, 2] and _entries(rep)["w"]["device"] == "cpu"
    # The device is the location tag saved in the pickle, reported without a device to map it to.
    from fastckpt.formats.pickler import pickle_with_storages
    from fastckpt.torchsave.writer import write_archive
    pkl, storages = pickle_with_storages({"w": torch.ones(3, 2)}, pickle, 2)
    cuda_pkl = pkl.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:1")
    assert cuda_pkl != pkl
    write_archive(str(tmp_path / "cuda.pt"), cuda_pkl, storages)
    rc, out, err = run(capsys, "inspect", "--json", tmp_path / "cuda.pt")
    assert rc == 0, err
    rep = json.loads(out)
    assert _entries(rep)["w"]["device"] == "cuda:1" and rep["totals"]["by_device"] == {"cuda:1": {"tensors": 1, "bytes": 24}}


def test_inspect_safetensors(tmp_path, capsys, monkeypatch):
    p = tmp_path / "m.safetensors"
    write_source("safetensors", p)
    from fastckpt.sources import SafetensorsSource
    monkeypatch.setattr(SafetensorsSource, "read", lambda *a: (_ for _ in ()).throw(AssertionError("read")))
    rc, out, err = run(capsys, "inspect", "--json", p)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["format"] == "safetensors" and rep["safetensors"]["metadata"] == {"origin": "test"}
    e = _entries(rep)
    assert e["a.bias"]["dtype"] == "bfloat16" and e["a.bias"]["shape"] == [5]
    assert e["zero_d"]["shape"] == [] and e["none"]["nbytes"] == 0
    assert rep["totals"]["tensors"] == len(flat_tensors())
    rc, out, err = run(capsys, "inspect", p)
    assert rc == 0 and "a.weight" in out and "float32" in out


def test_inspect_dcp_reads_only_metadata(tmp_path, capsys):
    d = tmp_path / "ck"
    write_source("dcp", d)
    for f in os.listdir(d):  # the data files are not needed to inspect
        if f.endswith(".distcp"):
            os.unlink(d / f)
    rc, out, err = run(capsys, "inspect", "--json", d)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["format"] == "dcp"
    e = _entries(rep)
    assert e["model.bf16"]["dtype"] == "bfloat16" and e["model.bf16"]["shape"] == [4, 4]
    assert e["model.bf16"]["device"] is None and e["model.bf16"]["chunks"] == 1
    assert e["optim.state.0.step"]["path"] == ["optim", "state", "0", "step"]
    assert e["step"]["type"] == "object" and e["step"]["nbytes"] > 0
    rc, out, err = run(capsys, "inspect", d)
    assert rc == 0 and "DCP checkpoint" in out and "(stored object" in out


def test_inspect_runs_no_code(tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    p = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Evil()}, p)
    for cmd in ("inspect", "verify", "convert"):
        argv = [cmd, p] + ([tmp_path / "out.pt"] if cmd == "convert" else [])
        rc, out, err = run(capsys, *argv)
        assert not marker.exists()
        if cmd == "verify":  # every CRC can still be checked
            assert rc == 0 and "weights-only unpickler refused" in out
        else:
            assert rc == 1 and "weights-only unpickler refused" in err and "Traceback" not in err
    # DCP .metadata is a pickle too
    d = tmp_path / "ck"
    write_source("dcp", d, {"w": torch.ones(2)})
    (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    rc, out, err = run(capsys, "inspect", d)
    assert rc == 1 and "not a DCP metadata class" in err and not marker.exists()


def test_inspect_legacy_format(tmp_path, capsys):
    p = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(4.0), "n": 2}, p, _use_new_zipfile_serialization=False)
    rc, out, err = run(capsys, "inspect", "--json", p)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["format"] == "torch-legacy" and _entries(rep)["w"]["shape"] == [4]


# ---------------------------------------------------------------- verify

@pytest.mark.parametrize("kind", ["fastckpt", "torch", "safetensors", "dcp"])
def test_verify_good(tmp_path, capsys, kind):
    p = tmp_path / ("ck" + (EXT[kind] if kind != "dcp" else ""))
    write_source(kind, p)
    rc, out, err = run(capsys, "verify", p)
    assert rc == 0, out + err
    assert out.rstrip().endswith("OK")
    rc, out, err = run(capsys, "verify", "--json", p)
    rep = json.loads(out)
    assert rc == 0 and rep["ok"] is True and rep["problems"] == []
    if kind == "safetensors":  # nothing to check the bytes against
        assert rep["unverified"]
        assert run(capsys, "verify", "--strict", p)[0] == 1
    else:
        assert rep["unverified"] == []
        assert run(capsys, "verify", "--strict", p)[0] == 0


def test_verify_file_without_checksums(tmp_path, capsys):
    from torch.utils.serialization import config
    p = tmp_path / "nocrc.pt"
    old = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        torch.save({"w": torch.randn(100)}, p)
    finally:
        config.save.compute_crc32 = old
    rc, out, err = run(capsys, "verify", p)
    assert rc == 0 and "not checked" in out and "records no checksums" in out
    rc, out, err = run(capsys, "verify", "--strict", p)
    assert rc == 1 and "FAILED (--strict)" in out


def test_verify_truncated_file(tmp_path, capsys):
    p = tmp_path / "ck.pt"
    fastckpt.save(full_state(), p)
    data = p.read_bytes()
    for cut in (len(data) - 10, len(data) // 2, 100):
        p.write_bytes(data[:cut])
        rc, out, err = run(capsys, "verify", p)
        assert rc == 1
        assert "PROBLEM" in out and ("truncated" in out or "corrupt" in out), out


def test_verify_flipped_bit_names_the_tensor(tmp_path, capsys):
    p = tmp_path / "ck.pt"
    state = full_state()
    fastckpt.save(state, p)
    arch = _zip.Archive.open(str(p))
    # the record that holds model.bf16: find it through the pickle, then flip one bit of its data
    from fastckpt.sources.source import storage_of
    from fastckpt.sources import ZipSource
    with ZipSource(str(p)) as src:
        rec = storage_of(src.tree()["model"]["bf16"]).key
    data = bytearray(p.read_bytes())
    data[arch.records[rec].data_offset + 3] ^= 0x10
    p.write_bytes(data)
    rc, out, err = run(capsys, "verify", p)
    assert rc == 1
    assert f"checksum mismatch in record {rec!r} (tensor model.bf16)" in out
    rc, out, err = run(capsys, "verify", "--json", p)
    rep = json.loads(out)
    assert rep["ok"] is False and len(rep["problems"]) == 1 and "model.bf16" in rep["problems"][0]
    # a flipped bit in data.pkl is found too (and named)
    fastckpt.save(state, p)
    data = bytearray(p.read_bytes())
    data[arch.records["data.pkl"].data_offset + 20] ^= 0x01
    p.write_bytes(data)
    rc, out, err = run(capsys, "verify", p)
    assert rc == 1 and "checksum mismatch in record 'data.pkl'" in out


def test_verify_many_small_records_in_few_reads(tmp_path, capsys, monkeypatch):
    """verify reads small records many per engine call (their CRC-32s computed
    during the reads), not one call per record, and still names each damaged
    record and tensor: small ones (batched) and a large one (streamed)."""
    import fastckpt.sources.source as sources
    state = {f"s{i}": torch.full((3,), float(i)) for i in range(3000)}
    state["big"] = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: streamed in CHUNK pieces
    p = tmp_path / "many.pt"
    fastckpt.save(state, p)
    calls = []
    real = _C.read_ranges
    monkeypatch.setattr(_C, "read_ranges", lambda *a, **k: calls.append(1) or real(*a, **k))
    rc, out, err = run(capsys, "verify", p)
    assert rc == 0, out + err
    assert len(calls) < 100, f"{len(calls)} engine reads to verify 3001 records"
    from fastckpt.sources.source import storage_of
    from fastckpt.sources import ZipSource
    with ZipSource(str(p)) as src:
        tree = src.tree()
        small, big = storage_of(tree["s1234"]).key, storage_of(tree["big"]).key
    arch = _zip.Archive.open(str(p))
    data = bytearray(p.read_bytes())
    data[arch.records[small].data_offset + 5] ^= 0x01
    data[arch.records[big].data_offset + (10 << 20) + 1] ^= 0x01
    p.write_bytes(data)
    rc, out, err = run(capsys, "verify", p)
    assert rc == 1
    assert f"checksum mismatch in record {small!r} (tensor s1234)" in out, out
    assert f"checksum mismatch in record {big!r} (tensor big)" in out, out
    assert out.count("checksum mismatch") == 2, out
    assert sources.CHUNK < 12 << 20  # the big record did go through several pieces


def test_load_and_verify_read_records_through_one_reader(tmp_path, capsys, monkeypatch):
    """fastckpt.load and the command's zip source (verify, inspect, convert)
    read records through the same reader (fastckpt.torchsave.reader.Records.read_into):
    one code path turns records into engine reads and returns their CRC-32s."""
    from fastckpt import serialization
    p = tmp_path / "ck.pt"
    fastckpt.save({"w": torch.arange(1000.0), "big": torch.zeros(3 << 20)}, p)
    seen = []
    real = fastckpt.torchsave.reader.Records.read_into
    monkeypatch.setattr(fastckpt.torchsave.reader.Records, "read_into",
                        lambda self, items, *rest, **kw: seen.extend(n for n, *_ in items)
                        or real(self, items, *rest, **kw))
    fastckpt.load(p)
    assert "data.pkl" in seen and any(n.startswith("data/") for n in seen)
    seen.clear()
    rc, out, err = run(capsys, "verify", p)
    assert rc == 0, out + err
    assert "data.pkl" in seen and {n for n in seen if n.startswith("data/")} == {"data/0", "data/1"}


def test_verify_dcp_damage(tmp_path, capsys):
    d = tmp_path / "ck"
    write_source("dcp", d)
    good = tmp_path / "good"
    shutil.copytree(d, good)
    md = pickle.loads((d / ".metadata").read_bytes())
    # a flipped bit in one tensor's data
    info = next(i for k, i in md.storage_data.items() if k.fqn == "model.i64")
    f = d / info.relative_path
    data = bytearray(f.read_bytes())
    at = bytes(data).find(torch.arange(10).numpy().tobytes(), info.offset, info.offset + info.length)
    assert at > 0
    data[at + 17] ^= 0x04  # a bit of the tensor's data
    f.write_bytes(data)
    rc, out, err = run(capsys, "verify", d)
    assert rc == 1 and "model.i64" in out and "checksum mismatch" in out, out
    # a missing data file: named, with what it held
    shutil.rmtree(d)
    shutil.copytree(good, d)
    os.unlink(d / info.relative_path)
    rc, out, err = run(capsys, "verify", d)
    assert rc == 1 and f"{info.relative_path}: data file named in .metadata is missing" in out, out
    # a truncated data file
    shutil.rmtree(d)
    shutil.copytree(good, d)
    with open(d / info.relative_path, "r+b") as fh:
        fh.truncate(info.offset + 10)
    rc, out, err = run(capsys, "verify", d)
    assert rc == 1 and "truncated data file" in out, out
    # no .metadata: not a complete checkpoint
    os.unlink(good / ".metadata")
    rc, out, err = run(capsys, "verify", good)
    assert rc == 1 and ".metadata does not exist" in out and "not a complete DCP checkpoint" in out


def test_verify_manager_directory(tmp_path, capsys):
    mgr = fastckpt.CheckpointManager(tmp_path / "run", keep_last=3)
    for step in (10, 20):
        mgr.save(step, {"w": torch.full((4,), float(step)), "step": step})
    mgr.close()
    rc, out, err = run(capsys, "verify", tmp_path / "run")
    assert rc == 0, out
    assert "latest names step_00000020.pt" in out and out.count("  OK") == 2
    rc, out, err = run(capsys, "inspect", tmp_path / "run")
    assert rc == 0 and "2 checkpoint(s); latest -> step_00000020.pt" in out
    # latest names a checkpoint that is gone
    os.unlink(tmp_path / "run" / "step_00000020.pt")
    rc, out, err = run(capsys, "verify", tmp_path / "run")
    assert rc == 1 and "names step_00000020.pt, which is missing" in out
    # a damaged checkpoint in the directory
    (tmp_path / "run" / "latest").write_text("step_00000010.pt\n")
    p = tmp_path / "run" / "step_00000010.pt"
    p.write_bytes(p.read_bytes()[:-30])
    rc, out, err = run(capsys, "verify", tmp_path / "run")
    assert rc == 1 and "step_00000010.pt" in out and "PROBLEM" in out


@pytest.mark.parametrize("kind", ["fastckpt", "torch", "safetensors", "dcp"])
def test_damaged_input_is_an_error_never_a_crash(tmp_path, capsys, kind):
    """Random byte damage to every file of a checkpoint: inspect, verify and convert end with
    status 0 or 1 and a message, never an internal error (the parsers of bytes from disk)."""
    import random
    rng = random.Random(1234)
    good = tmp_path / ("good" + (EXT[kind] if kind != "dcp" else ""))
    write_source(kind, good, {"w": torch.randn(40, 3), "b": torch.arange(5), "n": 3} if kind == "dcp" else None)
    files = sorted(p.name for p in good.iterdir()) if kind == "dcp" else [None]
    for i in range(45):
        bad = tmp_path / f"bad{i}"
        if kind == "dcp":
            shutil.copytree(good, bad)
            target = bad / rng.choice(files)
        else:
            shutil.copy(good, bad)
            target = bad
        data = bytearray(target.read_bytes())
        how = rng.choice(["flip", "flip", "truncate", "zero"])
        if how == "flip":
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif how == "truncate":
            del data[rng.randrange(len(data)):]
        else:
            at = rng.randrange(len(data))
            data[at:at + 64] = bytes(len(data[at:at + 64]))
        target.write_bytes(bytes(data))
        cmds = [["inspect", bad], ["verify", bad], ["convert", bad, tmp_path / f"out{i}.pt", "--to", "fastckpt"]]
        for argv in cmds:
            rc, out, err = _run_measured(capsys, H.file_size(bad), *argv)
            assert rc in (0, 1), (argv, how, rc, err)
            assert "run with -v" not in err and "Traceback" not in err, (argv, how, err)
            if rc == 1 and argv[0] != "verify":
                assert err.startswith("fastckpt: error: "), err
    assert temp_files(tmp_path) == []


# The per-input memory oracle of the command's fuzzing: the peak RSS of one command
# on one input (the high-water mark reset before it) may grow by at most this many
# times the input's size, plus what running a command costs.
MEMORY_RATIO, MEMORY_SLACK = 64, 64 << 20


def _run_measured(capsys, size, *argv):
    """run() with the memory oracle."""
    (rc, out, err), grown = H.peak_growth(run, capsys, *argv, traced=False)
    assert grown <= MEMORY_RATIO * size + MEMORY_SLACK, \
        f"{argv[0]} of a {size}-byte input raised the peak RSS by {grown >> 20} MiB"
    return rc, out, err


@pytest.mark.parametrize("where", ["dcp-metadata", "dcp-record", "zip-data.pkl"])
def test_crafted_input_is_an_error_in_small_memory(tmp_path, capsys, where):
    """Crafted pickles (tests/support/hostile_pickles.py: a 9-byte LONG_BINPUT,
    huge declared sizes, deep nesting, amplifiers, calls of os.system / eval /
    open) as a DCP .metadata, as the data.pkl of a DCP record and as the data.pkl
    of a zip archive: inspect, verify and convert end with status 1 and a
    message, run no code and stay in little memory for each input."""
    marker = tmp_path / "pwned"
    crafted = {**H.SIZE_ATTACKS, **H.AMPLIFIERS, **H.code_attacks(str(marker))}
    write_source("dcp", tmp_path / "warm", {"w": torch.ones(3)})
    run(capsys, "verify", tmp_path / "warm")  # imports and first-use caches, not measured
    for i, (name, pkl) in enumerate(crafted.items()):
        bad = tmp_path / f"bad{i}"
        if where == "dcp-metadata":
            write_source("dcp", bad, {"w": torch.ones(3), "n": 1})
            (bad / ".metadata").write_bytes(pkl)
        elif where == "dcp-record":
            H.record_ckpt(bad, pkl)
        else:
            bad = tmp_path / f"bad{i}.pt"
            bad.write_bytes(H.record(pkl))
        for argv in (["inspect", bad], ["verify", bad], ["convert", bad, tmp_path / f"out{i}.pt", "--to", "fastckpt"]):
            if where == "dcp-record" and argv[0] == "inspect":
                continue  # inspect reads no record
            rc, out, err = _run_measured(capsys, H.file_size(bad), *argv)
            # torch's weights-only unpickler (zip archives) may find a harmless object, e.g. {}
            assert rc == 1 or (rc == 0 and where == "zip-data.pkl"), (name, argv[0], rc, out, err)
            assert "run with -v" not in err and "Traceback" not in err, (name, argv[0], err)
            if rc == 1:
                assert str(bad) in (out if argv[0] == "verify" else err), (name, argv[0], out, err)
            assert not marker.exists(), (name, argv[0])
        if where != "zip-data.pkl":
            assert not (tmp_path / f"out{i}.pt").exists()
    assert temp_files(tmp_path) == []


# ---------------------------------------------------------------- convert

def expected_after(src_kind, dst_kind, state):
    """What a conversion src -> dst keeps of `state` (docs/CLI.md)."""
    if dst_kind == "safetensors":
        state = tensors_only(state)
    if dst_kind == "dcp":
        state = string_keys(state)
    return state


def read_back(path, kind, tmp_path):
    """The checkpoint at `path` as a nested object, read through fastckpt (a file) or converted to one."""
    if kind in ("fastckpt", "torch"):
        return torch.load(path, weights_only=True)
    back = tmp_path / f"back-{os.path.basename(path)}.pt"
    assert main(["convert", str(path), str(back), "--to", "fastckpt", "-q", "--force"]) == 0
    return torch.load(back, weights_only=True)


def stock_check(path, kind, state, shares=True):
    """The converted checkpoint read by that format's stock reader (`shares`: the source kept
    tensors that share storage shared, so that tied tensors are stored once)."""
    if kind in ("fastckpt", "torch"):
        assert_same(state, torch.load(path, weights_only=True), ordered=False)
        assert_same(state, torch.load(path, weights_only=True, mmap=True), ordered=False)
    elif kind == "safetensors":
        flat = safetensors_torch.load_file(str(path))
        from fastckpt.cli.convert import key_str
        want = {}

        def rec(o, p):
            if isinstance(o, torch.Tensor):
                want.setdefault(key_str(p), o)
            elif isinstance(o, dict):
                for k, v in o.items():
                    rec(v, p + (k,))
            elif type(o) in (list, tuple):
                for i, v in enumerate(o):
                    rec(v, p + (i,))
        rec(state, ())
        seen = {}
        for k, t in want.items():  # tied tensors are stored once, under their first name
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if shares and key in seen:
                assert k not in flat
                continue
            seen[key if shares else k] = k
            assert_same(t.contiguous(), flat[k], k)
        assert set(flat) == set(seen.values())
    elif kind == "dcp":
        template = _zeros_like(state)
        dcp.load(template, storage_reader=FileSystemReader(str(path)))
        assert_same(state, template)


def _zeros_like(o):
    if isinstance(o, torch.Tensor):
        return torch.zeros_like(o.contiguous())
    if isinstance(o, dict):
        return {k: _zeros_like(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_zeros_like(v) for v in o]
    return o


KINDS = ["fastckpt", "torch", "safetensors", "dcp"]


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_convert_round_trip(tmp_path, capsys, src_kind, dst_kind):
    src = tmp_path / ("src" + EXT[src_kind])
    state = write_source(src_kind, src)
    dst = tmp_path / ("dst" + EXT[dst_kind])
    argv = ["convert", src, dst, "--to", dst_kind]
    holds_values = any(not isinstance(v, torch.Tensor) for v in _leaves(state))
    if dst_kind == "safetensors" and holds_values:
        rc, out, err = run(capsys, *argv)
        assert rc == 1 and "safetensors files hold only tensors" in err, err
        assert "step (int)" in err or "step (object (not read))" in err, err
        assert not dst.exists() and temp_files(tmp_path) == []
        argv.append("--drop-non-tensors")
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert f"-> {dst} ({dst_kind})" in out
    assert temp_files(tmp_path) == [] and (dst_kind != "dcp" or temp_files(dst) == [])
    want = expected_after(src_kind, dst_kind, state)
    got = read_back(dst, dst_kind, tmp_path)
    # a safetensors file written by safetensors itself does not keep the order of its keys
    assert_same(want, got, ordered=src_kind != "safetensors")
    stock_check(dst, dst_kind, want, shares=src_kind in ("fastckpt", "torch"))
    if src_kind in ("fastckpt", "torch") and dst_kind in ("fastckpt", "torch"):
        # a file to a file keeps the storage graph: tied tensors, views
        m = got["model"]
        assert m["embed.weight"] is m["head.weight"]
        assert m["view.t"].untyped_storage().data_ptr() == m["view.row"].untyped_storage().data_ptr()
        assert m["view.t"].stride() == (1, 8) and m["view.t"].storage_offset() == 10
    if src_kind in ("fastckpt", "torch") and dst_kind == "safetensors":
        # tied weights come back tied through fastckpt's nesting record
        assert got["model"]["embed.weight"] is got["model"]["head.weight"]
    if dst_kind in ("fastckpt", "torch"):
        arch = _zip.Archive.open(str(dst))
        # torch.save's .format_version, and every record on the alignment .storage_alignment states
        # (this state's storages are all small: 64 bytes, torch's own layout, for both kinds)
        assert ".format_version" in arch.records
        assert all(e.data_offset % 64 == 0 for e in arch.records.values())
        assert fastckpt.load(dst, verify=True) is not None


def _leaves(o):
    if isinstance(o, dict):
        for v in o.values():
            yield from _leaves(v)
    elif type(o) in (list, tuple) and any(isinstance(v, (torch.Tensor, dict)) for v in o):
        for v in o:
            yield from _leaves(v)
    else:
        yield o


@pytest.mark.parametrize("to", KINDS)
def test_convert_conjugate_views_and_parameters(tmp_path, capsys, to):
    """Tensors whose values are not their stored bytes (conjugate and negative views) are
    resolved where the target stores plain values; a file target keeps the view and Parameter."""
    c = torch.randn(4, dtype=torch.complex64)
    state = {"c": c, "conj": c.conj(), "neg": torch._neg_view(torch.randn(3)) if hasattr(torch, "_neg_view")
             else torch.randn(3), "p": torch.nn.Parameter(torch.randn(2))}
    src = tmp_path / "src.pt"
    torch.save(state, src)
    dst = tmp_path / ("dst" + EXT[to])
    rc, out, err = run(capsys, "convert", src, dst, "--to", to)
    assert rc == 0, err
    got = read_back(dst, to, tmp_path)
    for k, v in state.items():
        assert torch.equal(v.detach().resolve_conj().resolve_neg(), got[k].detach().resolve_conj().resolve_neg()), k
    if to in ("fastckpt", "torch"):
        assert got["conj"].is_conj() and isinstance(got["p"], torch.nn.Parameter) and got["p"].requires_grad
        assert got["conj"].untyped_storage().data_ptr() == got["c"].untyped_storage().data_ptr()


def test_convert_refusals_and_usage_errors(tmp_path, capsys):
    src = tmp_path / "a.pt"
    fastckpt.save({"w": torch.ones(2)}, src)
    dst = tmp_path / "b.pt"
    dst.write_bytes(b"keep me")
    rc, out, err = run(capsys, "convert", src, dst)
    assert rc == 2 and "exists; pass --force" in err and dst.read_bytes() == b"keep me"
    assert run(capsys, "convert", src, dst, "--force")[0] == 0
    assert_same({"w": torch.ones(2)}, torch.load(dst))
    rc, out, err = run(capsys, "convert", src, src, "--force")
    assert rc == 2 and "same path" in err
    rc, out, err = run(capsys, "convert", src, tmp_path / "noext")
    assert rc == 2 and "--to" in err
    rc, out, err = run(capsys, "convert", src, tmp_path / "missing-dir" / "x.pt")
    assert rc == 2 and "no such directory" in err
    rc, out, err = run(capsys, "convert", src, tmp_path / "x", "--to", "bogus")
    assert rc == 2 and "invalid choice" in err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    rc, out, err = run(capsys, "convert", src, tmp_path / "notes", "--to", "dcp", "--force")
    assert rc == 2 and "holds something else" in err and (tmp_path / "notes" / "todo.txt").exists()
    # a DCP checkpoint holds a dict; complex128 has no safetensors dtype
    fastckpt.save([torch.ones(1)], tmp_path / "list.pt")
    rc, out, err = run(capsys, "convert", tmp_path / "list.pt", tmp_path / "l", "--to", "dcp")
    assert rc == 1 and "holds a dict at the top" in err
    fastckpt.save({"c": torch.ones(2, dtype=torch.complex128)}, tmp_path / "c.pt")
    rc, out, err = run(capsys, "convert", tmp_path / "c.pt", tmp_path / "c.safetensors")
    assert rc == 1 and "dtype complex128 has no safetensors name" in err
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("to", ["fastckpt", "safetensors", "dcp"])
def test_convert_refuses_a_corrupt_source(tmp_path, capsys, to):
    """Copying corrupt data into a new file would give it fresh, valid checksums: the source's
    CRCs are checked as it is read, and a mismatch stops the conversion."""
    src = tmp_path / "a.pt"
    fastckpt.save({"w": torch.randn(1000), "big": torch.randn(3 << 20)}, src)
    arch = _zip.Archive.open(str(src))
    data = bytearray(src.read_bytes())
    for rec in ("data/0", "data/1"):
        bad = tmp_path / f"bad-{rec[-1]}.pt"
        d = bytearray(data)
        d[arch.records[rec].data_offset + arch.records[rec].size // 2] ^= 0x20
        bad.write_bytes(d)
        dst = tmp_path / f"out-{rec[-1]}{EXT[to]}"
        rc, out, err = run(capsys, "convert", bad, dst, "--to", to)
        assert rc == 1 and f"checksum mismatch in record {rec!r}" in err, err
        assert not dst.exists() and temp_files(tmp_path) == []
        rc, out, err = run(capsys, "convert", "--no-verify", bad, dst, "--to", to)
        assert rc == 0, err
    # a failed conversion over an existing checkpoint (--force) leaves that checkpoint as it was
    dst = tmp_path / f"keep{EXT[to]}"
    assert run(capsys, "convert", src, dst, "--to", to)[0] == 0
    before = read_back(dst, to, tmp_path)
    rc, out, err = run(capsys, "convert", "--force", tmp_path / "bad-1.pt", dst, "--to", to)
    assert rc == 1 and "checksum mismatch" in err
    assert_same(before, read_back(dst, to, tmp_path))
    assert temp_files(tmp_path) == []


def test_convert_to_dcp_warns_about_int_keys(tmp_path, capsys):
    src = tmp_path / "a.pt"
    fastckpt.save({"optim": {"state": {0: {"exp_avg": torch.ones(2)}}}}, src)
    rc, out, err = run(capsys, "convert", src, tmp_path / "d", "--to", "dcp")
    assert rc == 0 and "non-string keys (optim.state.0)" in err
    rc, out, err = run(capsys, "-q", "convert", src, tmp_path / "d2", "--to", "dcp")
    assert rc == 0 and err == ""


def test_convert_legacy_source(tmp_path, capsys):
    p = tmp_path / "legacy.pt"
    state = {"w": torch.randn(3, 3), "n": 4, "v": [torch.arange(3)]}
    torch.save(state, p, _use_new_zipfile_serialization=False)
    rc, out, err = run(capsys, "convert", p, tmp_path / "new.pt")
    assert rc == 0 and "read whole into memory" in err
    assert_same(state, torch.load(tmp_path / "new.pt"))


BOUNDED = r"""
import json, sys, time
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
import torch, tqdm, fastckpt, fastckpt.cli, fastckpt.cli.convert, fastckpt.dcp   # code, not data
import torch.distributed.checkpoint
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
except OSError:
    pass
base = status("VmRSS")
t0 = time.time()
rc = fastckpt.cli.main(sys.argv[1:])
print(json.dumps({"rc": rc, "growth": status("VmHWM") - base, "seconds": time.time() - t0}))
"""


def test_convert_memory_is_bounded(tmp_path):
    """Convert a 256 MiB checkpoint fastckpt -> safetensors -> DCP -> fastckpt, each in a fresh
    process: peak RSS may grow by well under the checkpoint's size (two 8 MiB read buffers, one
    or two 8 MiB tensors for DCP, the engine's 4 x 1 MiB staging buffers).

    The peak is the process's VmHWM, not getrusage's ru_maxrss: on Linux a child's ru_maxrss
    starts at the RSS of the parent it was forked from (here pytest, hundreds of MiB), which
    would hide what the conversion itself used."""
    n, numel = 32, 2 << 20                               # 32 tensors x 8 MiB
    size = n * numel * 4
    src = tmp_path / "big.pt"
    make = ("import torch, fastckpt, sys\n"
            f"fastckpt.save({{f'layer{{i}}.weight': torch.full(({numel},), float(i)) for i in range({n})}}, sys.argv[1])")
    env = cli_env(FASTCKPT_BUFFER_SIZE="1M", FASTCKPT_BUFFER_COUNT="4")
    fastspawn.run([sys.executable, "-c", make, str(src)], check=True, env=env)
    steps = [(src, tmp_path / "big.safetensors", "safetensors"), (tmp_path / "big.safetensors", tmp_path / "bigd", "dcp"),
             (tmp_path / "bigd", tmp_path / "back.pt", "fastckpt")]
    bound = size // 4
    for a, b, to in steps:
        r = fastspawn.run([sys.executable, "-c", BOUNDED, "convert", str(a), str(b), "--to", to],
                           env=env, capture_output=True, text=True, timeout=120)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        assert res["rc"] == 0, r.stderr
        assert res["growth"] < bound, f"{a.name} -> {to}: peak RSS grew by {res['growth'] >> 20} MiB"
    got = torch.load(tmp_path / "back.pt", mmap=True, weights_only=True)
    assert sorted(got) == sorted(f"layer{i}.weight" for i in range(n))
    for i in range(n):
        t = got[f"layer{i}.weight"]
        assert t.shape == (numel,) and bool((t == float(i)).all())


# ---------------------------------------------------------------- doctor

def _stat_fs_type(path):
    r = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_doctor(tmp_path, capsys, where):
    d = tmp_path if where == "tmp" else "/dev/shm"
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        pytest.skip(f"{d} is not a writable directory here")
    before = sorted(os.listdir(d))
    rc, out, err = run(capsys, "doctor", "--json", d)
    assert rc == 0, err
    rep = json.loads(out)
    assert sorted(os.listdir(d)) == before  # the probes leave nothing behind
    fs = _stat_fs_type(d)
    if fs == "tmpfs":
        assert rep["filesystem"]["type"] == "tmpfs" and rep["filesystem"]["statfs_name"] == "tmpfs"
        assert any("tmpfs (memory)" in r for r in rep["recommendations"])
    elif fs and fs.startswith("ext2"):
        assert rep["filesystem"]["type"] in ("ext4", "ext3", "ext2") and rep["filesystem"]["statfs_magic"] == "0xef53"
    assert rep["o_direct"]["writable"] is True and isinstance(rep["o_direct"]["usable"], bool)
    assert rep["o_direct"]["alignment"]["offset"] >= 512
    assert rep["io_uring"]["compiled"] == _C.uring_compiled()
    assert rep["crc32"] == _C.crc32_impl() and rep["crc32"] in ("isa-l", "zlib")
    assert rep["crc32_kernel"] == _C.crc32_kernel() and rep["crc32_kernel"] in (rep["crc32"], "vpclmulqdq-avx2")
    assert rep["engine"]["backend"] == ("threads" if uring_refusal() else "io_uring")
    assert rep["knobs"] == {**fastckpt.knobs.as_dict(), **{k: fastckpt.knobs.get(k) for k in fastckpt.knobs.PY_NAMES}}
    st = os.statvfs(d)
    assert abs(rep["space"]["free"] - st.f_bavail * st.f_frsize) < 1 << 30
    assert rep["cuda"]["available"] == torch.cuda.is_available()
    rc, out, err = run(capsys, "doctor", d)
    assert rc == 0 and "O_DIRECT" in out and "io_uring" in out and "recommendation:" in out
    assert f"CRC-32           {_C.crc32_impl()}" in out


def test_doctor_reports_io_uring_refusal(tmp_path, capsys):
    if not _C.uring_compiled():
        pytest.skip("built without liburing")
    _C.fault_inject("uring_setup", nth=1, errno=errno.EPERM, times=20)
    rc, out, err = run(capsys, "doctor", "--json", tmp_path)
    _C.fault_clear()
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["engine"]["backend"] == "threads"
    assert rep["io_uring"]["usable"] is False and "Operation not permitted" in rep["io_uring"]["refusal"]
    assert any("io_uring refused" in r and "thread backend" in r for r in rep["recommendations"])


def test_doctor_knob_effects(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FASTCKPT_DIRECT", "0")
    monkeypatch.setenv("FASTCKPT_BACKEND", "threads")
    rc, out, err = run(capsys, "doctor", "--json", tmp_path)
    rep = json.loads(out)
    assert rc == 0 and rep["o_direct"]["usable"] is False and "FASTCKPT_DIRECT=0" in rep["o_direct"]["reason"]
    assert rep["engine"]["backend"] == "threads" and rep["environment"]["FASTCKPT_BACKEND"] == "threads"
    assert any("FASTCKPT_BACKEND=threads" in r for r in rep["recommendations"])


def test_doctor_missing_directory(tmp_path, capsys):
    rc, out, err = run(capsys, "doctor", tmp_path / "nope")
    assert rc == 2 and err.startswith("fastckpt: error:") and "no such directory" in err


def test_doctor_memory_tier(tmp_path, capsys, monkeypatch):
    mem = tmp_path / "mem"
    mem.mkdir()
    monkeypatch.setenv("FASTCKPT_MEMORY_DIR", str(mem))
    live = make_namespace(mem, tmp_path / "ck-live", os.getpid(), replicas=(1,), steps=(3, 4))
    dead = make_namespace(mem, tmp_path / "ck-dead", dead_pid(), steps=(8,))
    (mem / "other").mkdir()
    rc, out, err = run(capsys, "doctor", "--json", tmp_path)
    assert rc == 0, err
    mt = json.loads(out)["memory_tier"]
    assert mt["directory"] == str(mem) and mt["exists"] is True
    fs = _stat_fs_type(mem)
    assert mt["memory_fs"] is (fs in ("tmpfs", "ramfs"))
    st = os.statvfs(mem)
    assert abs(mt["free"] - st.f_bavail * st.f_frsize) < 1 << 30 and mt["total"] == st.f_blocks * st.f_frsize
    ns = {n["path"]: n for n in mt["namespaces"]}
    assert set(ns) == {live, dead}
    assert ns[live]["live"] is True and ns[dead]["live"] is False
    assert ns[live]["newest_step"] == 4 and ns[dead]["newest_step"] == 8
    assert ns[dead]["directories"] == [os.path.realpath(tmp_path / "ck-dead")] and ns[dead]["bytes"] > 0
    assert mt["foreign"] == [{"path": str(mem / "other"), "why": "no rank*/replica* directories"}]
    recs = json.loads(out)["recommendations"]
    assert any("1 stale namespace(s)" in r and f"fastckpt clean-memory {mem}" in r for r in recs)
    assert any("not a tmpfs/ramfs" in r for r in recs) is (fs not in ("tmpfs", "ramfs"))
    rc, out, err = run(capsys, "doctor", tmp_path)
    assert rc == 0, err
    assert f"memory tier      {mem} (" in out and "2 namespace(s): 1 live, 1 stale" in out
    assert f"  stale  {dead}  " in out and "newest step 8" in out and f"live   {live}  " in out
    assert "fastckpt clean-memory" in out
    assert sorted(os.listdir(mem)) == sorted([os.path.basename(live), os.path.basename(dead), "other"])

    monkeypatch.setenv("FASTCKPT_MEMORY_DIR", str(tmp_path / "not-yet"))
    rc, out, err = run(capsys, "doctor", "--json", tmp_path)
    mt = json.loads(out)["memory_tier"]
    assert rc == 0 and mt["exists"] is False and mt["namespaces"] == [] and mt["free"] is not None
    assert not any("clean-memory" in r for r in json.loads(out)["recommendations"])
    assert not (tmp_path / "not-yet").exists()


# ---------------------------------------------------------------- clean-memory

def test_clean_memory(tmp_path, capsys):
    mem = tmp_path / "mem"
    mem.mkdir()
    live = make_namespace(mem, tmp_path / "ck-live", os.getpid())
    dead = make_namespace(mem, tmp_path / "ck-dead", dead_pid(), replicas=(1,), steps=(6,))
    (mem / "not-ours.txt").write_text("x")
    with open(os.path.join(dead, "rank0", "user.txt"), "w") as f:
        f.write("x")
    before = tree(mem)
    rc, out, err = run(capsys, "clean-memory", mem, "--dry-run")
    assert rc == 0, err
    assert tree(mem) == before
    assert f"would remove the snapshots of {dead} (" in out and "newest step 6" in out
    assert f"  left {os.path.join(dead, 'rank0', 'user.txt')}: not a memory tier file" in out
    assert f"kept {live} (live: pid {os.getpid()} runs)" in out
    assert f"not ours, left alone: {mem / 'not-ours.txt'} (not a directory)" in out
    assert "1 namespace(s)" in out and "would be freed" in out
    rc, out, err = run(capsys, "clean-memory", mem, "--dry-run", "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["dry_run"] is True and tree(mem) == before
    assert [r["path"] for r in rep["removed"]] == [dead]
    assert os.path.join(dead, "replica1", "slot0.pt") in rep["removed"][0]["removed"]
    assert [k["path"] for k in rep["kept"]] == [live] and rep["foreign"][0]["path"] == str(mem / "not-ours.txt")

    rc, out, err = run(capsys, "clean-memory", mem)
    assert rc == 0, err
    assert f"removed the snapshots of {dead} (" in out and "freed in" in out
    assert tree(dead) == ["rank0", "rank0/user.txt"]
    assert os.path.isdir(live) and (mem / "not-ours.txt").read_text() == "x"
    os.unlink(os.path.join(dead, "rank0", "user.txt"))
    rc, out, err = run(capsys, "clean-memory", mem)
    assert rc == 0 and f"removed {dead} (" in out and not os.path.exists(dead)
    rc, out, err = run(capsys, "clean-memory", mem)
    assert rc == 0 and f"nothing to clean in {mem}" in out


def test_clean_memory_older_than_force_and_default_dir(tmp_path, capsys, monkeypatch):
    mem = tmp_path / "mem"
    mem.mkdir()
    monkeypatch.setenv("FASTCKPT_MEMORY_DIR", str(mem))
    old = make_namespace(mem, tmp_path / "ck-old", dead_pid())
    new = make_namespace(mem, tmp_path / "ck-new", dead_pid())
    far = make_namespace(mem, tmp_path / "ck-far", 1, host="some-other-host.invalid")
    age(old, 7200)
    age(far, 7200)
    rc, out, err = run(capsys, "clean-memory", "--older-than", "3600", "--json")
    rep = json.loads(out)
    assert rc == 0, err
    assert rep["directory"] == str(mem) and [r["path"] for r in rep["removed"]] == [old]
    kept = {k["path"]: k["why"] for k in rep["kept"]}
    assert "newer than --older-than 3600 s" in kept[new]
    assert "on some-other-host.invalid, which cannot be asked (--force removes it)" in kept[far]
    assert not os.path.exists(old) and os.path.isdir(new) and os.path.isdir(far)
    rc, out, err = run(capsys, "clean-memory", "--force")
    assert rc == 0 and not os.path.exists(new) and not os.path.exists(far)
    assert os.listdir(mem) == []

    rc, out, err = run(capsys, "clean-memory", "--older-than", "-5")
    assert rc == 2 and "--older-than must be >= 0" in err
    rc, out, err = run(capsys, "clean-memory", tmp_path / "nope")
    assert rc == 2 and "no such directory" in err
    monkeypatch.setenv("FASTCKPT_MEMORY_DIR", str(tmp_path / "never-made"))
    rc, out, err = run(capsys, "clean-memory")
    assert rc == 0 and "nothing to clean" in out and not (tmp_path / "never-made").exists()


def test_clean_memory_subprocess(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir()
    dead = make_namespace(mem, tmp_path / "ck", dead_pid())
    live = make_namespace(mem, tmp_path / "ck-live", os.getpid())
    r = subprocess.run([sys.executable, "-m", "fastckpt", "clean-memory", "--json"], capture_output=True, text=True,
                       env=cli_env(FASTCKPT_MEMORY_DIR=str(mem)), timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [x["path"] for x in rep["removed"]] == [dead] and rep["removed"][0]["removed"][-1] == dead
    assert not os.path.exists(dead) and os.path.isdir(live)


# ---------------------------------------------------------------- the command itself

def test_errors_are_messages_not_tracebacks(tmp_path, capsys):
    rc, out, err = run(capsys, "inspect", tmp_path / "missing.pt")
    assert rc == 2 and err == f"fastckpt: error: {tmp_path / 'missing.pt'}: no such file or directory\n"
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello, world" * 10)
    rc, out, err = run(capsys, "inspect", junk)
    assert rc == 1 and "damaged or not a checkpoint" in err and "Traceback" not in err
    rc, out, err = run(capsys, "-v", "inspect", junk)
    assert rc == 1 and "Traceback" in err and "FormatError" in err
    rc, out, err = run(capsys, "inspect", junk, "-v")
    assert rc == 1 and "Traceback" in err
    rc, out, err = run(capsys)
    assert rc == 2 and "usage:" in err
    rc, out, err = run(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in err
    # an I/O error (not a format problem): named with its path
    p = tmp_path / "ok.pt"
    fastckpt.save({"w": torch.ones(1 << 16)}, p)
    _C.fault_inject("read", nth=1, errno=errno.EIO, times=1000, path_contains="ok.pt")
    rc, out, err = run(capsys, "verify", p)
    _C.fault_clear()
    assert rc == 1 and "Input/output error" in out and "ok.pt" in out


def test_subprocess_python_m_and_console_script(tmp_path):
    p = tmp_path / "ck.pt"
    fastckpt.save({"w": torch.ones(3), "step": 7}, p)
    r = fastspawn.run([sys.executable, "-m", "fastckpt", "inspect", "--json", str(p)],
                       capture_output=True, text=True, env=cli_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["totals"]["tensors"] == 1
    script = os.path.join(VENV_BIN, "fastckpt")
    if not os.path.exists(script):
        pytest.skip("the fastckpt console script is not installed in this environment")
    # stderr is a pipe, not a terminal: no progress bar, nothing but results
    r = subprocess.run([script, "convert", str(p), str(tmp_path / "ck.safetensors"), "--drop-non-tensors", "-q"],
                       capture_output=True, text=True, env=cli_env(), timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = subprocess.run([script, "verify", str(tmp_path / "nope.pt")], capture_output=True, text=True,
                       env=cli_env(), timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("fastckpt: error:") and "Traceback" not in r.stderr


def test_progress_bar_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    p = tmp_path / "ck.pt"
    fastckpt.save({"w": torch.ones(1 << 20)}, p)
    rc, out, err = run(capsys, "verify", p)  # capsys's stderr is not a terminal
    assert rc == 0 and err == ""
    rc, out, err = run(capsys, "verify", "--progress", "always", p)
    assert rc == 0 and "verify" in err and "B/s" in err
    rc, out, err = run(capsys, "convert", "--progress", "always", p, tmp_path / "o.pt")
    assert rc == 0 and "fastckpt -> fastckpt" in err


def test_inspect_and_verify_a_sharded_safetensors_set(tmp_path, capsys):
    from fastckpt import safetensors as fst
    state = {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}
    fst.save_sharded(state, tmp_path / "hf", max_shard_size=40 << 10)
    rc, out, err = run(capsys, "inspect", tmp_path / "hf")
    assert rc == 0, out + err
    assert "sharded safetensors" in out and all(k in out for k in state), out
    rc, out, err = run(capsys, "verify", tmp_path / "hf")
    assert rc == 0, out + err
    assert "index" in out and out.count("safetensors records no checksums") == 1, out
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[0]
    os.truncate(shard, os.path.getsize(shard) - 100)
    rc, out, err = run(capsys, "verify", tmp_path / "hf")
    assert rc != 0 and str(shard) in out + err, out + err
