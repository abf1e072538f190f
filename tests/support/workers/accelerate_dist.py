"""One process of test_integration_accelerate.py's multi-process runs: a real
Accelerator (MULTI_CPU, gloo) in a job of 2 processes.

Usage: python accelerate_dist.py MODE ROOT (under torchrun, or started with
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* in the environment).

MODE "checks": several checks in one job, each printed by rank 0 as
"ok NAME" once every rank passed it (a failed check raises: the job exits
non-zero): save_state through fastckpt and stock save_state of the same state
hold the same files (one random_states_<i>.pkl per process); resume is bitwise
(model, optimizer, scheduler, registered object, every process's own RNG
states) for ours read by ours, ours read by stock, stock read by ours; a
failure on rank 1 and one on rank 0 fail the save on both ranks and leave the
previous checkpoint as it was, with no temporary left; automatic naming with
total_limit rotates after the commit and load_state() reads the newest on
every rank; a failure of load_state on one rank fails it on both.

MODE "kill": a first save, then in the second save rank 1 is killed
(SIGKILL) while rank 0 has written its files and waits: rank 0 must fail
(not hang), leave the first checkpoint as it was and remove the temporary
directory; it prints "ok rank0-failed: <error>" and exits 0.
"""
import copy
import errno
import os
import random
import signal
import sys
import time
import zipfile

import numpy as np
import torch

from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from fastckpt import _C
from fastckpt.integrations.accelerate import use_fastckpt

MODE = ROOT = None  # from the command line


