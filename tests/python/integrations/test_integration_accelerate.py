"""fastckpt.integrations.accelerate with a real Accelerator (CPU)."""
import copy
import errno
import os
import random
import signal
import zipfile

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'fastckpt-io[accelerate]')")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import dist_launch  # noqa: E402
import fastckpt  # noqa: E402
from fastckpt import _C  # noqa: E402
from fastckpt.integrations.accelerate import restore, use_fastckpt  # noqa: E402
from workers.accelerate_dist import Counter, assert_same  # noqa: E402
from paths import WORKERS  # noqa: E402


def setup(fast=True, seed=0, project=None, **cfg):
    AcceleratorState._reset_state(True)
    kw = {}
    if project is not None:
        kw["project_config"] = ProjectConfiguration(project_dir=str(project), **cfg)
    acc = Accelerator(cpu=True, **kw)
    if fast:
        use_fastckpt(acc)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g))
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    return acc, model, opt, sched, dl, counter


def train(acc, model, opt, sched, dl, counter, steps):
    it = iter(dl)
    for _ in range(steps):
        x, y = next(it)
        loss = torch.nn.functional.mse_loss(model(x) + 0.01 * torch.randn(y.shape), y)  # consumes the RNG too
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1


def snapshot(model, opt, sched, counter):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": copy.deepcopy(opt.state_dict()), "sched": copy.deepcopy(sched.state_dict()), "n": counter.n,
            "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())}



def written_by_fastckpt(path):
    with zipfile.ZipFile(path) as z:
        # fastckpt's zip writer records "version made by" 20 in the central directory (torch's miniz: 0);
        # the layout alone cannot tell them apart (a file of small tensors is torch.save's own layout)
        return all(i.create_version == 20 for i in z.infolist())


def test_save_state_load_state_restore_everything_bitwise(tmp_path):
    d = tmp_path / "ckpt"
    acc, *objs = setup()
    train(acc, *objs, steps=3)
    acc.save_state(str(d))
    saved = snapshot(objs[0], objs[1], objs[2], objs[4])
    train(acc, *objs, steps=2)
    reference = snapshot(objs[0], objs[1], objs[2], objs[4])

    names = sorted(os.listdir(d))
    assert names == ["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
                     "scheduler.bin"]
    assert [n for n in os.listdir(tmp_path) if n != "ckpt"] == []  # no temporary left
    from safetensors.torch import load_file
    assert torch.equal(load_file(d / "model.safetensors")["0.weight"], saved["model"]["0.weight"])
    for n in ("optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl"):
        assert written_by_fastckpt(d / n), n

    acc2, *objs2 = setup(seed=123)  # other initial weights
    random.seed(5)
    torch.manual_seed(5)
    acc2.load_state(str(d))
    assert_same(snapshot(objs2[0], objs2[1], objs2[2], objs2[4]), saved)
    train(acc2, *objs2, steps=2)
    assert_same(snapshot(objs2[0], objs2[1], objs2[2], objs2[4]), reference)


@pytest.mark.parametrize("safe", [True, False])
def test_interchangeable_with_stock_accelerate(tmp_path, safe):
    acc, *objs = setup(fast=False)
    train(acc, *objs, steps=2)
    acc.save_state(str(tmp_path / "stock"), safe_serialization=safe)
    acc.save_state.__func__  # a bound method of the class: nothing was patched globally
    fast, *objs_f = setup(fast=True)
    train(fast, *objs_f, steps=2)
    fast.save_state(str(tmp_path / "fast"), safe_serialization=safe)
    want = snapshot(objs[0], objs[1], objs[2], objs[4])
    assert sorted(os.listdir(tmp_path / "stock")) == sorted(os.listdir(tmp_path / "fast"))

    for fast_loader, src in ((True, "stock"), (False, "fast")):
        a, *o = setup(fast=fast_loader, seed=9)
        a.load_state(str(tmp_path / src))
        got = snapshot(o[0], o[1], o[2], o[4])
        got["rng"] = want["rng"] = (torch.zeros(1), 0, np.zeros(1))  # each run's RNG differs after training
        assert_same(got, want)


def test_failure_mid_save_leaves_the_previous_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    acc, *objs = setup()
    train(acc, *objs, steps=1)
    acc.save_state(str(d))
    before = {n: (d / n).read_bytes() for n in os.listdir(d)}
    train(acc, *objs, steps=1)
    _C.fault_clear()
    _C.fault_inject("write", errno=errno.ENOSPC, times=0, path_contains="optimizer")
    try:
        with pytest.raises(OSError) as ei:
            acc.save_state(str(d))
    finally:
        _C.fault_clear()
    assert ei.value.errno == errno.ENOSPC
    assert str(d) in str(ei.value)
    assert {n: (d / n).read_bytes() for n in os.listdir(d)} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory


def test_automatic_naming_rotates_after_commit_and_loads_latest(tmp_path):
    acc, *objs = setup(project=tmp_path, automatic_checkpoint_naming=True, total_limit=2)
    for _ in range(3):
        train(acc, *objs, steps=1)
        acc.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    want = snapshot(objs[0], objs[1], objs[2], objs[4])
    acc2, *objs2 = setup(seed=7, project=tmp_path, automatic_checkpoint_naming=True, total_limit=2)
    acc2.load_state()
    got = snapshot(objs2[0], objs2[1], objs2[2], objs2[4])
    assert got["n"] == 3
    got["rng"] = want["rng"]
    assert_same(got, want)


