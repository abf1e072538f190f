"""A save in progress, or one a crash interrupted, leaves a temporary beside
the checkpoints; tools that find checkpoints by scanning a directory for names
(Lightning's ``hpc_ckpt_`` and ``last`` scans, the Trainer's ``checkpoint-``,
torchtitan's ``step-``, DeepSpeed's ``global_step`` tags, the globs users
write, fastckpt's own manager) must never take it for a checkpoint."""

import glob
import os
import re
import signal
import sys
import textwrap
import time
import types

import pytest
import torch

import fastckpt
from fastckpt import _C
from fastckpt._core.dircommit import new_directory
from fastckpt._core.tempnames import parse_temp

import fastspawn
from leaks import temp_files, temps_of

TARGETS = ["hpc_ckpt_2.ckpt", "last.ckpt", "last-v1.ckpt", "epoch=3-step=40.ckpt", "checkpoint-500", "step-10",
           "global_step7", "checkpoint_9", "step_00000042.pt", "model.safetensors"]


@pytest.fixture
def folder(tmp_path):
    """Real checkpoints (the lower numbers) and, beside them, the temporaries of saves of higher
    ones in progress or interrupted: a Writer's file and a directory commit's new copy for each."""
    d = tmp_path / "ckpts"
    d.mkdir()
    for name in ["hpc_ckpt_1.ckpt", "last.ckpt", "epoch=1-step=20.ckpt"]:
        fastckpt.save({"w": torch.ones(2)}, d / name)
    for name in ["checkpoint-100", "step-5", "global_step3"]:
        (d / name).mkdir()
        (d / name / ".metadata").write_bytes(b"m")
    for t in TARGETS:
        (d / _C.temp_name(t)).write_bytes(b"partial")  # the engine's name for a Writer's file of t
        tmp = new_directory(d / t)
        with open(os.path.join(tmp, ".metadata"), "wb") as f:  # as complete inside as a torn save can be
            f.write(b"m")
    assert len(temp_files(d)) == 2 * len(TARGETS)
    return d


def test_temporaries_spell_no_name_a_scan_looks_for(folder):
    for n in temp_files(folder):
        t = parse_temp(n)
        assert t is not None and t.target in TARGETS, n
        assert n.startswith(".fastckpt-tmp.x")
        for word in ("hpc_ckpt_", "last", "epoch=", "checkpoint", "step", "global_step", "model", "ckpt_"):
            assert word not in n, (word, n)


def test_lightning_scans_find_only_checkpoints(folder):
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    max_version = getattr(_CheckpointConnector, "_CheckpointConnector__max_ckpt_version_in_folder")
    assert max_version(str(folder), "hpc_ckpt_") == 1  # what fit(ckpt_path="hpc") resumes from
    assert max_version(str(folder), "ckpt_") == 1
    mc = ModelCheckpoint(dirpath=str(folder))
    trainer = types.SimpleNamespace()
    mc._ModelCheckpoint__resolve_ckpt_dir = lambda _t: str(folder)
    assert {os.path.basename(p) for p in mc._find_last_checkpoints(trainer)} == {"last.ckpt"}


def test_transformers_scans_find_only_checkpoints(folder):
    pytest.importorskip("transformers")
    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints
    assert get_last_checkpoint(str(folder)) == str(folder / "checkpoint-100")
    assert [os.path.basename(p) for p in sort_checkpoints(str(folder))] == ["checkpoint-100"]


def test_torchtitan_scan_finds_only_checkpoints(folder):
    pytest.importorskip("torchtitan")
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    me = types.SimpleNamespace(folder=str(folder))
    assert CheckpointManager._find_load_step(me, str(folder)) == 5


def test_plain_globs_and_substring_scans_find_only_checkpoints(folder):
    names = os.listdir(folder)
    assert sorted(os.path.basename(p) for p in glob.glob(str(folder / "*.ckpt"))) == [
        "epoch=1-step=20.ckpt", "hpc_ckpt_1.ckpt", "last.ckpt"]
    assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-100"]
    for word, want in [("hpc_ckpt_", {"hpc_ckpt_1.ckpt"}), ("last", {"last.ckpt"}), ("epoch=", {"epoch=1-step=20.ckpt"}),
                       ("checkpoint-", {"checkpoint-100"}), ("global_step", {"global_step3"})]:
        assert {n for n in names if word in n} == want, word
    assert {n for n in names if re.search(r"step-(\d+)", n)} == {"step-5"}
    assert {n for n in names if re.search(r"global_step(\d+)", n)} == {"global_step3"}


def test_the_managers_listing_skips_temporaries_of_steps(tmp_path):
    mgr = fastckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"w": torch.ones(2)})
    w = _C.Writer(fastckpt.get_engine(), str(tmp_path / mgr.name_for(2)))
    w.write(b"partial")
    new_directory(tmp_path / "step_00000003")
    try:
        assert mgr.steps() == [1]
        assert mgr.load_latest().step == 1
    finally:
        w.abort()
        mgr.close()


_KILLED_SAVE = textwrap.dedent("""
    import sys, torch
    from fastckpt import _C
    from fastckpt.integrations.lightning import FastCheckpointIO
    _C.fault_inject("write", nth=1, delay_ms=60000, times=0, path_contains="hpc_ckpt_2")
    ckpt = {"state_dict": {"w": torch.randn(1 << 20)}, "epoch": 5, "global_step": 99}
    FastCheckpointIO().save_checkpoint(ckpt, sys.argv[1])  # stalls in its first write: killed there
""")


def test_lightning_hpc_resume_after_a_save_killed_mid_write(tmp_path):
    """Lightning's SLURM requeue resumes with fit(ckpt_path="hpc") from the highest hpc_ckpt_<n>
    in default_root_dir. A FastCheckpointIO save of hpc_ckpt_2 killed mid-write leaves its
    temporary file beside the intact hpc_ckpt_1: the resume must take hpc_ckpt_1 (the stock
    plugin's, which leaves nothing), not parse a version out of the temporary's name."""
    pl = pytest.importorskip("lightning.pytorch")
    from fastckpt.integrations.lightning import FastCheckpointIO
    from test_integration_lightning import Tiny, loaders

    def make_trainer(max_epochs):
        return pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, plugins=[FastCheckpointIO()],
                          default_root_dir=str(tmp_path), enable_checkpointing=False, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)

    torch.manual_seed(0)
    t1 = make_trainer(1)
    t1.fit(Tiny(), *loaders())
    t1.save_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")
    child = fastspawn.Popen([sys.executable, "-c", _KILLED_SAVE, str(tmp_path / "hpc_ckpt_2.ckpt")])
    deadline = time.monotonic() + 60
    while not temps_of(tmp_path, "hpc_ckpt_2.ckpt"):
        assert child.poll() is None and time.monotonic() < deadline, "the save never started writing"
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not (tmp_path / "hpc_ckpt_2.ckpt").exists() and temps_of(tmp_path, "hpc_ckpt_2.ckpt")

    t2 = make_trainer(2)
    model = Tiny()
    t2.fit(model, *loaders(), ckpt_path="hpc")  # FileNotFoundError for a bogus version before
    assert t2.ckpt_path == str(tmp_path / "hpc_ckpt_1.ckpt")
    assert t2.current_epoch == 2 and t2.global_step == 2 * t1.global_step
