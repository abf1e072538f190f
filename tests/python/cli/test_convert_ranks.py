"""``fastckpt convert DCP_DIR FILE`` under torchrun (fastckpt/cli/convert_ranks.py): every rank
converts its share of a DCP checkpoint into one file. Each rank is a process of
tests/support/workers/convert_ranks_worker.py; the file must be byte-identical to the
single-process conversion's, load with stock torch.load / safetensors, and each rank must have read
(and written) only its share; a failure on any rank fails every rank and leaves the old target."""
import json
import warnings

import pytest
import torch
import torch.distributed as dist

import fastckpt.formats.archive
from fastckpt.cli.command import main as cli

from collective_ranks import leftovers
from dist_launch import ranks, torchrun
from paths import WORKERS
from states import assert_same
from workers.convert_ranks_worker import SID

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORKER = WORKERS / "convert_ranks_worker.py"
TARGETS = {"safetensors": "out.safetensors", "torch": "out.pt", "fastckpt": "out.fastckpt.pt"}


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(1 << 20, generator=g),                       # 4 MiB
        "bf": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "idx": torch.arange(5000, dtype=torch.int64),
        "layer": {"w": torch.randn(300, 17, generator=g), "b": torch.randn(17, generator=g)},
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A DCP checkpoint of _tensors() and a step count, in two data files."""
    import torch.distributed.checkpoint as dcp
    d = tmp_path_factory.mktemp("dcp") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**_tensors(), "step": 7}, storage_writer=dcp.FileSystemWriter(str(d), thread_count=2))
    return d


@pytest.fixture(scope="module")
def reference(ckpt, tmp_path_factory):
    """The single-process conversions, with the workers' serialization id."""
    out = tmp_path_factory.mktemp("ref")
    orig = fastckpt.formats.archive.new_serialization_id
    fastckpt.formats.archive.new_serialization_id = lambda: SID
    try:
        for to, name in TARGETS.items():
            assert cli(["convert", str(ckpt), str(out / name), "--to", to, "--drop-non-tensors", "-q"]) == 0
    finally:
        fastckpt.formats.archive.new_serialization_id = orig
    return out


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _run(ckpt, dst, to, world, mode="ok", extra_env=None):
    res = ranks(WORKER, ckpt, dst, to, mode, world=world, timeout=120, extra_env=extra_env)
    reports = []
    for r in res:
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")), None)
        reports.append(json.loads(line.split(" ", 1)[1]) if line else None)
    return res, reports


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("to", ["safetensors", "torch", "fastckpt"])
def test_ranks_write_the_single_process_conversion(tmp_path, ckpt, reference, to, world):
    dst = tmp_path / TARGETS[to]
    res, reports = _run(ckpt, dst, to, world)
    for r, (p, rep) in enumerate(zip(res, reports)):
        assert p.returncode == 0 and rep and rep["rc"] == 0, f"rank {r}: {p.stdout[-3000:]}{p.stderr[-3000:]}"
    got = dst.read_bytes()
    assert got == (reference / TARGETS[to]).read_bytes()
    assert leftovers(tmp_path) == []
    expected = _tensors()
    if to != "safetensors":
        assert_same({**expected, "step": 7}, torch.load(dst, weights_only=True))
    else:
        st = pytest.importorskip("safetensors.torch")
        assert_same(_flat(expected), st.load_file(dst))
    # Each tensor was read by exactly one rank; a rank read only its share (the 4 MiB tensor is one).
    total = sum(t.numel() * t.element_size() for t in _flat(expected).values())
    assert sum(rep["read"] for rep in reports) == total, reports
    assert sum(rep["tensors"] for rep in reports) == sum(1 for t in _flat(expected).values() if t.numel()), reports
    if world > 1:
        assert max(rep["read"] for rep in reports) <= (4 << 20), reports
        assert sorted(rep["read"] for rep in reports)[0] < total // 4, reports
        wrote = [rep["write_bytes"] for rep in reports]
        if sum(wrote) >= len(got) // 2:  # /proc/self/io counts this filesystem's writes
            for rep in reports:  # its tensors' bytes, and rank 0 the header / zip records besides
                assert rep["write_bytes"] <= rep["read"] + (256 << 10), reports
            assert sum(wrote) <= 1.3 * len(got) + world * (64 << 10), wrote


