"""Full-size files from sharded state: ``fastckpt.save(state, path, group=pg)`` with
DTensors (fastckpt/collective/full.py). Every rank is a process of
tests/support/workers/full_save_worker.py on a CPU gloo mesh; the file must be
the bytes a single-process save of the gathered state writes, load with stock
torch.load as full tensors, and have been written about 1/W by each rank."""
import errno
import json
import os

import pytest
import torch
import torch.distributed as dist

import fastckpt

from collective_ranks import leftovers
from dist_launch import ranks
from paths import WORKERS
from states import assert_same

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORKER = WORKERS / "full_save_worker.py"


def _tensor_types(obj) -> set:
    if isinstance(obj, dict):
        return set().union(*map(_tensor_types, obj.values())) if obj else set()
    if isinstance(obj, (list, tuple)):
        return set().union(*map(_tensor_types, obj)) if obj else set()
    return {type(obj)} if torch.is_tensor(obj) else set()


def _run(tmp_path, case, world, mode="ok"):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    res = ranks(WORKER, case, out, mode, world=world, timeout=240)
    lines = [next((ln for ln in r.stdout.splitlines() if ln.startswith(("REPORT ", "ERR "))), None) for r in res]
    return out, res, lines


@pytest.mark.parametrize("case,world", [("tp", 1), ("tp", 2), ("fsdp", 2), ("fsdp", 3), ("2d", 4)])
def test_every_rank_writes_the_gathered_states_file(tmp_path, case, world):
    out, res, lines = _run(tmp_path, case, world)
    for r, (p, line) in enumerate(zip(res, lines)):
        assert p.returncode == 0 and line and line.startswith("REPORT "), f"rank {r}: {p.stdout[-3000:]}{p.stderr[-3000:]}"
    got = (out / "full.pt").read_bytes()
    assert got == (out / "ref.pt").read_bytes()  # what fastckpt.save of the gathered state writes, byte for byte
    assert leftovers(out) == []
    expected = torch.load(out / "full.expected", weights_only=True)
    stock = torch.load(out / "full.pt", weights_only=True)  # stock torch: plain full tensors
    assert_same(expected, stock)
    assert _tensor_types(stock) == {torch.Tensor}
    assert_same(expected, fastckpt.load(out / "full.pt", verify=True))
    if case != "fsdp":
        assert stock["tied"] is stock["tied_again"]  # one DTensor, one record
        assert torch.equal(stock["partial"], torch.full((4, 3), float(world)))  # Partial: the reduced sum
    # The safetensors file and the sharded set: the single-process files, byte for byte.
    assert (out / "full.safetensors").read_bytes() == (out / "ref.safetensors").read_bytes()
    names = sorted(p.name for p in (out / "ref_hf").iterdir())
    assert sorted(p.name for p in (out / "hf").iterdir()) == names and (len(names) > 2 or world == 1 or case != "tp")
    for n in names:
        assert (out / "hf" / n).read_bytes() == (out / "ref_hf" / n).read_bytes(), n
    st = pytest.importorskip("safetensors.torch")
    flat = expected["model"] if case == "fsdp" else {k: v for k, v in expected.items()
                                                     if torch.is_tensor(v) and k != "tied_again"}
    assert_same(flat, st.load_file(out / "full.safetensors"))
    # Each rank wrote about 1/W of the file, and all of them together the file once.
    reports = [json.loads(line.split(" ", 1)[1]) for line in lines]
    wrote = [rep["write_bytes"] for rep in reports]
    if sum(wrote) < len(got) // 2:
        pytest.skip(f"/proc/self/io does not count this filesystem's writes (write_bytes {wrote})")
    if case in ("tp", "2d"):  # the 8 MiB tensor dominates: a per-rank bound is meaningful
        assert max(wrote) <= 1.2 * len(got) / world + (256 << 10), (wrote, len(got))
        st_size = (out / "full.safetensors").stat().st_size
        assert max(rep["st_write_bytes"] for rep in reports) <= 1.2 * st_size / world + (256 << 10), reports
    assert sum(wrote) <= 1.3 * len(got) + world * (64 << 10), (wrote, len(got))


def test_a_rank_killed_in_the_save_leaves_the_previous_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "full.pt").write_bytes(b"previous")
    out, res, lines = _run(tmp_path, "tp", 3, "kill")
    assert res[1].returncode != 0  # SIGKILLed
    for r in (0, 2):
        assert lines[r] and lines[r].startswith("ERR RanksFailed") and str(out / "full.pt") in lines[r], res[r].stdout
    assert (out / "full.pt").read_bytes() == b"previous"
    assert leftovers(out) == []


def test_ranks_whose_replicated_values_differ_raise_and_write_nothing(tmp_path):
    out, res, lines = _run(tmp_path, "tp", 2, "differ")
    for r, line in enumerate(lines):
        assert line and line.startswith("ERR ValueError: ") and "ranks hold different data" in line, res[r].stdout
    assert not (out / "full.pt").exists() and leftovers(out) == []


def test_a_strided_shard_is_refused_naming_the_tensor(tmp_path):
    out, res, lines = _run(tmp_path, "strided", 2)
    for r, line in enumerate(lines):
        assert line and line.startswith("ERR ValueError: ") and "'w'" in line and "_StridedShard" in line, res[r].stdout
    assert not (out / "full.pt").exists()


@pytest.mark.parametrize("mode,errname", [("eio1", "EIO"), ("enospc0", "ENOSPC"), ("rename0", "EIO")])
def test_an_engine_fault_on_one_rank_fails_every_rank_and_keeps_the_previous_file(tmp_path, mode, errname):
    out = tmp_path / "out"
    out.mkdir()
    (out / "full.pt").write_bytes(b"previous")
    out, res, lines = _run(tmp_path, "tp", 2, mode)
    for r, line in enumerate(lines):
        assert res[r].returncode == 0 and line and line.startswith("ERR "), res[r].stdout[-3000:]
        assert str(out / "full.pt") in line, line
    faulty = {"eio1": 1, "enospc0": 0, "rename0": 0}[mode]
    assert errname in lines[faulty] or os.strerror(getattr(errno, errname)) in lines[faulty], lines[faulty]
    assert (out / "full.pt").read_bytes() == b"previous"
    assert leftovers(out) == []
