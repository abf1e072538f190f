"""fastckpt.integrations.lightning with a real Lightning Trainer and Fabric (CPU)."""
import copy
import errno
import logging
import os
import pickle
import subprocess
import sys
import threading
import zipfile

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install 'fastckpt-io[lightning]')")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt import _C  # noqa: E402
import fastckpt.integrations.lightning as lightning_mod  # noqa: E402
from fastckpt.integrations.lightning import AsyncFastCheckpointIO, FastCheckpointIO  # noqa: E402

import fastspawn  # noqa: E402
from leaks import temp_files  # noqa: E402


def written_by_fastckpt(path):
    """A fastckpt.save archive: "version made by" 20 in its central directory
    (torch's miniz writes 0), and its large storages on 4 KiB boundaries."""
    with zipfile.ZipFile(path) as z:
        if not all(i.create_version == 20 for i in z.infolist()):
            return False
        with open(path, "rb") as f:
            for i in z.infolist():
                if "/data/" in i.filename and i.file_size >= 65536:
                    f.seek(i.header_offset + 26)
                    n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                    if (i.header_offset + 30 + n + m) % 4096:
                        return False
    return True


class Tiny(pl.LightningModule):
    def __init__(self, width=128, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))
        self.log("score", float(self.current_epoch))  # grows: top-k by "max" keeps replacing files

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def loaders(width=128):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, width, generator=g)
    y = torch.randn(64, 1, generator=g)
    ds = torch.utils.data.TensorDataset(x, y)
    return (torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False),
            torch.utils.data.DataLoader(ds, batch_size=32, shuffle=False))


def trainer(plugin, max_epochs, callbacks=()):
    return pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, plugins=[plugin] if plugin else None,
                      callbacks=list(callbacks), enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                      logger=False,
                      enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)


def fit(plugin, max_epochs, ckpt_dir=None, ckpt_path=None, **mc):
    torch.manual_seed(0)
    model = Tiny()
    cbs = [ModelCheckpoint(dirpath=ckpt_dir, **mc)] if ckpt_dir else []
    t = trainer(plugin, max_epochs, cbs)
    train, val = loaders()
    t.fit(model, train, val, ckpt_path=ckpt_path)
    return t, model


def assert_same_state(a: pl.Trainer, b: pl.Trainer):
    sa, sb = a.lightning_module.state_dict(), b.lightning_module.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = a.optimizers[0].state_dict(), b.optimizers[0].state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)
    assert a.lr_scheduler_configs[0].scheduler.state_dict() == b.lr_scheduler_configs[0].scheduler.state_dict()