class Counter:
    """An object registered with register_for_checkpointing (test_integration_accelerate.py uses it too)."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


class Run:
    def __init__(self, fast=True, seed=0, project=None, **cfg):
        kw = {}
        if project is not None:
            kw["project_config"] = ProjectConfiguration(project_dir=project, **cfg)
        self.acc = acc = Accelerator(cpu=True, **kw)
        if fast:
            use_fastckpt(acc)
        self.rank = acc.process_index
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        g = torch.Generator().manual_seed(1)
        ds = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
        # no shuffling: with several processes Accelerate shuffles with a generator of its own that no
        # save_state (stock or ours) saves, so a resumed run would see another order than the uninterrupted one
        dl = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)
        self.counter = Counter()
        acc.register_for_checkpointing(self.counter)
        self.model, self.opt, self.sched, self.dl = acc.prepare(model, opt, sched, dl)
        # every process its own RNG streams: resuming must restore each process's own
        torch.manual_seed(100 + 7 * seed + self.rank)
        random.seed(200 + self.rank)
        np.random.seed(300 + self.rank)

    def train(self, steps):
        it = iter(self.dl)
        for _ in range(steps):
            x, y = next(it)
            noise = 0.01 * torch.randn(y.shape) * (1 + random.random()) * (1 + float(np.random.rand()))
            loss = torch.nn.functional.mse_loss(self.model(x) + noise, y)
            self.acc.backward(loss)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.counter.n += 1

    def snapshot(self):
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "opt": copy.deepcopy(self.opt.state_dict()), "sched": copy.deepcopy(self.sched.state_dict()),
                "n": self.counter.n,
                "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())}


def assert_same(a, b, what=""):
    """Equal Counter snapshots: model, optimizer, scheduler, step count and the three RNG states."""
    assert a["model"].keys() == b["model"].keys(), what
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), (what, k)
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"], what
    for i, st in a["opt"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["opt"]["state"][i][k]), (what, i, k)
    assert a["sched"] == b["sched"] and a["n"] == b["n"], what
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1], (what, "rng")
    assert np.array_equal(a["rng"][2], b["rng"][2]), (what, "numpy rng")


def files(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def temporaries(d):
    return [n for n in os.listdir(d) if ".fastckpt-tmp." in n]


def written_by_fastckpt(path):
    with zipfile.ZipFile(path) as z:
        # fastckpt's zip writer records "version made by" 20 in the central directory (torch's miniz: 0);
        # the layout alone cannot tell them apart (a file of small tensors is torch.save's own layout)
        return all(i.create_version == 20 for i in z.infolist())


def done(acc, name):
    acc.wait_for_everyone()
    if acc.is_main_process:
        print("ok", name, flush=True)


def expect_failure(run, path, failing_rank, save=True):
    try:
        if save:
            run.acc.save_state(path)
        else:
            run.acc.load_state(path)
    except (OSError, RuntimeError) as e:  # the other rank's: fastckpt.errors.RanksFailed (both), naming the rank
        if run.rank == failing_rank:
            assert isinstance(e, OSError) and e.errno == errno.ENOSPC and path in str(e), repr(e)
        else:
            assert isinstance(e, RuntimeError), f"rank {run.rank}: {e!r}"
            assert f"failed on rank {failing_rank}" in str(e) and path in str(e), repr(e)
    else:
        raise AssertionError(f"rank {run.rank}: no error")


def checks():
    fast, stock = os.path.join(ROOT, "fast"), os.path.join(ROOT, "stock")
    r = Run()
    r.train(3)
    r.acc.save_state(fast)
    r.acc.save_state.__wrapped__(stock)  # Accelerate's own save_state, same state
    r.acc.wait_for_everyone()  # Accelerate's own save ends without a barrier
    saved = r.snapshot()
    r.train(2)
    ref = r.snapshot()
    names = sorted(os.listdir(fast))
    assert names == sorted(os.listdir(stock)), (names, sorted(os.listdir(stock)))
    assert names == ["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
                     "random_states_1.pkl", "scheduler.bin"], names
    assert written_by_fastckpt(os.path.join(fast, "optimizer.bin"))
    assert not written_by_fastckpt(os.path.join(stock, "optimizer.bin"))
    assert temporaries(ROOT) == []
    done(r.acc, "same-files-as-stock")

    for name, fast_loader, src in (("ours-read-by-ours", True, fast), ("ours-read-by-stock", False, fast),
                                   ("stock-read-by-ours", True, stock)):
        o = Run(fast=fast_loader, seed=9)
        o.acc.load_state(src)
        assert_same(o.snapshot(), saved, name)
        o.train(2)
        assert_same(o.snapshot(), ref, name)
        done(o.acc, name)

    before = files(fast)
    handle = None
    if r.rank == 1:
        def fail(models, weights, output_dir):
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(output_dir, "random_states_1.pkl"))
        handle = r.acc.register_save_state_pre_hook(fail)
    expect_failure(r, fast, failing_rank=1)
    if handle is not None:
        handle.remove()
    assert files(fast) == before and temporaries(ROOT) == []
    done(r.acc, "failure-on-rank-1")

    _C.fault_clear()
    if r.rank == 0:
        _C.fault_inject("write", errno=errno.ENOSPC, times=0, path_contains="optimizer")
    try:
        expect_failure(r, fast, failing_rank=0)
    finally:
        _C.fault_clear()
    assert files(fast) == before and temporaries(ROOT) == []
    done(r.acc, "failure-on-rank-0")

    if r.rank == 1:
        def fail_load(models, input_dir):
            raise OSError(errno.ENOSPC, "No space left on device", input_dir)
        handle = r.acc.register_load_state_pre_hook(fail_load)
    expect_failure(r, fast, failing_rank=1, save=False)
    if r.rank == 1:
        handle.remove()
    done(r.acc, "load-failure-on-rank-1")

    project = os.path.join(ROOT, "project")
    a = Run(project=project, automatic_checkpoint_naming=True, total_limit=2)
    for _ in range(3):
        a.train(1)
        a.acc.save_state()
    a.acc.wait_for_everyone()
    ckpts = os.path.join(project, "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["checkpoint_1", "checkpoint_2"], os.listdir(ckpts)
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(os.listdir(os.path.join(ckpts, "checkpoint_2")))
    want = a.snapshot()
    b = Run(seed=7, project=project, automatic_checkpoint_naming=True, total_limit=2)
    b.acc.load_state()
    assert_same(b.snapshot(), want, "rotation")
    done(b.acc, "rotation-and-load-latest")


def kill():
    path = os.path.join(ROOT, "ckpt")
    r = Run()
    r.train(1)
    r.acc.save_state(path)
    r.acc.wait_for_everyone()
    before = files(path)
    r.train(1)
    if r.rank == 1:
        def die(models, weights, output_dir):
            time.sleep(1.0)  # rank 0 writes the shared files meanwhile and waits at the barrier
            os.kill(os.getpid(), signal.SIGKILL)
        r.acc.register_save_state_pre_hook(die)
    try:
        r.acc.save_state(path)
    except RuntimeError as e:
        assert r.rank == 0 and path in str(e), repr(e)
        assert files(path) == before, "the previous checkpoint changed"
        assert temporaries(ROOT) == [], temporaries(ROOT)
        print("ok rank0-failed:", str(e).splitlines()[0], flush=True)
        os._exit(0)  # the process group is broken: no orderly teardown
    raise AssertionError(f"rank {r.rank}: the save succeeded")


if __name__ == "__main__":
    MODE, ROOT = sys.argv[1], sys.argv[2]
    checks() if MODE == "checks" else kill()
