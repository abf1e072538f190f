"""fastckpt.dcp: FastWriter / FastReader with torch.distributed.checkpoint.

Multi-process tests start ranks of tests/support/workers/dcp_dist_worker.py
(gloo on 127.0.0.1, small tensors, 1 MiB engine buffers); the rest runs in this
process without a process group.
"""

import dataclasses
import errno
import gc
import io
import os
import pickle
import signal
import subprocess
import time
import zlib

import pytest
import torch

import torch.distributed as dist

from dist_launch import start_ranks
from paths import WORKERS

if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt import FormatError, _C  # noqa: E402
from fastckpt.dcp import FastReader, FastWriter  # noqa: E402
from fastckpt.formats import dcp as _blob  # noqa: E402
from fastckpt.dcp import records  # noqa: E402

from dcp_calls import dcp_unwrapped  # noqa: E402
from leaks import fd_count, temp_files, temps_of  # noqa: E402
from dist_launch import wait_for_ranks  # noqa: E402

HELPER = str(WORKERS / "dcp_dist_worker.py")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")



# ---------------------------------------------------------------- multi-process helpers

def _launch(scenario, world_size, work):
    return start_ranks(HELPER, scenario, work, world_size)


def _run_ranks(scenario, world_size, work, timeout=180):
    if not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    procs = _launch(scenario, world_size, work)
    wait_for_ranks(procs, scenario, timeout)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints written at world size 2 (and checked there) by dist_worker's save scenario."""
    work = tmp_path_factory.mktemp("dcp_ws2")
    _run_ranks("save", 2, work)
    return work


def _worker():
    from workers import dcp_dist_worker  # its torch.distributed globals are harmless without a process group
    return dcp_dist_worker


# ---------------------------------------------------------------- world sizes 2 -> 2, 3, 1