@pytest.mark.parametrize("plugin_cls", [FastCheckpointIO, AsyncFastCheckpointIO])
def test_trainer_top_k_files_are_fastckpt_files_and_resume_is_exact(tmp_path, plugin_cls):
    ckdir = tmp_path / "ck"
    t, _ = fit(plugin_cls(), 5, ckdir, monitor="score", mode="max", save_top_k=2, save_last=True,
               filename="{epoch}")
    # score grows by epoch: top-2 by "max" are the last two epochs; stale ones were removed
    assert sorted(os.listdir(ckdir)) == ["epoch=3.ckpt", "epoch=4.ckpt", "last.ckpt"]
    assert temp_files(ckdir) == []
    for name in os.listdir(ckdir):
        p = ckdir / name
        assert written_by_fastckpt(p), name
        ck = torch.load(p, weights_only=False)  # torch reads them unchanged
        assert ck["epoch"] in (3, 4) and "optimizer_states" in ck and ck["hyper_parameters"]["width"] == 128
        assert fastckpt.load(p, weights_only=False)["global_step"] == ck["global_step"]
    r = fastspawn.run([sys.executable, "-m", "fastckpt", "verify", str(ckdir / "last.ckpt")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

    # interrupted at epoch 3 (checkpoint of epoch index 2), resumed to 5 epochs == uninterrupted 5 epochs
    ckdir2 = tmp_path / "ck2"
    fit(plugin_cls(), 3, ckdir2, save_top_k=-1, filename="{epoch}")
    resumed, _ = fit(plugin_cls(), 5, ckpt_path=str(ckdir2 / "epoch=2.ckpt"))
    assert resumed.current_epoch == t.current_epoch and resumed.global_step == t.global_step
    assert_same_state(resumed, t)


def test_checkpoints_are_interchangeable_with_the_default_plugin(tmp_path):
    fit(None, 2, tmp_path / "stock", save_top_k=-1, filename="{epoch}")
    fit(FastCheckpointIO(), 2, tmp_path / "fast", save_top_k=-1, filename="{epoch}")
    a, _ = fit(FastCheckpointIO(), 3, ckpt_path=str(tmp_path / "stock" / "epoch=1.ckpt"))
    b, _ = fit(None, 3, ckpt_path=str(tmp_path / "fast" / "epoch=1.ckpt"))
    assert not written_by_fastckpt(tmp_path / "stock" / "epoch=1.ckpt")
    assert_same_state(a, b)


def test_weights_only_is_honoured(tmp_path):
    p = tmp_path / "x.ckpt"
    io = FastCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "odd": zipfile.ZipInfo("x")}, p)
    with pytest.raises(Exception, match="weights_only|Weights only|WeightsUnpickler"):
        io.load_checkpoint(p)  # None means what it means to torch.load: weights only
    with pytest.raises(Exception, match="weights_only|Weights only|WeightsUnpickler"):
        io.load_checkpoint(p, weights_only=True)
    assert io.load_checkpoint(p, weights_only=False)["odd"].filename == "x"


def test_errors_name_the_users_path(tmp_path):
    io = FastCheckpointIO()
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found") as ei:
        io.load_checkpoint(tmp_path / "missing.ckpt")
    assert ei.value.filename == str(tmp_path / "missing.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "a.ckpt", storage_options={"x": 1})
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(IsADirectoryError) as ei:
        io.save_checkpoint({"a": torch.ones(1)}, tmp_path / "dir.ckpt")
    assert str(tmp_path / "dir.ckpt") in str(ei.value)
    strict = FastCheckpointIO(urls="error")
    for call in (lambda: strict.save_checkpoint({}, "s3://b/x.ckpt"), lambda: strict.load_checkpoint("s3://b/x.ckpt"),
                 lambda: strict.remove_checkpoint("s3://b/x.ckpt")):
        with pytest.raises(fastckpt.UnsupportedURLError, match="s3://b/x.ckpt"):
            call()
    with pytest.raises(ValueError, match="urls"):
        FastCheckpointIO(urls="s3")


@pytest.mark.parametrize("cls", ["FastCheckpointIO", "AsyncFastCheckpointIO"])
def test_a_drop_in_for_torch_checkpoint_io_urls_included(tmp_path, cls, caplog):
    """The plugins are TorchCheckpointIO subclasses (Lightning's own tests and users' code check
    isinstance); a URL is TorchCheckpointIO's (fsspec, as without the plugin; logged once), a local path
    fastckpt's. Before: not a TorchCheckpointIO, and every URL raised UnsupportedURLError."""
    from lightning.pytorch.plugins import TorchCheckpointIO
    io = getattr(lightning_mod, cls)()
    assert isinstance(io, TorchCheckpointIO)
    url = f"memory://fastckpt-test-{cls}/{tmp_path.name}/x.ckpt"
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        io.save_checkpoint({"w": torch.arange(4.0)}, url)
        io.save_checkpoint({"w": torch.arange(5.0)}, url)
    assert sum("is a URL" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(io.load_checkpoint(url)["w"], torch.arange(5.0))
    io.remove_checkpoint(url)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(url)
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "local.ckpt")
    if hasattr(io, "wait"):
        io.wait()
    assert fastckpt.load(tmp_path / "local.ckpt")["w"].equal(torch.ones(3))
    io.teardown()


def test_a_failed_write_in_the_trainer_raises_and_leaves_no_temporary(tmp_path):
    ckdir = tmp_path / "ck"
    _C.fault_clear()
    _C.fault_inject("write", errno=errno.ENOSPC, times=0, path_contains="ck")
    try:
        with pytest.raises(OSError) as ei:
            fit(FastCheckpointIO(), 1, ckdir, save_top_k=1, filename="{epoch}")
    finally:
        _C.fault_clear()
    assert ei.value.errno == errno.ENOSPC
    assert str(ckdir / "epoch=0.ckpt") in str(ei.value)
    assert os.listdir(ckdir) == []


def test_async_failure_is_raised_at_the_next_save_or_at_teardown(tmp_path):
    before = set(threading.enumerate())
    io = AsyncFastCheckpointIO()
    _C.fault_clear()
    _C.fault_inject("write", errno=errno.EIO, times=0, path_contains="bad")
    try:
        io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "bad.ckpt")
        io._saver.wait(raise_errors=False)  # the failure happened in the background
    finally:
        _C.fault_clear()
    with pytest.raises(OSError, match="bad.ckpt"):
        io.save_checkpoint({"w": torch.full((10,), 2.0)}, tmp_path / "good.ckpt")
    io.teardown()  # raised once; the next save was written anyway
    assert torch.equal(torch.load(tmp_path / "good.ckpt")["w"], torch.full((10,), 2.0))
    assert not (tmp_path / "bad.ckpt").exists() and temp_files(tmp_path) == []

    _C.fault_inject("write", errno=errno.EIO, times=0, path_contains="bad")
    try:
        io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "bad.ckpt")
        with pytest.raises(OSError, match="bad.ckpt"):
            io.teardown()
    finally:
        _C.fault_clear()
    assert _save_threads(before) == []  # the writer thread is gone although teardown raised
    io.teardown()  # nothing left to raise
    io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "again.ckpt")  # a new writer
    io.teardown()
    assert torch.equal(torch.load(tmp_path / "again.ckpt")["w"], torch.ones(10))