def test_a_rank_killed_in_the_conversion_fails_every_rank_and_leaves_the_old_file(tmp_path, ckpt):
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"previous")
    res, reports = _run(ckpt, dst, "safetensors", 3, "kill")
    assert res[1].returncode != 0  # SIGKILLed
    for r in (0, 2):
        assert reports[r] and reports[r]["rc"] == 1, res[r].stdout + res[r].stderr
        assert "error:" in res[r].stderr and str(dst) in res[r].stderr, res[r].stderr
    assert dst.read_bytes() == b"previous"
    assert leftovers(tmp_path) == []


def test_a_missing_data_file_fails_every_rank_and_leaves_the_old_file(tmp_path, ckpt):
    import shutil
    src = tmp_path / "ckpt"
    shutil.copytree(ckpt, src)
    data = sorted(src.glob("*.distcp"))
    assert len(data) == 2
    data[-1].unlink()
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"previous")
    res, reports = _run(src, dst, "torch", 2)
    for r in range(2):
        assert res[r].returncode == 0 and reports[r] and reports[r]["rc"] == 1, res[r].stdout + res[r].stderr
        assert "error:" in res[r].stderr, res[r].stderr
    assert any(str(data[-1].name) in p.stderr for p in res), [p.stderr for p in res]
    assert dst.read_bytes() == b"previous"
    assert leftovers(tmp_path) == []


def test_the_documented_command_line(tmp_path, ckpt, reference):
    """``torchrun --standalone --nproc_per_node 2 -m fastckpt convert DCP_DIR out.safetensors`` (docs/CLI.md)."""
    dst = tmp_path / "out.safetensors"
    r = torchrun("-m", "fastckpt", "convert", ckpt, dst, "--drop-non-tensors", nproc=2, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0 of 2" in r.stdout and "rank 1 of 2" in r.stdout, r.stdout
    assert dst.read_bytes() == (reference / "out.safetensors").read_bytes()  # (safetensors: no random id)
    assert leftovers(tmp_path) == []


def test_a_rank_holds_one_tensor_at_a_time(tmp_path):
    """Each rank's peak RSS grows by about one tensor (8 MiB here), not with its share of the
    checkpoint: converting 16 tensors instead of 4 (a share of 64 MiB instead of 16) adds less
    than a tensor's worth of peak RSS (the rest is the same in both: imports, the group, buffers)."""
    import torch.distributed.checkpoint as dcp
    grown = {}
    for count in (4, 16):
        src = tmp_path / f"dcp{count}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({f"t{i}": torch.full((2 << 20,), float(i)) for i in range(count)}, checkpoint_id=str(src))
        res, reports = _run(src, tmp_path / f"out{count}.safetensors", "safetensors", 2,
                            extra_env={"FASTCKPT_BUFFER_SIZE": "1M", "FASTCKPT_BUFFER_COUNT": "4"})
        assert all(rep and rep["rc"] == 0 for rep in reports), [r.stdout + r.stderr for r in res]
        if any(rep["grown"] is None for rep in reports):
            pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
        assert [rep["read"] for rep in reports] == [count * (4 << 20)] * 2, reports
        grown[count] = max(rep["grown"] for rep in reports)
    assert grown[16] - grown[4] < 8 << 20, grown


def test_under_torchrun_only_a_dcp_directory_to_a_file_is_converted(tmp_path, ckpt, monkeypatch, capsys):
    """Refused before any process group is joined: a DCP target, and a source that is not DCP."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli(["convert", str(ckpt), str(tmp_path / "out.dcp"), "--to", "dcp"]) == 2
    assert "not a DCP directory" in capsys.readouterr().err
    f = tmp_path / "in.pt"
    torch.save({"a": torch.ones(3)}, f)
    assert cli(["convert", str(f), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert str(f) in err and "reads a DCP directory" in err, err
    assert not (tmp_path / "out.safetensors").exists() and not dist.is_initialized()
