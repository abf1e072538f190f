"""A Lightning job of 2 processes on the CPU (gloo) whose checkpoints go through
fastckpt's plugin: test_integration_lightning.py's multi-process runs.

Usage: python lightning_ddp.py ROOT STRATEGY PLUGIN
  STRATEGY: "ddp" (Lightning starts the second process by running this script
  again) or "ddp_spawn" (it spawns both); PLUGIN: "sync" (FastCheckpointIO) or
  "async" (AsyncFastCheckpointIO).

Three fits: A, 3 epochs from scratch with a checkpoint at every epoch (and
last.ckpt); B, the same from A's epoch=0 checkpoint (fit(ckpt_path=...)); C (with
the script launcher, "ddp", and the synchronous plugin only), the stock plugin's 3
epochs. Rank 0 checks and prints "ok NAME" for each check:
every checkpoint is a fastckpt file; B ends bitwise where A ended (model,
optimizer, scheduler); A ends where the stock run ends; a stock torch.load reads
A's checkpoints; no temporary is left.
"""
import faulthandler
import os
import sys
import zipfile

import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from fastckpt.integrations.lightning import AsyncFastCheckpointIO, FastCheckpointIO

# Every thread's Python stack on a fatal signal (an abort at exit says where it came from); the
# children ddp_spawn starts import this module too.
faulthandler.enable(all_threads=True)


class Tiny(pl.LightningModule):
    def __init__(self, width=32):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def data():
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)


def fit(root, strategy, plugin, name, ckpt_path=None):
    pl.seed_everything(0, workers=True)
    cb = ModelCheckpoint(dirpath=os.path.join(root, name), save_top_k=-1, every_n_epochs=1, save_last=True,
                         filename="{epoch}")
    t = pl.Trainer(max_epochs=3, accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin], callbacks=[cb],
                   logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   deterministic=True)
    model = Tiny()
    t.fit(model, data(), ckpt_path=ckpt_path)
    return t, model


def state_of(path):
    return torch.load(path, map_location="cpu", weights_only=True)  # the stock reader


def written_by_fastckpt(path):
    with zipfile.ZipFile(path) as z:
        return all(i.create_version == 20 for i in z.infolist())  # torch's miniz writes 0


def same(a, b, where):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a.keys(), b.keys())
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def main():
    root, strategy, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    make = {"sync": FastCheckpointIO, "async": AsyncFastCheckpointIO}[mode]
    ta, _ = fit(root, strategy, make(), "a")
    tb, _ = fit(root, strategy, make(), "b", ckpt_path=os.path.join(root, "a", "epoch=0.ckpt"))
    # The stock run once, with the script launcher ("ddp") and the synchronous plugin: under "ddp_spawn"
    # each fit spawns its ranks afresh (torch and Lightning imported again); neither the launcher nor
    # the plugin changes the state trained, so one comparison with the stock run is enough.
    stock = (strategy, mode) == ("ddp", "sync")
    if stock:
        fit(root, strategy, TorchCheckpointIO(), "c")
    if ta.global_rank != 0:
        return
    a_dir = os.path.join(root, "a")
    names = sorted(os.listdir(a_dir))
    assert names == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"], names
    assert all(written_by_fastckpt(os.path.join(a_dir, n)) for n in names), names
    print("ok fastckpt-files", flush=True)
    a_last, b_last = (state_of(os.path.join(root, d, "last.ckpt")) for d in "ab")
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "epoch", "global_step"):
        same(b_last[key], a_last[key], f"resumed.{key}")
    print("ok resume-bitwise", flush=True)
    if stock:
        c_last = state_of(os.path.join(root, "c", "last.ckpt"))
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "epoch", "global_step"):
            same(a_last[key], c_last[key], f"stock.{key}")
        print("ok same-as-stock", flush=True)
    for d in "ab":
        left = [n for n in os.listdir(os.path.join(root, d)) if n.startswith(".")]
        assert not left, left
    print("ok no-temporaries", flush=True)


if __name__ == "__main__":
    main()