def test_async_trainer_failure_is_not_lost(tmp_path):
    """The Trainer's last checkpoint fails in the background: fit() raises it (teardown)."""
    _C.fault_clear()
    _C.fault_inject("write", errno=errno.EIO, times=0, path_contains="epoch=1")
    try:
        with pytest.raises(OSError, match="epoch=1.ckpt"):
            fit(AsyncFastCheckpointIO(), 2, tmp_path / "ck", save_top_k=-1, filename="{epoch}")
    finally:
        _C.fault_clear()
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=0.ckpt"]


def test_async_takes_no_extra_copy_of_the_state(tmp_path):
    """The state handed to save_checkpoint is staged once, into memory the
    saver reuses: a second save of the same state allocates nothing."""
    io = AsyncFastCheckpointIO()
    state = {"w": torch.randn(1 << 18)}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    io.save_checkpoint(state, tmp_path / "b.ckpt")
    saver = io._saver
    io.teardown()
    assert saver.stager.allocations == 1
    assert saver.stager.allocated_bytes < 2 * state["w"].nbytes + (1 << 20)


def _save_threads(before):
    return [t for t in threading.enumerate() if t not in before and t.name.startswith("fastckpt")]


def test_async_teardown_stops_the_writer_and_the_plugin_copies(tmp_path):
    """After fit (whose end calls teardown) no thread of the plugin is left, the
    plugin and the Trainer pickle and deep-copy, and the next fit saves again
    with a new writer."""
    before = set(threading.enumerate())
    plugin = AsyncFastCheckpointIO()
    plugin.save_checkpoint({"w": torch.ones(8)}, tmp_path / "pre.ckpt")  # a save in flight or just done
    for c in (pickle.loads(pickle.dumps(plugin)), copy.deepcopy(plugin)):
        assert isinstance(c, AsyncFastCheckpointIO) and c.last_future is None
    plugin.teardown()
    assert _save_threads(before) == []

    torch.manual_seed(0)
    t = trainer(plugin, 1, [ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, filename="{epoch}")])
    train, val = loaders()
    t.fit(Tiny(), train, val)
    assert written_by_fastckpt(tmp_path / "ck" / "epoch=0.ckpt")
    assert _save_threads(before) == []
    pickle.dumps(plugin)
    t2 = copy.deepcopy(t)
    assert isinstance(t2.strategy.checkpoint_io, AsyncFastCheckpointIO)

    os.unlink(tmp_path / "ck" / "epoch=0.ckpt")
    t = trainer(plugin, 1, [ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, filename="{epoch}")])
    t.fit(Tiny(), train, val)
    assert written_by_fastckpt(tmp_path / "ck" / "epoch=0.ckpt")
    assert _save_threads(before) == []

    # a copy saves with a writer of its own, stopped by its own teardown
    c = copy.deepcopy(plugin)
    c.save_checkpoint({"w": torch.full((8,), 3.0)}, tmp_path / "copy.ckpt")
    c.teardown()
    assert torch.equal(torch.load(tmp_path / "copy.ckpt")["w"], torch.full((8,), 3.0))
    assert _save_threads(before) == [] and temp_files(tmp_path) == []


