"""The resume proof: examples/ddp_train.py under 2 gloo ranks on the CPU.

An uninterrupted run (under torchrun) gives the reference final state. Other
runs are killed with SIGKILL on every rank — at a random step, in the middle
of a synchronous save, in the middle of an asynchronous save — and started
again with the same arguments: each must resume from the newest complete
checkpoint and end with model, optimizer and scheduler states bitwise equal to
the reference. Also: the checkpoint manager in sharded mode (DCP, DTensor
shards) across 2 ranks, in replicated collective mode (save, load, failures)
and its collective async_save at world sizes 2 and 3. Each rank runs one torch thread; a run takes a few
seconds.
"""
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import fastckpt
import fastspawn  # noqa: E402
from leaks import temp_files, temps_of
from dist_launch import free_port
from paths import ROOT, WORKERS
from states import assert_same

EXAMPLE = ROOT / "examples" / "ddp_train.py"
STEPS, EVERY = 40, 5
ARGS = ["--steps", str(STEPS), "--ckpt-every", str(EVERY), "--keep-last", "2", "--step-sleep", "0.02"]
WORLD = 2

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
]


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTCKPT_TEST_", "RANK", "LOCAL_RANK",
                                                                      "WORLD_SIZE", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


class Job:
    """WORLD ranks of a script started the way torchrun starts them (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT in the environment), without torchrun's agent
    in between, so that SIGKILL reaches the ranks themselves. Rank 0's stdout
    is collected line by line."""

    def __init__(self, workdir: Path, script: Path, args, env=None, world: int = WORLD):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.procs = []
        self.lines = []
        self.cv = threading.Condition()
        n = len(list(workdir.glob("rank0-*.err")))
        for rank in range(world):
            e = base_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env or {}))
            err = open(workdir / f"rank{rank}-{n}.err", "w")
            self.procs.append(fastspawn.Popen([sys.executable, str(script), *args], env=e, cwd=ROOT, stderr=err,
                                               stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True))
            err.close()
        self.errs = [workdir / f"rank{r}-{n}.err" for r in range(world)]
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.procs[0].stdout:
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()
        with self.cv:
            self.lines.append(None)  # EOF
            self.cv.notify_all()

    def wait_line(self, pred, timeout=60.0) -> str:
        deadline = time.monotonic() + timeout
        i = 0
        with self.cv:
            while True:
                while i < len(self.lines):
                    line = self.lines[i]
                    i += 1
                    if line is None:
                        raise AssertionError(f"rank 0 ended before the expected line\n{self.report()}")
                    if pred(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for a line\n{self.report()}")
                self.cv.wait(left)

    def kill(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
            assert p.returncode == -signal.SIGKILL, f"rank exited on its own ({p.returncode})\n{self.report()}"
        self.reader.join(10)

    def finish(self, timeout=120.0) -> list:
        try:
            for p in self.procs:
                p.wait(timeout)
        except subprocess.TimeoutExpired:
            for p in self.procs:
                p.kill()
            raise AssertionError(f"job timed out\n{self.report()}")
        self.reader.join(10)
        assert [p.returncode for p in self.procs] == [0] * len(self.procs), self.report()
        return [line for line in self.lines if line is not None]

    def report(self) -> str:
        out = "\n".join(str(x) for x in self.lines[-15:])
        errs = "\n".join(f"--- {e.name}:\n{e.read_text()[-3000:]}" for e in self.errs if e.exists())
        return f"--- rank 0 stdout (tail):\n{out}\n{errs}"


def run_example(workdir: Path, ckpt: Path, extra=(), env=None) -> Job:
    return Job(workdir, EXAMPLE, ["--ckpt-dir", str(ckpt), *ARGS, *extra], env=env)


def load_dump(path: Path) -> dict:
    return torch.load(path, weights_only=True)



def resumed_from(lines) -> int:
    for line in lines:
        if line.startswith("resumed-from "):
            return int(line.split()[1])
        if line == "fresh-start":
            return 0
    raise AssertionError(f"no resume line in {lines[:5]}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, launched by torchrun itself."""
    d = tmp_path_factory.mktemp("reference")
    dump = d / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(EXAMPLE), "--ckpt-dir", str(d / "ckpt"), *ARGS,
           "--dump", str(dump)]
    r = fastspawn.run(cmd, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "fresh-start" in r.stdout and f"ckpt-end {STEPS}" in r.stdout
    assert sorted(os.listdir(d / "ckpt")) == ["latest", f"step_{STEPS - EVERY:08d}.pt", f"step_{STEPS:08d}.pt"]
    return load_dump(dump)


def wait_for_temp(ckpt: Path, target: str, job: Job, timeout=10.0) -> None:
    """The save of ``target`` is under way: its temporary file exists (its writes stall)."""
    deadline = time.monotonic() + timeout
    while not temps_of(ckpt, target):
        assert time.monotonic() < deadline, job.report()
        time.sleep(0.01)


def finish_resumed(tmp_path, ckpt, reference, extra=()) -> int:
    """Start the job again on `ckpt`; it must run to the end and match the reference."""
    dump = tmp_path / "final.pt"
    job = run_example(tmp_path / "logs", ckpt, [*extra, "--dump", str(dump)])
    lines = job.finish()
    assert temp_files(ckpt) == [], "leftovers of the killed save were not cleaned"
    assert_same(reference, load_dump(dump), "final", bitwise=True, sequence_types=False)
    return resumed_from(lines)


def test_sigkill_at_a_random_step_resumes_exactly(tmp_path, reference):
    seed = int(os.environ.get("FASTCKPT_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
    kill_at = random.Random(seed).randrange(EVERY + 1, STEPS - 4)  # leaves the run >= 80 ms to go
    ckpt = tmp_path / "ckpt"
    job = run_example(tmp_path / "logs", ckpt)
    job.wait_line(lambda s: s == f"step {kill_at}" or s.startswith(f"step {kill_at} "))
    job.kill()
    start = finish_resumed(tmp_path, ckpt, reference)
    # the newest complete checkpoint at or just after the kill (a save may have completed meanwhile)
    assert start % EVERY == 0 and kill_at - EVERY <= start <= kill_at + EVERY, \
        f"killed at step {kill_at} (FASTCKPT_TEST_SEED={seed}), resumed from {start}"


def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    # Every write of a checkpoint file stalls 300 ms: the save of step 15 is surely in progress below.
    job = run_example(tmp_path / "logs", ckpt, env={"FASTCKPT_TEST_FAULT": "write:1:300:0:step_"})
    job.wait_line(lambda s: s == "ckpt-begin 15")
    wait_for_temp(ckpt, "step_00000015.pt", job)
    assert (ckpt / "latest").read_text() == "step_00000010.pt\n"
    job.kill()
    assert not (ckpt / "step_00000015.pt").exists()
    assert finish_resumed(tmp_path, ckpt, reference) == 10


def test_sigkill_during_an_async_save_resumes_from_the_previous_checkpoint(tmp_path, reference):
    """--async with the manager's default collective=True: every rank's writer thread
    writes its share of step 15 (slowed down) while training goes on; SIGKILL of
    every rank then; the next run resumes from step 10 and ends bitwise equal."""
    ckpt = tmp_path / "ckpt"
    job = run_example(tmp_path / "logs", ckpt, ["--async"], env={"FASTCKPT_TEST_FAULT": "write:1:300:0:step_"})
    job.wait_line(lambda s: s == "ckpt-snapshotted 15")
    job.wait_line(lambda s: s.startswith("step 17 "))  # training went on while step 15 is being written
    wait_for_temp(ckpt, "step_00000015.pt", job)
    assert (ckpt / "latest").read_text() == "step_00000010.pt\n"
    job.kill()
    assert not (ckpt / "step_00000015.pt").exists()
    assert finish_resumed(tmp_path, ckpt, reference, ["--async"]) == 10


def test_sharded_manager_two_ranks(tmp_path):
    """Sharded mode: each rank writes its DTensor shards through fastckpt.dcp;
    latest, retention, fallback from a damaged checkpoint, in-place load."""
    job = Job(tmp_path / "logs", WORKERS / "sharded_worker.py", [str(tmp_path / "ckpt")])
    lines = job.finish(timeout=120)
    assert lines[-1] == "ok", job.report()


def test_collective_manager_two_ranks(tmp_path):
    """Replicated mode, collective=True (the default): every rank writes and
    reads a share; retention, `latest`, fallback from a damaged checkpoint, a
    failing rank fails the save everywhere; collective=False writes from rank 0."""
    job = Job(tmp_path / "logs", WORKERS / "collective_manager_worker.py", [str(tmp_path / "ckpt")])
    lines = job.finish(timeout=120)
    assert lines[-1] == "ok", job.report()


@pytest.mark.parametrize("world", [2, 3])
def test_collective_async_save(tmp_path, world):
    """CheckpointManager.async_save in collective mode (the default with several
    ranks): every rank snapshots and writes its share (about 1/world) in the
    background on a group reserved for background saves; `latest` moves after the
    collective commit and every rank's future resolves then; two in a row do not
    overlap; a rank whose snapshot or write fails fails every rank, `latest`
    unchanged (tests/support/workers/collective_async_worker.py)."""
    job = Job(tmp_path / "logs", WORKERS / "collective_async_worker.py", [str(tmp_path / "ckpt")], world=world)
    lines = job.finish(timeout=240)
    assert lines[-1] == "ok", job.report()


def test_sigkill_during_a_rank0_save_resumes_from_the_previous_checkpoint(tmp_path, reference):
    """The same with collective=False (--rank0-writes): rank 0 writes the file alone."""
    ckpt = tmp_path / "ckpt"
    job = run_example(tmp_path / "logs", ckpt, ["--rank0-writes"], env={"FASTCKPT_TEST_FAULT": "write:1:300:0:step_"})
    job.wait_line(lambda s: s == "ckpt-begin 15")
    wait_for_temp(ckpt, "step_00000015.pt", job)
    assert (ckpt / "latest").read_text() == "step_00000010.pt\n"
    job.kill()
    assert not (ckpt / "step_00000015.pt").exists()
    assert finish_resumed(tmp_path, ckpt, reference, ["--rank0-writes"]) == 10
