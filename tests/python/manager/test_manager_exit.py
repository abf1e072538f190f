"""Jobs that use CheckpointManager, or save and load with group=, end cleanly
under torchrun.

`torchrun --standalone --nproc_per_node 2` of tests/support/workers/exit_worker.py:
a DDP job (replicated mode: collective, the asynchronous saves written by every
rank's writer thread; or "rank0", collective=False) or a DCP job (sharded mode)
that saves synchronously and asynchronously, loads (or a DDP job that saves and loads
with group=, mode "collective"), calls destroy_process_group() and
exits, with no gc.collect(), close() or `with` to help it. Every run must
exit 0 on every rank and no rank may print "terminate called". Each rank
also checks, at the very end of interpreter exit, that no gloo worker thread
is still alive: such a thread is what aborted ranks (SIGABRT) when it
released its last collective's tensors during interpreter finalization; the
check makes that cause visible in every run, not only in the runs where the
abort happens to strike.

FASTCKPT_EXIT_RUNS sets the runs per mode (default 1 in `make test`: each run checks the
cause deterministically;
`make test-exit-long` runs 50 per mode).
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paths import ROOT, WORKERS

WORKER = WORKERS / "exit_worker.py"
RUNS = int(os.environ.get("FASTCKPT_EXIT_RUNS", "1"))

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="gloo is not available"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the thread check reads /proc/self/task"),
]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTCKPT_TEST_", "RANK", "LOCAL_RANK",
                                                                      "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return env


def run_once(ckpt: Path, mode: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), str(ckpt), mode]
    return subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("mode", ["replicated", "rank0", "sharded", "collective", "dcp"])
def test_jobs_using_the_manager_exit_cleanly_under_torchrun(tmp_path, mode):
    failures = []
    for i in range(RUNS):
        r = run_once(tmp_path / f"ckpt{i}", mode)
        out = r.stdout + r.stderr
        if r.returncode != 0 or "terminate called" in out or r.stdout.count("ok") != 1:
            failures.append(f"run {i}: exit {r.returncode}\n{out[-2500:]}")
    assert not failures, f"{len(failures)} of {RUNS} {mode} runs failed:\n" + "\n".join(failures)


def test_the_worker_check_can_fail(tmp_path):
    """The gloo-thread check has teeth: a job that keeps a gloo group alive
    into interpreter finalization (a group held by a module global after
    destroy_process_group()) is reported with exit status 3."""
    script = tmp_path / "keeps_group.py"
    script.write_text(WORKER.read_text().split("import torch  # noqa: E402")[0] + (
        "import torch\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nG = dist.new_group(backend='gloo')\n"
        "t = torch.ones(2)\ndist.all_reduce(t, group=G)\ndist.destroy_process_group()\nprint('ok', flush=True)\n"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "gloo worker thread(s) still alive" in r.stderr, r.stderr[-2000:]