def test_fabric_save_and_load_go_through_the_plugin(tmp_path):
    from lightning.fabric import Fabric
    # a 64 KiB weight: the file has fastckpt's 4 KiB layout (a file of small tensors only has torch.save's own)
    for cls in (FastCheckpointIO, AsyncFastCheckpointIO):
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[cls()])
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 128)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = fabric.setup(model, opt)
        model(torch.randn(4, 128)).sum().backward()
        opt.step()
        p = tmp_path / f"{cls.__name__}.ckpt"
        fabric.save(p, {"model": model, "optimizer": opt, "step": 7})
        fabric.strategy.checkpoint_io.teardown()
        assert written_by_fastckpt(p)
        model2 = torch.nn.Linear(128, 128)
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
        model2, opt2 = fabric.setup(model2, opt2)
        rest = fabric.load(p, {"model": model2, "optimizer": opt2})
        assert rest == {"step": 7}
        assert torch.equal(model2.weight, model.weight)
        assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"],
                           opt.state_dict()["state"][0]["momentum_buffer"])


# ---------------------------------------------------------------- several processes (DDP on the CPU, gloo)
@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
# ddp_spawn (each fit spawns its ranks afresh, torch and Lightning imported again: 4x the time) is
# the long tier; the plugins' pickling, which spawn relies on, is checked in make test (above)
@pytest.mark.parametrize("strategy,plugin", [("ddp", "sync"), ("ddp", "async"),
                                             pytest.param("ddp_spawn", "async", marks=pytest.mark.long)])
def test_ddp_checkpoints_resume_bitwise_and_match_the_stock_plugin(tmp_path, strategy, plugin):
    """Lightning's own 2-process DDP on the CPU (its script launcher, or spawn) with fastckpt's
    plugin (tests/support/workers/lightning_ddp.py): ModelCheckpoint's files are fastckpt files,
    a fit resumed from the first epoch's checkpoint ends bitwise where the uninterrupted one did,
    which ends where the stock plugin's run ends (compared once, under "ddp" with the synchronous plugin);
    no temporary is left."""
    from paths import WORKERS
    from ports import free_port
    # MASTER_PORT from below the ephemeral range: left unset, Lightning takes a port bind(0) handed
    # out and lets it go, and a parallel test's connection can take it before the store binds it.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(
        WORKERS.parent)) if p), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, str(WORKERS / "lightning_ddp.py"), str(tmp_path), strategy, plugin],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    oks = [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")]
    # A string message (pytest shortens a tuple's repr): the lines that say why, then the tail.
    why = [ln for ln in r.stderr.splitlines() if any(w in ln for w in ("terminate", "what()", "Error", "Abort",
                                                                        "Signal", "Fatal", "rank"))]
    want = ["ok fastckpt-files", "ok resume-bitwise"] + (["ok same-as-stock"] if (strategy, plugin) == ("ddp", "sync") else []) + \
        ["ok no-temporaries"]
    assert r.returncode == 0 and oks == want, \
        f"rc={r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr lines:\n" + "\n".join(why[-40:]) + \
        f"\nstderr tail:\n{r.stderr[-3000:]}"