def test_save_at_2_and_load_at_2(saved):
    # the save scenario already loaded every checkpoint back at world size 2
    for name in ("fast", "stock", "threads", "per_item", "ckid", "model", "async1", "async2"):
        assert os.path.exists(saved / name / ".metadata"), name
    assert sorted(os.listdir(saved / "fast")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not os.path.exists(saved / "enospc" / ".metadata")


def test_load_at_3(saved):
    _run_ranks("load", 3, saved)


@pytest.mark.parametrize("name,reader", [("fast", FastReader), ("fast", dcp.FileSystemReader),
                                         ("stock", FastReader), ("async1", FastReader)])
def test_load_at_1_without_process_group(saved, name, reader):
    w = _worker()
    want = {k: w.full_value(k, shape, dtype) for k, (shape, dtype, _) in w.SPECS.items()}
    tgt = {k: torch.zeros_like(v) for k, v in want.items()}
    tgt["meta"] = {"step": 0, "tag": "", "lr": [0.0, 0.0]}
    dcp.load(tgt, storage_reader=reader(saved / name))
    for k, v in want.items():
        assert torch.equal(tgt[k], v), k
    assert tgt["meta"] == {"step": 42, "tag": "fastckpt", "lr": [1e-3, 2e-3]}


def test_model_and_optimizer_at_1(saved):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, storage_reader=FastReader(saved / "model"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    exp_model, exp_optim = torch.load(saved / "model_expected.pt", weights_only=True)
    got_model, got_optim = get_state_dict(model, opt)
    assert got_model.keys() == exp_model.keys()
    for k in exp_model:
        assert torch.equal(got_model[k], exp_model[k]), k
    for k in exp_optim:
        for kk in exp_optim[k]:
            assert torch.equal(got_optim["state"][k][kk], exp_optim[k][kk]), (k, kk)


def test_records_are_torch_save_archives_with_aligned_data(saved):
    """Every record of a FastWriter file is a torch.save archive (torch.load reads the
    byte range alone) whose tensor bytes start on a 4 KiB boundary when >= 64 KiB."""
    md = FastReader(saved / "fast").read_metadata()
    aligned = 0
    for idx, info in md.storage_data.items():
        with open(saved / "fast" / info.relative_path, "rb") as f:
            f.seek(info.offset)
            rec = f.read(info.length)
        assert info.offset % 64 == 0
        if not isinstance(md.state_dict_metadata[idx.fqn], dcp.metadata.TensorStorageMetadata):
            continue
        t = torch.load(io.BytesIO(rec), weights_only=True)
        assert tuple(t.shape) in [tuple(c.sizes) for c in md.state_dict_metadata[idx.fqn].chunks]
        index = _blob.parse_tail(rec[-4096:], max(0, len(rec) - 4096), len(rec), "x")
        e = index.entries["data/0"]
        data_off = info.offset + _blob.local_data_offset(rec[e.rel_offset:], e, index, "x")
        assert info.offset % 64 == 0
        if t.nbytes >= _blob.ALIGN_MIN:
            assert data_off % 4096 == 0, (idx, data_off)
            aligned += 1
        assert zlib.crc32(rec[data_off - info.offset:data_off - info.offset + t.nbytes]) == e.crc
    assert aligned == 2  # "big", one shard per rank


# ---------------------------------------------------------------- a rank killed mid-save

def test_killed_rank_leaves_the_old_checkpoint(tmp_path):
    """A save over an existing checkpoint writes into a temporary sibling directory, which the
    coordinator exchanges with the checkpoint directory only once every rank's data is durable:
    a rank killed mid-write leaves the old checkpoint loadable, by both readers."""
    ck = tmp_path / "ck"
    old = {"w": torch.randn(2048, 1024)}
    dcp.save(old, storage_writer=FastWriter(ck))
    assert os.path.exists(ck / ".metadata")
    before = sorted(os.listdir(ck))
    if not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    procs = _launch("kill", 2, tmp_path)

    def rank1_writing():
        for d in [ck] + [tmp_path / n for n in temps_of(tmp_path, "ck")]:
            if temps_of(d, "__1_0.distcp"):
                return d
        return None
    try:
        deadline = time.monotonic() + 120
        while rank1_writing() is None:
            assert time.monotonic() < deadline, "rank 1 never started writing"
            assert procs[1].poll() is None, procs[1].communicate()[0]
            time.sleep(0.05)
        assert rank1_writing() != ck  # into the temporary sibling, not into the checkpoint
        time.sleep(0.3)  # rank 1 is now stalled inside its second write (fault injection)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        try:
            procs[0].wait(timeout=90)  # gloo notices the dead peer
        except subprocess.TimeoutExpired:
            procs[0].kill()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode != 0
    assert sorted(os.listdir(ck)) == before  # untouched
    for reader in (FastReader(ck), dcp.FileSystemReader(ck)):
        got = {"w": torch.zeros(2048, 1024)}
        dcp.load(got, storage_reader=reader)
        assert torch.equal(got["w"], old["w"])
    # what the killed save leaves is the temporary sibling, which a cleanup removes
    assert temps_of(tmp_path, "ck", kind="dcp")


# ---------------------------------------------------------------- single process

def _various():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 300, generator=g)
    return {
        "f32": torch.randn(257, 129, generator=g),
        "bf16": torch.randn(40, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, generator=g).half(),
        "i8": torch.randint(-128, 127, (33,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (70000,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(13, generator=g) > 0.5,
        "c64": torch.randn(4, 4, dtype=torch.complex64, generator=g),
        "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "u16": torch.randint(0, 1000, (6,), generator=g).to(torch.uint16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(300, 70, generator=g).t(),       # non-contiguous
        "view": base[10:20],                                        # a view of a bigger storage
        "strided": base[:, ::3],                                     # non-contiguous view
        "param": torch.nn.Parameter(torch.randn(3, 3, generator=g)),
        "extra": {"epoch": 3, "name": "x", "list": [1, 2.5, "three"], "t": torch.arange(5)},
    }


def _zeros_like_tree(sd):
    if isinstance(sd, dict):
        return {k: _zeros_like_tree(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_zeros_like_tree(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        z = torch.zeros(sd.shape, dtype=sd.dtype)
        return z
    return type(sd)() if not isinstance(sd, (int, float)) else 0


def _assert_tree_equal(a, b, path=""):
    if isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for k in b:
            _assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tree_equal(x, y, f"{path}[{i}]")
    elif isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 and not a.dtype.is_signed else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 and not b.dtype.is_signed else b), path
    else:
        assert a == b, path


def _eq(a, b):
    # float8 has no equality kernel: compare bytes
    if a.dtype in (torch.float8_e4m3fn,):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


def _check(tgt, sd):
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert tgt[k].dtype == v.dtype and tgt[k].shape == v.shape, k
            assert _eq(tgt[k], v.detach()), k
    assert tgt["extra"]["epoch"] == 3 and tgt["extra"]["name"] == "x" and tgt["extra"]["list"] == [1, 2.5, "three"]
    assert torch.equal(tgt["extra"]["t"], torch.arange(5))


def _target(sd):
    return {k: (torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else
                {"epoch": 0, "name": "", "list": [0, 0.0, ""], "t": torch.zeros(5, dtype=torch.int64)})
            for k, v in sd.items()}


@pytest.mark.parametrize("writer", ["fast", "stock"])
@pytest.mark.parametrize("reader", ["fast", "stock"])
def test_roundtrip_single_process(tmp_path, writer, reader):
    sd = _various()
    w = FastWriter(tmp_path) if writer == "fast" else dcp.FileSystemWriter(tmp_path)
    dcp.save(sd, storage_writer=w)
    tgt = _target(sd)
    r = FastReader(tmp_path) if reader == "fast" else dcp.FileSystemReader(tmp_path)
    dcp.load(tgt, storage_reader=r)
    _check(tgt, sd)
    if reader == "fast":
        st = r.last_read_stats
        assert st["slow"] == 0, st
        assert st["verified"] == st["items"] >= 14, st  # every item, read whole and checked
    assert not temp_files(tmp_path)


def test_pickle_is_torch_saves():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e5m2, torch.uint32,
                  torch.complex128):
        for shape in ((), (0,), (3,), (2, 5, 7)):
            t = torch.zeros(shape, dtype=dtype)
            buf = io.BytesIO()
            torch.save(t, buf)
            import zipfile
            want = zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl")
            assert _blob.tensor_pickle(dtype, shape) == want, (dtype, shape)


def test_reads_only_the_needed_bytes(tmp_path):
    big = torch.randn(1024, 1024)  # 4 MiB
    dcp.save({"w": big}, storage_writer=FastWriter(tmp_path))
    # A planner that asks for rows 256..511 only, the way resharding does.
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, LoadItemType
    from torch.distributed.checkpoint.metadata import MetadataIndex

    class Rows(DefaultLoadPlanner):
        def create_local_plan(self):
            return LoadPlan([ReadItem(LoadItemType.TENSOR, MetadataIndex("w", (0, 0)), torch.Size((0, 0)),
                                      MetadataIndex("w", (0, 0)), torch.Size((256, 0)), torch.Size((256, 1024)))])

        def resolve_tensor(self, read_item):
            return self.state_dict["w"]

    tgt = {"w": torch.zeros(256, 1024)}
    r = FastReader(tmp_path)
    dcp.load(tgt, storage_reader=r, planner=Rows())
    assert torch.equal(tgt["w"], big[256:512])
    st = r.last_read_stats
    assert st["bytes_requested"] == 256 * 1024 * 4 and st["bytes_read"] < 1.1 * 1024 * 1024 + 64 * 1024, st
    assert st["verified"] == 0  # a partial read cannot be checked against the record's CRC


def test_small_records_are_read_once(tmp_path):
    """A record of up to WHOLE_READ bytes is read whole in the first round, its zip structures and
    its data together: every byte of such a checkpoint is read once, and the data of a large record
    once more than its first and last bytes (the head and tail of the first round)."""
    g = torch.Generator().manual_seed(5)

    def roundtrip(name, sd):
        dcp.save(sd, storage_writer=FastWriter(tmp_path / name))
        r = FastReader(tmp_path / name)
        tgt = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(tgt, storage_reader=r)
        assert all(torch.equal(tgt[k], sd[k]) for k in sd)
        md = FastReader(tmp_path / name).read_metadata()
        st = r.last_read_stats
        assert st["verified"] == len(sd), st
        return st, {k.fqn: v.length for k, v in md.storage_data.items()}

    small = {f"bias{i}": torch.randn(37 + 50 * i, generator=g) for i in range(40)}
    small["step"] = torch.tensor(7.0)
    st, lengths = roundtrip("small", small)
    assert max(lengths.values()) <= records.WHOLE_READ
    total = sum(lengths.values())  # the engine reads whole pages at the ends of an O_DIRECT range
    assert total <= st["bytes_read"] <= total + 2 * 4096, st

    st, lengths = roundtrip("big", {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1024, generator=g)})
    assert st["bytes_read"] <= lengths["b"] + lengths["w"] + records.HEAD_READ + _blob.TAIL_READ, st


def test_fastreader_reads_with_the_collector_paused(tmp_path, monkeypatch):
    """The metadata read and the data read run with the collector paused (fastckpt._core.gcpause)."""
    if not gc.isenabled():
        pytest.skip("the collector is off in this process")
    sd = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    dcp.save(sd, storage_writer=FastWriter(tmp_path))
    seen = []
    run = records.FileJob.run
    monkeypatch.setattr(records.FileJob, "run", lambda self: seen.append(gc.isenabled()) or run(self))
    md = FastReader(tmp_path).read_metadata()
    assert gc.isenabled() and md.storage_data
    tgt = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(tgt, storage_reader=FastReader(tmp_path))
    assert seen == [False] and gc.isenabled()
    assert all(torch.equal(tgt[k], sd[k]) for k in sd)


def test_checkpoint_id(tmp_path):
    sd = {"a": torch.arange(10.0)}
    dcp.save(sd, checkpoint_id=tmp_path / "ck", storage_writer=FastWriter(tmp_path / "unused"))
    assert not os.path.exists(tmp_path / "unused") and os.path.exists(tmp_path / "ck" / ".metadata")
    tgt = {"a": torch.zeros(10)}
    dcp.load(tgt, checkpoint_id=str(tmp_path / "ck"), storage_reader=FastReader(tmp_path / "other"))
    assert torch.equal(tgt["a"], sd["a"])
    assert FastWriter.validate_checkpoint_id(str(tmp_path / "new"))
    assert not FastWriter.validate_checkpoint_id("s3://bucket/ck")
    assert FastReader.validate_checkpoint_id(str(tmp_path / "ck"))


def test_metadata_is_stock(tmp_path):
    dcp.save({"a": torch.ones(3), "n": 1}, storage_writer=FastWriter(tmp_path))
    with open(tmp_path / ".metadata", "rb") as f:
        md = pickle.load(f)
    assert type(md) is dcp.Metadata
    assert all(type(v) is _StorageInfo for v in md.storage_data.values())
    assert md.storage_meta.checkpoint_id == tmp_path and md.version


def test_use_collectives_false(tmp_path):
    sd = {"a": torch.arange(6.0)}
    dcp.save(sd, storage_writer=FastWriter(tmp_path), use_collectives=False)
    assert sorted(os.listdir(tmp_path)) == ["__0.metadata", "__0_0.distcp"]
    for reader in (FastReader(tmp_path), dcp.FileSystemReader(tmp_path)):
        tgt = {"a": torch.zeros(6)}
        dcp.load(tgt, storage_reader=reader)
        assert torch.equal(tgt["a"], sd["a"])


def test_collective_save_replaces_rank_local_metadata(tmp_path):
    ck = tmp_path / "ck"
    dcp.save({"a": torch.arange(6.0)}, storage_writer=FastWriter(ck), use_collectives=False)
    _C.fault_inject("write", nth=1, errno=errno.EIO, path_contains="distcp")
    try:
        with pytest.raises(OSError):
            dcp_unwrapped(dcp.save, {"a": torch.zeros(6)}, storage_writer=FastWriter(ck))
    finally:
        _C.fault_clear()
    # a failed save over it leaves the old checkpoint (rank-local metadata) loadable, and no temporary
    got = {"a": torch.zeros(6)}
    dcp.load(got, storage_reader=FastReader(ck))
    assert torch.equal(got["a"], torch.arange(6.0)) and os.listdir(tmp_path) == ["ck"]
    dcp.save({"a": torch.ones(6)}, storage_writer=FastWriter(ck))
    # dcp.load would fall back to __0.metadata: it is not carried into the new checkpoint
    assert [n for n in os.listdir(ck) if n.endswith(".metadata")] == [".metadata"]
    dcp.load(got, storage_reader=FastReader(ck))
    assert torch.equal(got["a"], torch.ones(6))


def test_async_save_reuses_staging_buffers(tmp_path):
    src = {"w": torch.randn(100, 100), "b": torch.randn(100), "step": 3, "nested": {"m": torch.ones(5)}}
    w = FastWriter(tmp_path / "a")
    orig = src["w"].clone()
    fut = dcp.async_save(src, storage_writer=w)
    src["w"].add_(1)  # after async_save returned: not in the checkpoint
    fut.result()
    allocs = w.staging_allocations
    assert allocs == 1  # one arena for the three tensors
    arenas = w._stager.snapshots._free
    assert len(arenas) == 1 and arenas[0].buf.data_ptr() % 4096 == 0
    arena = arenas[0]
    fut = dcp.async_save(src, checkpoint_id=tmp_path / "b", storage_writer=w)
    fut.result()
    assert w.staging_allocations == allocs and w._stager.snapshots._free == [arena]
    for name, want in (("a", orig), ("b", src["w"])):
        tgt = {"w": torch.zeros(100, 100), "b": torch.zeros(100), "step": 0, "nested": {"m": torch.zeros(5)}}
        dcp.load(tgt, storage_reader=FastReader(tmp_path / name))
        assert torch.equal(tgt["w"], want) and torch.equal(tgt["b"], src["b"])
        assert tgt["step"] == 3 and torch.equal(tgt["nested"]["m"], torch.ones(5))


def test_async_save_writes_the_staged_copy_straight_from_its_buffers(tmp_path, monkeypatch):
    """dcp.async_save through FastWriter: the large tensors of stage()'s copy are written O_DIRECT
    straight from its arena (no copy into the engine's staging buffers), bitwise, where the files
    are written O_DIRECT; dcp.save of the caller's own tensors never lends them to the engine."""
    from engines import record_commits
    commits = record_commits(monkeypatch)
    src = {"w": torch.randn(512, 512), "v": torch.randn(3, 70001), "b": torch.randn(100), "step": 3}
    dcp.async_save(src, storage_writer=FastWriter(tmp_path / "a")).result()
    data = [st for st in commits if st["bytes"] > 1 << 20]
    assert data, commits
    if data[0]["direct"]:
        big = src["w"].nbytes + src["v"].nbytes
        assert big - 2 * 2 * 4096 <= sum(st["borrowed_bytes"] for st in data) <= big, data
    commits.clear()
    dcp.save(src, storage_writer=FastWriter(tmp_path / "b"))
    assert commits and all(st["borrowed_bytes"] == 0 for st in commits)
    for name in ("a", "b"):
        tgt = {"w": torch.zeros(512, 512), "v": torch.zeros(3, 70001), "b": torch.zeros(100), "step": 0}
        dcp.load(tgt, storage_reader=FastReader(tmp_path / name))
        assert all(torch.equal(tgt[k], src[k]) for k in ("w", "v", "b")) and tgt["step"] == 3


def test_async_save_writes_the_staged_copy_with_the_crcs_of_its_copy(tmp_path, monkeypatch):
    """The CRC-32 of each tensor of stage()'s copy was taken with the copy: the writer reads none of
    their bytes again (a strided tensor, copied by torch, has its CRC taken by the writer), and the
    records hold the right CRCs (FastReader checks them; a flipped byte fails the load). dcp.save of
    the caller's tensors computes its CRCs as it writes."""
    from fastckpt._core.atomic import AtomicFile
    summed = []
    orig = AtomicFile.write_crc

    def counting(self, t, crc, borrow=False):
        summed.append(t.numel() * t.element_size())
        return orig(self, t, crc, borrow)
    monkeypatch.setattr(AtomicFile, "write_crc", counting)
    src = {"w": torch.randn(512, 512), "v": torch.randn(3, 70001)[:, 1:], "b": torch.randn(100), "step": 3}
    dcp.async_save(src, storage_writer=FastWriter(tmp_path / "a")).result()
    # the contiguous tensors' CRCs came with their copy; the strided one's (copied by torch) is taken here
    assert summed == [src["v"].numel() * 4], summed
    summed.clear()
    dcp.save(src, storage_writer=FastWriter(tmp_path / "b"))
    assert sum(summed) == sum(t.numel() * t.element_size() for t in (src["w"], src["v"], src["b"]))
    for name in ("a", "b"):
        tgt = {"w": torch.zeros(512, 512), "v": torch.zeros(3, 70000), "b": torch.zeros(100), "step": 0}
        dcp.load(tgt, storage_reader=FastReader(tmp_path / name))
        assert all(torch.equal(tgt[k], src[k]) for k in ("w", "v", "b")) and tgt["step"] == 3
    data = max((p for p in (tmp_path / "a").iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    at = raw.find(src["w"][100].numpy().tobytes())  # inside w's record
    assert at > 0
    raw[at] ^= 1
    data.write_bytes(bytes(raw))
    tgt = {"w": torch.zeros(512, 512), "v": torch.zeros(3, 70000), "b": torch.zeros(100), "step": 0}
    with pytest.raises(FormatError, match="checksum mismatch"):
        dcp_unwrapped(dcp.load, tgt, storage_reader=FastReader(tmp_path / "a"))


def test_stage_never_overwrites_buffers_in_use():
    w = FastWriter("/nonexistent")
    a = w.stage({"x": torch.ones(4)})
    b = w.stage({"x": torch.full((4,), 2.0)})  # the first staged copy was not saved (nor dropped) yet
    assert torch.equal(a["x"], torch.ones(4)) and torch.equal(b["x"], torch.full((4,), 2.0))
    assert a["x"].data_ptr() != b["x"].data_ptr()
    del a, b  # dropped without a save: both slots are free again
    c = w.stage({"x": torch.full((4,), 3.0)})
    assert w.staging_allocations == 2 and torch.equal(c["x"], torch.full((4,), 3.0))


def test_unsupported_writer_options(tmp_path, caplog):
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    with pytest.raises(NotImplementedError, match="stream transforms"):
        FastWriter(tmp_path, _extensions=[object()])
    with pytest.raises(NotImplementedError, match="torch.save records only"):
        FastWriter(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)
    FastWriter(tmp_path, serialization_format=SerializationFormat.TORCH_SAVE, per_thread_copy_ahead=0,
               cache_staged_state_dict=False)
    with caplog.at_level("WARNING", logger="fastckpt"):
        FastWriter(tmp_path, sync_files=False)
    assert "sync_files=False is ignored" in caplog.text
    with pytest.raises(ValueError):
        FastWriter(tmp_path, thread_count=0)


def test_overwrite_false(tmp_path):
    dcp.save({"a": torch.ones(2)}, storage_writer=FastWriter(tmp_path))
    with pytest.raises(RuntimeError, match="overwrite=False"):
        dcp_unwrapped(dcp.save, {"a": torch.ones(2)}, storage_writer=FastWriter(tmp_path, overwrite=False))
    assert os.path.exists(tmp_path / ".metadata")


def test_failed_overwrite_leaves_the_old_checkpoint_and_no_files(tmp_path):
    ck = tmp_path / "ck"
    dcp.save({"a": torch.ones(300, 300)}, storage_writer=FastWriter(ck))
    dcp.save({"a": torch.ones(300, 300)}, storage_writer=FastWriter(ck))  # warm: engine, rings
    before = fd_count()
    _C.fault_inject("write", nth=1, errno=errno.ENOSPC, path_contains="distcp")  # the shard's one write
    with pytest.raises(OSError, match="No space left on device") as ei:
        dcp_unwrapped(dcp.save, {"a": torch.full((300, 300), 2.0)}, storage_writer=FastWriter(ck))
    assert ei.value.errno == errno.ENOSPC
    assert ei.value.filename == str(ck / "__0_0.distcp")  # the user's directory, not the temporary one
    assert _C.fault_fired() == 1
    assert fd_count() == before
    assert not temp_files(ck) and os.listdir(tmp_path) == ["ck"]
    # the new checkpoint was written beside the old one, which stays whole
    got = {"a": torch.zeros(300, 300)}
    dcp.load(got, storage_reader=FastReader(ck))
    assert torch.equal(got["a"], torch.ones(300, 300))


def test_metadata_write_failure_leaves_no_checkpoint(tmp_path):
    _C.fault_inject("rename", nth=1, errno=errno.EIO, path_contains=".metadata")
    with pytest.raises(OSError, match="Input/output error"):
        dcp_unwrapped(dcp.save, {"a": torch.ones(3)}, storage_writer=FastWriter(tmp_path))
    assert not os.path.exists(tmp_path / ".metadata") and not temp_files(tmp_path)


# ---------------------------------------------------------------- bad input

@pytest.fixture
def small_ckpt(tmp_path):
    sd = {"a": torch.arange(100000, dtype=torch.float32), "b": torch.arange(7, dtype=torch.int64)}
    dcp.save(sd, storage_writer=FastWriter(tmp_path / "ck"))
    return tmp_path / "ck", sd


def _load(ck, **kw):
    tgt = {"a": torch.zeros(100000), "b": torch.zeros(7, dtype=torch.int64)}
    dcp_unwrapped(dcp.load, tgt, storage_reader=FastReader(ck, **kw))
    return tgt


def _rewrite_metadata(ck, fn):
    with open(ck / ".metadata", "rb") as f:
        md = pickle.load(f)
    fn(md)
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_missing_metadata(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete DCP checkpoint"):
        FastReader(tmp_path).read_metadata()
    with pytest.raises(AssertionError, match="not a complete DCP checkpoint"):  # dcp.load's own wrapping
        dcp_unwrapped(dcp.load, {"a": torch.zeros(1)}, storage_reader=FastReader(tmp_path))


@pytest.mark.parametrize("content", [b"", b"garbage", pickle.dumps({"not": "metadata"})])
def test_corrupt_metadata(small_ckpt, content):
    ck, _ = small_ckpt
    good = (ck / ".metadata").read_bytes()
    (ck / ".metadata").write_bytes(content if content else good[:len(good) // 2])
    with pytest.raises(FormatError, match="metadata"):
        FastReader(ck).read_metadata()


def test_truncated_data_file(small_ckpt):
    ck, _ = small_ckpt
    p = ck / "__0_0.distcp"
    size = os.path.getsize(p)
    os.truncate(p, size - 100)
    before = fd_count()
    with pytest.raises(FormatError, match=r"truncated data file"):
        _load(ck)
    assert fd_count() == before


def test_missing_data_file(small_ckpt):
    ck, _ = small_ckpt
    os.unlink(ck / "__0_0.distcp")
    with pytest.raises(FileNotFoundError, match="missing"):
        _load(ck)


@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/passwd", "sub/../../outside.distcp", "", "a\0b"])
def test_relative_path_outside_the_directory(small_ckpt, rel):
    ck, _ = small_ckpt
    (ck.parent / "outside.distcp").write_bytes((ck / "__0_0.distcp").read_bytes())

    def fn(md):
        for v in md.storage_data.values():
            v.relative_path = rel
    _rewrite_metadata(ck, fn)
    with pytest.raises(FormatError, match="outside the checkpoint directory|invalid data file"):
        _load(ck)


def test_symlink_outside_the_directory(small_ckpt):
    ck, _ = small_ckpt
    outside = ck.parent / "outside.distcp"
    os.rename(ck / "__0_0.distcp", outside)
    os.symlink(outside, ck / "__0_0.distcp")
    with pytest.raises(FormatError, match="symbolic link"):
        _load(ck)


def test_not_a_regular_file(small_ckpt):
    ck, _ = small_ckpt
    os.unlink(ck / "__0_0.distcp")
    os.mkfifo(ck / "__0_0.distcp")
    with pytest.raises(FormatError, match="not a regular file"):
        _load(ck)


def test_range_outside_the_file(small_ckpt):
    ck, _ = small_ckpt

    def fn(md):
        for v in md.storage_data.values():
            v.offset += 1 << 40
    _rewrite_metadata(ck, fn)
    with pytest.raises(FormatError, match="truncated data file"):
        _load(ck)


def test_corrupt_tensor_data_is_detected(small_ckpt):
    ck, sd = small_ckpt
    md = FastReader(ck).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "a")
    p = ck / info.relative_path
    data = bytearray(p.read_bytes())
    data[info.offset + info.length - 2000] ^= 0x40  # inside the tensor bytes (before the zip tail)
    p.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="checksum mismatch"):
        _load(ck)
    tgt = _load(ck, verify=False)  # without verification the flipped bit comes through
    assert not torch.equal(tgt["a"], sd["a"]) and torch.equal(tgt["b"], sd["b"])


@pytest.mark.parametrize("writer", ["fast", "stock"])
def test_verify_by_default_with_the_crcs_of_the_reads(tmp_path, writer):
    """FastReader() verifies by default from the CRC-32s the engine computes
    during the reads: into the destination itself (a tensor bigger than a
    staging buffer, read in several requests), through a buffer (a cast or a
    non-contiguous destination). A flipped byte in any of them is a
    FormatError naming the file and the tensor; verify=False loads it."""
    g = torch.Generator().manual_seed(3)
    sd = {"big": torch.randn((5 << 20) + 3, generator=g), "cast": torch.randn(3000, generator=g),
          "strided": torch.randn(40, 30, generator=g)}
    w = FastWriter(tmp_path) if writer == "fast" else dcp.FileSystemWriter(tmp_path)
    dcp.save(sd, storage_writer=w)

    def load(**kw):
        tgt = {"big": torch.zeros_like(sd["big"]), "cast": torch.zeros(3000, dtype=torch.float64),
               "strided": torch.zeros(30, 40).t()}
        r = FastReader(tmp_path, **kw)
        dcp_unwrapped(dcp.load, tgt, storage_reader=r)
        return tgt, r.last_read_stats

    tgt, st = load()
    assert st["verified"] == 3 and st["fast"] == 3, st
    assert all(torch.equal(tgt[k], sd[k].to(tgt[k].dtype)) for k in sd)
    md = FastReader(tmp_path).read_metadata()
    for fqn in sd:
        info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
        p = tmp_path / info.relative_path
        at = info.offset + info.length - 2000 - (info.length // 3 if fqn == "big" else 0)  # in the tensor bytes
        good = p.read_bytes()
        bad = bytearray(good)
        bad[at] ^= 0x10
        p.write_bytes(bytes(bad))
        with pytest.raises(FormatError, match="checksum mismatch") as ei:
            load()
        assert f"({fqn}" in str(ei.value) and info.relative_path in str(ei.value), str(ei.value)
        tgt, st = load(verify=False)
        assert st["verified"] == 0 and not torch.equal(tgt[fqn], sd[fqn].to(tgt[fqn].dtype))
        p.write_bytes(good)


def test_verify_uses_the_crcs_of_the_reads_not_a_pass_after_them(small_ckpt, monkeypatch):
    """The records' CRC-32s come back from the engine's reads: no separate
    checksum pass over the data (which ran serially after the reads before)."""
    ck, sd = small_ckpt

    def no_pass(*a, **k):
        raise AssertionError("a CRC-32 pass after the reads")
    monkeypatch.setattr(_C, "crc32", no_pass)
    r = FastReader(ck)
    tgt = {"a": torch.zeros(100000), "b": torch.zeros(7, dtype=torch.int64)}
    dcp_unwrapped(dcp.load, tgt, storage_reader=r)
    assert torch.equal(tgt["a"], sd["a"]) and r.last_read_stats["verified"] == 2


def test_record_that_is_not_an_archive(small_ckpt):
    ck, _ = small_ckpt

    def fn(md):
        for k, v in md.storage_data.items():
            if k.fqn == "b":
                v.length = 10  # 10 bytes of the file are no torch.save archive
    _rewrite_metadata(ck, fn)
    with pytest.raises(FormatError, match="too short|no end-of-central-directory|cannot load"):
        _load(ck)


@pytest.mark.parametrize("seed", range(4))
def test_random_corruption_never_crashes(small_ckpt, seed):
    """Whatever byte of a data file is flipped, the load either returns the
    original values (an unread byte: padding, a record nobody reads) or raises
    FormatError: never another exception, never wrong data."""
    ck, sd = small_ckpt
    p = ck / "__0_0.distcp"
    good = p.read_bytes()
    md = FastReader(ck).read_metadata()
    g = torch.Generator().manual_seed(seed)
    # the structure of the small record: every byte; plus a sample of the big one
    binfo = next(v for k, v in md.storage_data.items() if k.fqn == "b")
    positions = list(range(binfo.offset, binfo.offset + binfo.length))
    positions = positions[seed::4]
    positions += torch.randint(0, len(good), (40,), generator=g).tolist()
    for pos in positions:
        data = bytearray(good)
        data[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
        p.write_bytes(bytes(data))
        try:
            tgt = _load(ck)
        except FormatError:
            continue
        assert torch.equal(tgt["a"], sd["a"]) and torch.equal(tgt["b"], sd["b"]), pos
    p.write_bytes(good)


def test_a_small_record_the_fast_path_leaves_is_loaded_from_the_first_read(tmp_path, monkeypatch):
    """A record the fast parser leaves to torch.load (here every data.pkl is reported unsupported)
    is loaded whole as before; a small one from the bytes of the first read, not read again, and
    still checked against its CRC-32 (a flipped data byte is a FormatError naming the tensor)."""
    g = torch.Generator().manual_seed(9)
    sd = {"b": torch.randn(300, generator=g), "w": torch.randn(512, 256, generator=g)}
    dcp.save(sd, storage_writer=FastWriter(tmp_path))

    def unsupported(data, where="data.pkl"):
        raise _blob.Unsupported("left to torch.load by this test")
    monkeypatch.setattr(_blob, "parse_pickle", unsupported)
    r = FastReader(tmp_path)
    tgt = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(tgt, storage_reader=r)
    assert all(torch.equal(tgt[k], sd[k]) for k in sd)
    st = r.last_read_stats
    md = FastReader(tmp_path).read_metadata()
    info = {k.fqn: v for k, v in md.storage_data.items()}
    assert st["slow"] == 2 and st["verified"] == 2, st
    assert info["b"].length <= records.WHOLE_READ < info["w"].length
    # b read once (first round), w: its head and tail, then whole
    assert st["bytes_read"] <= info["b"].length + info["w"].length + records.HEAD_READ + _blob.TAIL_READ + 2 * 4096, st
    p = tmp_path / info["b"].relative_path
    data = bytearray(p.read_bytes())
    data[info["b"].offset + info["b"].length - 1000] ^= 0x08  # in b's tensor bytes
    p.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"\(b .*checksum mismatch"):
        dcp_unwrapped(dcp.load, {k: torch.zeros_like(v) for k, v in sd.items()}, storage_reader=FastReader(tmp_path))


def test_parse_pickle_keeps_what_parsed_by_its_bytes(monkeypatch):
    """parse_pickle's results are kept by the pickle's bytes (a pure function of them): a repeated
    data.pkl is not unpickled again and its layout cannot be changed by a caller; a refusal is not
    kept (each is decided again, raising with its own message); the table stays bounded."""
    monkeypatch.setattr(_blob, "_layouts", {})
    pkl = _blob.tensor_pickle(torch.bfloat16, (4, 6))
    first = _blob.parse_pickle(pkl, "a")
    calls = []
    real = _blob._unpickle.loads
    monkeypatch.setattr(_blob._unpickle, "loads", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = _blob.parse_pickle(bytearray(pkl), "b")
    assert again == first and again.size == (4, 6) and again.dtype == torch.bfloat16 and calls == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.size = (1,)
    bad = pkl.replace(b"_rebuild_tensor_v2", b"_rebuild_tensor_v9")
    for where in ("first.distcp", "second.distcp"):
        with pytest.raises(_blob.Unsupported, match="_rebuild_tensor_v9"):
            _blob.parse_pickle(bad, where)
    assert len(calls) == 2 and list(_blob._layouts) == [pkl]
    for n in range(_blob._LAYOUTS_MAX + 10):
        _blob.parse_pickle(_blob.tensor_pickle(torch.float32, (n + 1,)))
    assert len(_blob._layouts) == _blob._LAYOUTS_MAX


def test_fuzz_zip_parser():
    """parse_tail / local_data_offset / parse_pickle on damaged and crafted bytes:
    only their own exceptions (never a MemoryError or anything else turned into
    Unsupported), and each input's peak of Python allocations (tracemalloc,
    reset per input; the C unpickler's memo table is traced) a small multiple
    of its size."""
    pytest.importorskip("hypothesis")
    import tracemalloc

    from hypothesis import given, settings, strategies as st

    import hostile_pickles as H

    blob = _blob.plan_tensor_blob(torch.float32, (3,), 0)
    rec = blob.head + torch.arange(3.0).numpy().tobytes() + blob.tail(0)
    pkl = _blob.tensor_pickle(torch.float32, (3,))
    assert _blob.parse_pickle(pkl).size == (3,)  # the fuzzing below starts from a pickle that parses

    def parse_pickle(data):
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            _blob.parse_pickle(data)
            outcome = None
        except (_blob.Unsupported, FormatError) as e:  # nothing else: a MemoryError is a failure
            outcome = e
        grown = tracemalloc.get_traced_memory()[1] - base
        assert grown <= 64 * len(data) + (2 << 20), (grown, len(data), data[:40])
        return outcome

    tracemalloc.start()
    try:
        # crafted structures: refused as damaged (FormatError), not as "unsupported", and in little memory
        for name, data in {**H.SIZE_ATTACKS, **H.AMPLIFIERS}.items():
            if name in ("deep_lists", "copying_calls"):  # nesting through the memo; a global it does not know
                continue
            assert isinstance(parse_pickle(data), FormatError), name

        @settings(max_examples=300, deadline=None)
        @given(st.binary(max_size=600), st.integers(0, len(rec)), st.integers(0, len(pkl)),
               st.sampled_from([b"r\xff\xff\xff\x7f", b"r\x00\x00\x00\x02", b"j\xff\xff\x00\x00",
                                b"\x8e\x00\x00\x00\x00\x00\x01\x00\x00", b"\x85" * 200, b"\x95\xff\xff\xff\xff\x00\x00\x00\x00"]))
        def run(junk, cut, at, trick):
            for data in (junk, rec[:cut] + junk[: len(rec) - cut], rec[cut:]):
                try:
                    index = _blob.parse_tail(data, 0, len(data), "fuzz")
                    for e in index.entries.values():
                        _blob.local_data_offset(data[e.rel_offset:e.rel_offset + 30], e, index, "fuzz")
                except (FormatError, _blob.NeedMore):
                    pass
                parse_pickle(data)
            # a valid data.pkl with a crafted opcode spliced in (huge memo index, counted size, nesting, frame)
            parse_pickle(pkl[:at] + trick + pkl[at:])
            parse_pickle(pkl[:at] + junk[:16] + pkl[at:])

        run()
    finally:
        tracemalloc.stop()


def test_fastckpt_exports():
    assert fastckpt.FastWriter is FastWriter and fastckpt.FastReader is FastReader
    with pytest.raises(AttributeError):
        fastckpt.NoSuchThing
