"""fastckpt.integrations.transformers with a real Trainer and a tiny GPT-2 built from a config (no downloads)."""
import errno
import json
import os
import signal
import zipfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'fastckpt-io[transformers]')")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
from transformers import Trainer, TrainingArguments  # noqa: E402

import dist_launch  # noqa: E402
import fastckpt  # noqa: E402
from workers.transformers_dist import Tokens  # noqa: E402
from workers.transformers_dist import model as tiny_gpt2  # noqa: E402
from paths import WORKERS  # noqa: E402
from fastckpt import _C  # noqa: E402
from fastckpt.integrations.transformers import FastTrainer  # noqa: E402


def model():
    return tiny_gpt2(dropout=0.0)


def run(cls, out, max_steps=6, resume=None, **kw):
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2, save_strategy="steps",
                             per_device_train_batch_size=4, learning_rate=1e-2, report_to=[], use_cpu=True,
                             seed=0, data_seed=0, logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, **kw)
    t = cls(model=model(), args=args, train_dataset=Tokens(n=48))
    t.train(resume_from_checkpoint=resume)
    return t


def st_data_offset(path):
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def written_by_fastckpt(path):
    with zipfile.ZipFile(path) as z:
        # fastckpt's zip writer records "version made by" 20 in the central directory (torch's miniz: 0);
        # the layout alone cannot tell them apart (a file of small tensors is torch.save's own layout)
        return all(i.create_version == 20 for i in z.infolist())


def weights(t):
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def test_checkpoints_are_fastckpt_files_rotated_and_resume_is_exact(tmp_path):
    full = run(FastTrainer, tmp_path / "a", save_total_limit=2)
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoint-4", "checkpoint-6"]
    ck = tmp_path / "a" / "checkpoint-4"
    names = set(os.listdir(ck))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "config.json", "training_args.bin"} <= names
    assert st_data_offset(ck / "model.safetensors") % 4096 == 0  # fastckpt.safetensors' layout
    from safetensors.torch import load_file
    assert "transformer.wte.weight" in load_file(ck / "model.safetensors")
    assert written_by_fastckpt(ck / "optimizer.pt") and written_by_fastckpt(ck / "scheduler.pt")
    assert json.loads((ck / "trainer_state.json").read_text())["global_step"] == 4

    resumed = run(FastTrainer, tmp_path / "a", resume=str(ck))
    want, got = weights(full), weights(resumed)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    # the stock Trainer resumes from our checkpoint to the same weights
    stock = run(Trainer, tmp_path / "stock", resume=str(ck))
    for k, v in weights(stock).items():
        assert torch.equal(want[k], v), k


def test_resume_from_a_stock_checkpoint(tmp_path):
    stock = run(Trainer, tmp_path / "s")
    resumed = run(FastTrainer, tmp_path / "s", resume=str(tmp_path / "s" / "checkpoint-4"))
    for k, v in weights(stock).items():
        assert torch.equal(v, weights(resumed)[k]), k


def test_failure_mid_checkpoint_leaves_earlier_ones_and_no_half_directory(tmp_path):
    out = tmp_path / "o"
    _C.fault_clear()
    _C.fault_inject("write", errno=errno.ENOSPC, times=0, path_contains="optimizer")
    _C.fault_inject("write", errno=errno.ENOSPC, nth=1, times=0, path_contains="scheduler")
    # the first checkpoint fails in its optimizer file
    try:
        with pytest.raises(OSError) as ei:
            run(FastTrainer, out, max_steps=2)
    finally:
        _C.fault_clear()
    assert ei.value.errno == errno.ENOSPC
    assert str(out / "checkpoint-2") in str(ei.value)
    assert os.listdir(out) == []  # neither checkpoint-2 nor a temporary

    run(FastTrainer, out, max_steps=4)
    before = {n: (out / "checkpoint-2" / n).read_bytes() for n in os.listdir(out / "checkpoint-2")}
    _C.fault_inject("rename", errno=errno.EIO, times=0, path_contains="optimizer")
    try:
        with pytest.raises(OSError):
            run(FastTrainer, out, max_steps=6, resume=str(out / "checkpoint-4"))
    finally:
        _C.fault_clear()
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    assert {n: (out / "checkpoint-2" / n).read_bytes() for n in os.listdir(out / "checkpoint-2")} == before


