"""fastckpt.integrations.deepspeed: the CheckpointEngine alone, and inside a real DeepSpeed engine on CPU."""
import errno
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
except Exception as e:  # noqa: BLE001 - deepspeed missing, or its import failing on this machine
    pytest.skip(f"deepspeed cannot be imported here: {type(e).__name__}: {e} "
                "(.ci/install_deepspeed.sh installs it)", allow_module_level=True)

from fastckpt import _C  # noqa: E402
from fastckpt.integrations.deepspeed import FastCheckpointEngine  # noqa: E402
import fastspawn  # noqa: E402
from dist_launch import free_port  # noqa: E402
from paths import ROOT  # noqa: E402

from leaks import temp_files  # noqa: E402



def written_by_fastckpt(path):
    with zipfile.ZipFile(path) as z:
        # fastckpt's zip writer records "version made by" 20 in the central directory (torch's miniz: 0);
        # the layout alone cannot tell them apart (a file of small tensors is torch.save's own layout)
        return all(i.create_version == 20 for i in z.infolist())


def test_create_save_load_commit(tmp_path):
    eng = FastCheckpointEngine()
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True)
    eng.create(info)
    eng.makedirs(str(tmp_path / "t1"), exist_ok=True)
    state = {"module": {"w": torch.randn(1000)}, "step": 3, "obj": {1, 2}}
    eng.save(state, str(tmp_path / "t1" / "mp_rank_00_model_states.pt"))
    assert written_by_fastckpt(tmp_path / "t1" / "mp_rank_00_model_states.pt")
    assert eng.commit(info) is True
    got = eng.load(str(tmp_path / "t1" / "mp_rank_00_model_states.pt"), map_location="cpu")
    assert torch.equal(got["module"]["w"], state["module"]["w"]) and got["obj"] == {1, 2}
    # DeepSpeed's own loader (torch.load) reads it
    assert torch.load(tmp_path / "t1" / "mp_rank_00_model_states.pt", weights_only=False)["step"] == 3


def test_failed_save_names_the_path_and_leaves_nothing(tmp_path):
    eng = FastCheckpointEngine()
    p = tmp_path / "t1" / "x.pt"
    os.makedirs(p.parent)
    _C.fault_clear()
    _C.fault_inject("write", errno=errno.ENOSPC, times=0)
    try:
        with pytest.raises(OSError) as ei:
            eng.save({"w": torch.ones(10)}, str(p))
    finally:
        _C.fault_clear()
    assert ei.value.errno == errno.ENOSPC and str(p) in str(ei.value)
    assert os.listdir(p.parent) == [] and temp_files(p.parent) == []
    with pytest.raises(FileNotFoundError):
        eng.load(str(p))


WORKER = textwrap.dedent("""
    import os, sys, torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    # One process: no shared-memory all-reduce, which DeepSpeed's CPU backend would otherwise JIT-compile
    # at initialize (about 40 s on a fresh machine); DeepSpeed keeps this dict for such edits.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from fastckpt.integrations.deepspeed import FastCheckpointEngine
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2}
    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        e, *_ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
        e.checkpoint_engine = FastCheckpointEngine()
        return e
    e = make(0)
    for _ in range(3):
        loss = e(torch.randn(2, 64)).sum(); e.backward(loss); e.step()
    e.save_checkpoint(sys.argv[1], tag="step3", client_state={"note": "hi"})
    want = {k: v.clone() for k, v in e.module.state_dict().items()}
    mom = [s["momentum_buffer"].clone() for s in e.optimizer.state_dict()["state"].values()]
    e2 = make(1)
    _, client = e2.load_checkpoint(sys.argv[1])
    assert client["note"] == "hi", client
    for k, v in e2.module.state_dict().items():
        assert torch.equal(v, want[k]), k
    got = [s["momentum_buffer"] for s in e2.optimizer.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(mom, got))
    print("OK", sorted(os.listdir(os.path.join(sys.argv[1], "step3"))))
""")


def test_real_deepspeed_engine_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
    port = str(free_port())
    r = fastspawn.run([sys.executable, "-c", WORKER, str(tmp_path / "ck"), port], capture_output=True, text=True,
                       env=env, timeout=600)
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    if r.returncode != 0 and "fastckpt" not in last and ("No module named" in last or "ccl" in last.lower()):
        pytest.skip(f"DeepSpeed's CPU engine does not start here: {last}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "OK" in r.stdout
    files = os.listdir(tmp_path / "ck" / "step3")
    assert files and all(written_by_fastckpt(tmp_path / "ck" / "step3" / f) for f in files)
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step3"
