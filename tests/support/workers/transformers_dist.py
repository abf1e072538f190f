"""One process of test_integration_transformers.py's multi-process runs: a real
Trainer (DDP on the CPU, gloo) in a job of 2 processes, with a tiny GPT-2
built from a config (no downloads; dropout on, so that every process's own
RNG state matters on resume).

Usage: python transformers_dist.py MODE ROOT (under torchrun, or started with
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* in the environment).

MODE "checks": several checks in one job, printed by rank 0 as "ok NAME"
once every rank passed it (a failed check raises: the job exits non-zero):
FastTrainer's checkpoints hold what the stock Trainer's hold (one
rng_state_<i>.pth per process) and are rotated (save_total_limit); resume is
bitwise against the uninterrupted run for ours resumed by ours, ours resumed
by the stock Trainer, and the stock Trainer's resumed by ours; a failure on
rank 1 in the middle of a checkpoint fails train() on both ranks, with no
checkpoint-N and no temporary left and the earlier checkpoint as it was.

MODE "kill": rank 0 is killed (SIGKILL) while writing checkpoint-4, after
rank 1 has written its files and waits: rank 1 must fail (not hang); no
checkpoint-4 appears and checkpoint-2 is as it was. Rank 1 prints
"ok rank1-failed: <error>" and exits 0.
"""
import errno
import json
import os
import signal
import sys
import time
import zipfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from fastckpt.integrations.transformers import FastTrainer  # noqa: E402

_SUPPORT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/support, for states
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)
from states import assert_same  # noqa: E402

MODE = ROOT = None  # from the command line



class Tokens(torch.utils.data.Dataset):
    """Random token ids (the same every time); test_integration_transformers.py uses them too."""

    def __init__(self, n=32, length=16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model(dropout=0.1):
    """A tiny GPT-2 from a config (no download), the same initial weights every time."""
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def run(cls, out, max_steps=6, resume=None, **kw):
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2, save_strategy="steps",
                             per_device_train_batch_size=2, learning_rate=1e-2, report_to=[], use_cpu=True,
                             seed=0, data_seed=0, logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, ddp_find_unused_parameters=False, **kw)
    t = cls(model=model(), args=args, train_dataset=Tokens())
    t.train(resume_from_checkpoint=resume)
    return t


def weights(t):
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}



def files(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def written_by_fastckpt(path):
    with zipfile.ZipFile(path) as z:
        # fastckpt's zip writer records "version made by" 20 in the central directory (torch's miniz: 0);
        # the layout alone cannot tell them apart (a file of small tensors is torch.save's own layout)
        return all(i.create_version == 20 for i in z.infolist())


def done(name):
    dist.barrier()
    if dist.get_rank() == 0:
        print("ok", name, flush=True)


class FailingRng(FastTrainer):
    """Fails (rank 1) or dies (rank 0, "kill") while writing its RNG state at step 4."""

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        if self.state.global_step != 4:
            return
        if MODE == "kill" and self.args.process_index == 0:
            time.sleep(1.0)  # rank 1 writes its files meanwhile and waits at the barrier
            os.kill(os.getpid(), signal.SIGKILL)
        if MODE == "checks" and self.args.process_index == 1:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(output_dir, "rng_state_1.pth"))


def checks():
    a = os.path.join(ROOT, "a")
    full = run(FastTrainer, a, save_total_limit=2)
    assert sorted(os.listdir(a)) == ["checkpoint-4", "checkpoint-6"], os.listdir(a)
    ck = os.path.join(a, "checkpoint-4")
    names = set(os.listdir(ck))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
            "trainer_state.json", "config.json", "training_args.bin"} <= names, names
    assert "rng_state.pth" not in names
    assert written_by_fastckpt(os.path.join(ck, "optimizer.pt"))
    assert json.loads(open(os.path.join(ck, "trainer_state.json")).read())["global_step"] == 4
    assert [n for n in os.listdir(ROOT) if n.startswith(".")] == []
    want = weights(full)
    done("checkpoints-and-rotation")

    stock_dir = os.path.join(ROOT, "s")
    stock = run(Trainer, stock_dir)
    assert_same(weights(stock), want, "stock uninterrupted", dtypes=False)
    assert sorted(os.listdir(os.path.join(stock_dir, "checkpoint-4"))) == sorted(names)
    for name, cls, src in (("ours-resumed-by-ours", FastTrainer, ck), ("ours-resumed-by-stock", Trainer, ck),
                           ("stock-resumed-by-ours", FastTrainer, os.path.join(stock_dir, "checkpoint-4"))):
        out = os.path.join(ROOT, "r-" + name)
        assert_same(weights(run(cls, out, resume=src)), want, name, dtypes=False)
        done(name)

    f = os.path.join(ROOT, "f")
    try:
        run(FailingRng, f)
    except (OSError, RuntimeError) as e:  # the other rank's: fastckpt.errors.RanksFailed (both), naming rank 1
        if dist.get_rank() == 1:
            assert isinstance(e, OSError) and e.errno == errno.ENOSPC, repr(e)
        else:
            assert isinstance(e, RuntimeError) and "failed on rank 1" in str(e), repr(e)
        assert os.path.join(f, "checkpoint-4") in str(e), repr(e)
    else:
        raise AssertionError("train() did not fail")
    assert sorted(os.listdir(f)) == ["checkpoint-2"], os.listdir(f)
    assert json.loads(open(os.path.join(f, "checkpoint-2", "trainer_state.json")).read())["global_step"] == 2
    done("failure-on-rank-1")


def kill():
    f = os.path.join(ROOT, "k")
    try:
        run(FailingRng, f)
    except RuntimeError as e:
        assert dist.get_rank() == 1 and os.path.join(f, "checkpoint-4") in str(e), repr(e)
        left = sorted(os.listdir(f))
        from fastckpt._core.tempnames import parse_temp
        assert left[-1] == "checkpoint-2" and all(parse_temp(n).is_for("checkpoint-4") for n in left[:-1]), left
        print("ok rank1-failed:", str(e).splitlines()[0], flush=True)
        os._exit(0)  # the process group is broken: no orderly teardown
    raise AssertionError(f"rank {dist.get_rank()}: train() did not fail")


if __name__ == "__main__":
    MODE, ROOT = sys.argv[1], sys.argv[2]
    checks() if MODE == "checks" else kill()