# ---------------------------------------------------------------- several processes (DDP, gloo)
DIST_WORKER = WORKERS / "transformers_dist.py"
needs_gloo = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


@needs_gloo
def test_two_processes_checkpoints_resume_bitwise_and_a_failure_on_one_rank(tmp_path):
    """One torchrun job of 2 processes, several checks (tests/support/workers/transformers_dist.py):
    checkpoint-N holds the stock Trainer's files (one rng_state_<i>.pth per process) and is rotated;
    resume is bitwise against the uninterrupted run (dropout on: every process's RNG state matters)
    for ours resumed by ours, ours by the stock Trainer, the stock Trainer's by ours; a failure on
    rank 1 mid-checkpoint fails train() on both ranks with no checkpoint-4 and no temporary left."""
    r = dist_launch.torchrun(DIST_WORKER, "checks", tmp_path, timeout=500)
    assert r.returncode == 0, dist_launch.report(r)
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")] == [
        "ok checkpoints-and-rotation", "ok ours-resumed-by-ours", "ok ours-resumed-by-stock",
        "ok stock-resumed-by-ours", "ok failure-on-rank-1"], dist_launch.report(r)


@needs_gloo
def test_the_main_process_killed_mid_checkpoint(tmp_path):
    """Rank 0 is killed (SIGKILL) while writing checkpoint-4, rank 1 waiting at the barrier: rank 1's
    train() raises (no hang) naming checkpoint-4; no checkpoint-4 appears, checkpoint-2 is complete,
    and what is left is a temporary directory (that `rm` or CheckpointManager.clean_temporaries removes)."""
    rank0, rank1 = dist_launch.ranks(DIST_WORKER, "kill", tmp_path, timeout=300)
    assert rank0.returncode == -signal.SIGKILL, dist_launch.report([rank0, rank1])
    assert rank1.returncode == 0 and "ok rank1-failed:" in rank1.stdout, dist_launch.report([rank0, rank1])
    out = tmp_path / "k"
    assert [n for n in os.listdir(out) if not n.startswith(".")] == ["checkpoint-2"]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    from safetensors.torch import load_file
    assert "transformer.wte.weight" in load_file(out / "checkpoint-2" / "model.safetensors")
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt"} <= set(os.listdir(out / "checkpoint-2"))
    from fastckpt._core.tempnames import parse_temp
    assert all(parse_temp(n).is_for("checkpoint-4") for n in os.listdir(out) if n.startswith("."))
    fastckpt.CheckpointManager(out).close()  # its constructor removes temporaries of processes that are gone
    assert os.listdir(out) == ["checkpoint-2"]


class _PlainModel(torch.nn.Module):
    """Not a PreTrainedModel: the Trainer saves its state dict with safetensors' save_file."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids=None, labels=None, **kw):
        logits = self.head(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def test_weights_of_a_model_that_is_not_a_pretrained_model_go_through_fastckpt(tmp_path, monkeypatch):
    import safetensors.torch as stock
    import fastckpt.safetensors as fst
    calls = []
    real = fst.save_file
    monkeypatch.setattr(fst, "save_file", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    args = TrainingArguments(output_dir=str(tmp_path / "p"), max_steps=2, save_steps=2, save_strategy="steps",
                             per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0)
    t = FastTrainer(model=_PlainModel(), args=args, train_dataset=Tokens(n=8))
    t.train()
    path = tmp_path / "p" / "checkpoint-2" / "model.safetensors"
    assert [os.fspath(p) for p in calls] and all(str(p).endswith("model.safetensors") for p in calls), calls
    assert st_data_offset(path) % 4096 == 0  # fastckpt.safetensors' layout
    got = stock.load_file(str(path))
    for k, v in t.model.state_dict().items():
        assert torch.equal(got[k], v), k
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # outside a FastTrainer save, safetensors' own save_file is safetensors' own
    stock.save_file({"x": torch.ones(2)}, str(tmp_path / "own.safetensors"))
    assert st_data_offset(tmp_path / "own.safetensors") % 4096 != 0