def test_restore_and_errors(tmp_path):
    acc, *objs = setup()
    assert getattr(acc.save_state, "_fastckpt", False)
    restore(acc)
    assert not getattr(acc.save_state, "_fastckpt", False)
    use_fastckpt(acc)
    with pytest.raises(ValueError, match="does not exist"):
        acc.load_state(str(tmp_path / "missing"))


@pytest.mark.parametrize("fast", [False, True], ids=["stock", "fastckpt"])
def test_save_state_arguments_as_accelerate_takes_them(tmp_path, fast):
    """Accelerate's exception types for a bad output_dir (None without automatic naming: TypeError; an
    existing file: FileExistsError naming it, the file untouched), and its return value (the directory as
    a pathlib.Path, given a str or a Path)."""
    acc, *_ = setup(fast=fast)
    with pytest.raises(TypeError):
        acc.save_state(None)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(FileExistsError) as err:
        acc.save_state(str(tmp_path / "file"))
    assert err.value.filename == str(tmp_path / "file") and (tmp_path / "file").read_bytes() == b"x"
    out = acc.save_state(tmp_path / "as_path")
    assert isinstance(out, type(tmp_path)) and out == tmp_path / "as_path"
    out = acc.save_state(str(tmp_path / "as_str"))
    assert isinstance(out, type(tmp_path)) and out == tmp_path / "as_str"



@pytest.mark.parametrize("fast", [False, True], ids=["stock", "fastckpt"])
def test_load_state_refuses_an_unknown_map_location_as_accelerate_does(tmp_path, fast):
    """The same exception type (TypeError) for the same bad argument, before anything is read;
    the accepted values load."""
    acc, model, *_ = setup(fast=fast)
    acc.save_state(str(tmp_path / "ckpt"))
    for bad in ("invalid", "cuda", torch.device("cpu")):
        with pytest.raises(TypeError, match="map location"):
            acc.load_state(str(tmp_path / "ckpt"), map_location=bad)
    for ok in (None, "cpu", "on_device"):
        acc.load_state(str(tmp_path / "ckpt"), map_location=ok)


@pytest.mark.parametrize("fast", [False, True], ids=["stock", "fastckpt"])
def test_load_state_refuses_bad_load_kwargs_as_accelerate_does(tmp_path, fast):
    """load_kwargs that Accelerate refuses (not a mapping; an argument the unpickler does not take)
    are the caller's TypeError with both, never a FormatError calling the checkpoint damaged."""
    acc, model, *_ = setup(fast=fast)
    acc.save_state(str(tmp_path / "ckpt"))
    for bad, match in (([], "mapping"), ("x", "mapping"), ({"bogus": 1}, "bogus")):
        with pytest.raises(TypeError, match=match):
            acc.load_state(str(tmp_path / "ckpt"), load_kwargs=bad)
    acc.load_state(str(tmp_path / "ckpt"), load_kwargs={"weights_only": False})


# ---------------------------------------------------------------- several processes (gloo)
DIST_WORKER = WORKERS / "accelerate_dist.py"
needs_gloo = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


@needs_gloo
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate_launch"])
def test_two_processes_save_load_resume_bitwise_failures_and_rotation(tmp_path, launcher):
    """One job of 2 processes started by torchrun or by `accelerate launch`, several checks
    (tests/support/workers/accelerate_dist.py):
    the files are stock Accelerate's (one random_states_<i>.pkl per process); bitwise resume, every
    process's RNG included, for ours read by ours, ours read by stock, stock read by ours; a failure
    on rank 1 and one on rank 0 fail the save on both ranks, the previous checkpoint unchanged and no
    temporary left; a load failure on one rank fails both; rotation after the commit and load_state()
    of the newest on both ranks."""
    r = getattr(dist_launch, launcher)(DIST_WORKER, "checks", tmp_path, timeout=400)
    assert r.returncode == 0, dist_launch.report(r)
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")] == [
        "ok same-files-as-stock", "ok ours-read-by-ours", "ok ours-read-by-stock", "ok stock-read-by-ours",
        "ok failure-on-rank-1", "ok failure-on-rank-0", "ok load-failure-on-rank-1",
        "ok rotation-and-load-latest"], dist_launch.report(r)


@needs_gloo
def test_a_process_killed_mid_save_fails_the_save_on_the_main_process(tmp_path):
    """Rank 1 is killed (SIGKILL) in the middle of a save while rank 0 waits at the barrier: rank 0
    raises (no hang) naming the checkpoint directory, which is left as the previous save wrote it, and
    removes the temporary directory."""
    rank0, rank1 = dist_launch.ranks(DIST_WORKER, "kill", tmp_path, timeout=300)
    assert rank1.returncode == -signal.SIGKILL, dist_launch.report([rank0, rank1])
    assert rank0.returncode == 0, dist_launch.report([rank0, rank1])
    assert "ok rank0-failed:" in rank0.stdout and "lost contact" in rank0.stdout, rank0.stdout
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin",
                                                     "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]
