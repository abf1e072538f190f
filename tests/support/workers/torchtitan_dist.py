"""One process of test_integration_torchtitan.py: torchtitan's own
CheckpointManager, OptimizersContainer and LRSchedulersContainer around a
small model sharded with FSDP2 (fully_shard, DTensor parameters, gloo on the
CPU) in a job of 2 processes.

Usage (under torchrun --nproc_per_node 2): python torchtitan_dist.py ROOT

Checks, each printed by rank 0 as "ok NAME" once both ranks passed it (a
failed check raises: the job exits non-zero): FastCheckpointManager's step
folders are DCP folders written by fastckpt's FastWriter (tensor bytes on
4 KiB boundaries) and purged by
keep_latest_k; torchtitan's stock CheckpointManager resumes from ours and ours
from the stock one's, bitwise against the uninterrupted run (model shards,
optimizer, LR scheduler, train state); async_mode="async" saves through
fastckpt too; a save that fails on one rank (ENOSPC) fails on both and leaves
a folder without .metadata, which load() skips (it resumes from the previous
step).
"""
import errno
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

from fastckpt import _C
from fastckpt.dcp import FastReader
from fastckpt.formats import dcp as _blob
from fastckpt.integrations.torchtitan import FastCheckpointManager

_SUPPORT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/support, for states
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)
from states import assert_same  # noqa: E402

ROOT = sys.argv[1]


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


class Job:
    def __init__(self, cls, folder, seed=0, **cfg):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4))
        fully_shard(self.model)
        self.opt = OptimizersContainer(
            OptimizersContainer.Config(implementation="for-loop", param_groups=[
                ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]),
            model_parts=[self.model])
        self.sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.opt, training_steps=20)
        self.ts = TrainState()
        cfg.setdefault("keep_latest_k", 2)
        self.ck = cls(cls.Config(enable=True, folder=folder, interval=2, last_save_model_only=False, **cfg),
                      dataloader=None, model_parts=[self.model], optimizers=self.opt, lr_schedulers=self.sched,
                      states={"train_state": self.ts}, sd_adapter=None)

    def step(self, save=True):
        g = torch.Generator().manual_seed(100 + 2 * self.ts.step + dist.get_rank())  # each rank its own batch
        loss = self.model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.ts.step += 1
        if save:
            self.ck.save(self.ts.step)

    def weights(self):
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                for k, v in self.model.state_dict().items()}



def done(name):
    dist.barrier()
    if dist.get_rank() == 0:
        print("ok", name, flush=True)


def written_by_fastckpt(folder):
    """fastckpt's FastWriter writes the stock writer's torch.save records with one difference: the bytes of a
    tensor of at least 64 KiB start on a 4 KiB boundary of the file (docs/FORMAT.md, section 2). True when every
    such tensor of this rank's shards is aligned so (the stock writer leaves them where they fall)."""
    md = FastReader(folder).read_metadata()
    seen = []
    for idx, info in md.storage_data.items():
        if not isinstance(md.state_dict_metadata[idx.fqn], dcp.metadata.TensorStorageMetadata):
            continue
        with open(os.path.join(folder, info.relative_path), "rb") as f:
            f.seek(info.offset)
            rec = f.read(info.length)
        index = _blob.parse_tail(rec[-4096:], max(0, len(rec) - 4096), len(rec), info.relative_path)
        e = index.entries["data/0"]
        if e.size >= _blob.ALIGN_MIN:
            seen.append((info.offset + _blob.local_data_offset(rec[e.rel_offset:], e, index, "x")) % 4096 == 0)
    assert seen, "no tensor of 64 KiB or more"
    return all(seen)


def main():
    dist.init_process_group("gloo")
    fast, stock = os.path.join(ROOT, "fast"), os.path.join(ROOT, "stock")
    a = Job(FastCheckpointManager, fast)
    for _ in range(4):
        a.step()
    mid = a.weights()
    for _ in range(2):
        a.step()
    a.ck.close()  # joins the purge thread
    want = a.weights()
    assert sorted(os.listdir(fast)) == ["step-4", "step-6"], os.listdir(fast)
    assert ".metadata" in os.listdir(os.path.join(fast, "step-6"))
    assert written_by_fastckpt(os.path.join(fast, "step-6"))
    done("fastckpt-step-folders-and-purge")

    s = Job(CheckpointManager, stock)
    for _ in range(4):
        s.step()
    s.ck.close()
    assert not written_by_fastckpt(os.path.join(stock, "step-4"))
    for name, cls, folder in (("ours-resumed-by-stock", CheckpointManager, fast),
                              ("stock-resumed-by-ours", FastCheckpointManager, stock),
                              ("ours-resumed-by-ours", FastCheckpointManager, fast)):
        r = Job(cls, folder, seed=5, keep_latest_k=0)
        assert r.ck.load(step=4) and r.ts.step == 4, name
        assert_same(r.weights(), mid, name, dtypes=False)
        r.step(save=False)
        r.step(save=False)
        assert_same(r.weights(), want, name, dtypes=False)
        r.ck.close()
        done(name)

    folder = os.path.join(ROOT, "async")
    b = Job(FastCheckpointManager, folder, async_mode="async")
    for _ in range(4):
        b.step()
    b.ck.maybe_wait_for_saving()
    b.ck.close()
    assert written_by_fastckpt(os.path.join(folder, "step-4"))
    r = Job(FastCheckpointManager, folder, seed=5)
    assert r.ck.load() and r.ts.step == 4
    assert_same(r.weights(), mid, "async", dtypes=False)
    r.ck.close()
    done("async-save")

    c = Job(FastCheckpointManager, fast, keep_latest_k=0)
    assert c.ck.load() and c.ts.step == 6
    c.step(save=False)
    _C.fault_clear()
    if dist.get_rank() == 1:
        _C.fault_inject("write", errno=errno.ENOSPC, times=0, path_contains="step-8")
    try:
        c.step()  # saves step 8
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        failed = e
    else:
        failed = None
    finally:
        _C.fault_clear()
    assert failed is not None, "the save of step 8 did not fail"
    assert ".metadata" not in os.listdir(os.path.join(fast, "step-8")), os.listdir(os.path.join(fast, "step-8"))
    c.ck.close()
    r = Job(FastCheckpointManager, fast, seed=5)
    assert r.ck.load() and r.ts.step == 6
    assert_same(r.weights(), want, "after a failed save", dtypes=False)
    r.ck.close()
    done("failed-save-is-skipped-by-load")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
