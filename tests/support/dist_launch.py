"""Launching ranks: a script as a job of several processes (the integration, manager and DCP tests),
under torchrun, or rank by rank with torchrun's environment (so that a rank
that is killed is not followed by torchrun's agent stopping the others); free
ports; killing and reaping the ranks and waiting for their "OK" lines."""
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List

import fastspawn
from paths import ROOT
from ports import free_port  # noqa: F401  (the tests take it from here too)


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("FASTCKPT_TEST_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                    "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1")
    e.update(extra)
    return e


def _per_rank(logs: str) -> list:
    """torchrun's options that give every rank files of its own under ``logs`` (``--redirects 3``).
    Ranks of one agent that shared its stdout would interleave their writes: an unbuffered
    ``print("A", b)`` is one write per piece, so two ranks' lines can come out mixed."""
    return ["--log-dir", logs, "--redirects", "3"]


def _with_ranks(r: subprocess.CompletedProcess, logs: str) -> subprocess.CompletedProcess:
    """``r`` (an agent's output) with each of its ranks' stdout and stderr appended, rank by rank
    (every restart attempt in order), each whole."""
    out, err = [r.stdout], [r.stderr]
    runs = sorted(os.listdir(logs)) if os.path.isdir(logs) else []
    for run in runs:
        for attempt in sorted(os.listdir(os.path.join(logs, run)), key=lambda a: int(a.rpartition("_")[2])):
            base = os.path.join(logs, run, attempt)
            for rank in sorted(os.listdir(base), key=int):
                for name, into in (("stdout.log", out), ("stderr.log", err)):
                    f = os.path.join(base, rank, name)
                    if os.path.exists(f):
                        with open(f, errors="replace") as fh:
                            into.append(fh.read())
    return subprocess.CompletedProcess(r.args, r.returncode, "".join(out), "".join(err))


def torchrun(script, *args, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc script args``; stdout and stderr are the
    agent's followed by each rank's (see :func:`_with_ranks`)."""
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               *_per_rank(logs), str(script), *map(str, args)]
        r = subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        return _with_ranks(r, logs)


def accelerate_launch(script, *args, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu --num_processes nproc script args`` with no GPU visible:
    Accelerate's own launcher starts the processes, which train on the CPU over gloo."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(free_port()), str(script), *map(str, args)]
    return subprocess.run(cmd, env=env(CUDA_VISIBLE_DEVICES=""), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def kill_all(procs) -> None:
    """Kill and reap every process of ``procs`` still running (none is left behind a test); of one
    started in a session of its own (a torchrun agent), its whole process group, so that ranks it
    started do not outlive it (orphans when the agent is killed or fails)."""
    for p in procs:
        if getattr(p, "own_group", False):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if p.poll() is None:
            p.kill()
            p.wait()


def reap(procs, timeout: float, wait_for=None) -> None:
    """Wait until the processes ``wait_for`` (indices into ``procs``; all by
    default) have exited, ``timeout`` seconds at most in all, then
    :func:`kill_all` of ``procs`` (a process killed here has return code -SIGKILL)."""
    deadline = time.monotonic() + timeout
    try:
        for i, p in enumerate(procs):
            if wait_for is None or i in wait_for:
                p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_all(procs)


def _collect(procs, files, timeout: float) -> List[subprocess.CompletedProcess]:
    """Wait for `procs` (see :func:`reap`), then one CompletedProcess each from their output files."""
    reap(procs, timeout)
    out = []
    for p, (o, e) in zip(procs, files):
        o.seek(0)
        e.seek(0)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, o.read(), e.read()))
        o.close()
        e.close()
    return out


def ranks(script, *args, world: int = 2, timeout: float = 300, extra_env=None) -> List[subprocess.CompletedProcess]:
    """Every rank of ``script args`` started directly, with RANK, WORLD_SIZE,
    LOCAL_RANK and MASTER_ADDR/PORT set as torchrun sets them (and ``extra_env``); waits for all
    (killing any still running past ``timeout``: its return code is then
    -SIGKILL) and returns one CompletedProcess each."""
    port = str(free_port())
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(world)]  # no pipe to fill
    procs = [fastspawn.Popen([sys.executable, str(script), *map(str, args)], cwd=ROOT, text=True,
                              stdout=files[r][0], stderr=files[r][1],
                              env=env(**(extra_env or {}), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(world)]
    return _collect(procs, files, timeout)


def torchrun_nodes(script, *args, node_env, nproc: int = 1, timeout: float = 300) -> List[subprocess.CompletedProcess]:
    """One torchrun agent per emulated node (``--nnodes len(node_env) --node-rank i``, a static
    rendezvous on 127.0.0.1: node i's ranks are i*nproc ...), agent i with the extra environment
    ``node_env[i]`` (e.g. its own FASTCKPT_MEMORY_DIR); one CompletedProcess per agent, its output
    followed by its ranks' (see :func:`_with_ranks`)."""
    port = str(free_port())
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in node_env]
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        dirs = [os.path.join(logs, f"node{i}") for i in range(len(node_env))]
        procs = [fastspawn.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(node_env)),
                                  "--nproc_per_node", str(nproc), "--node_rank", str(i), "--master_addr", "127.0.0.1",
                                  "--master_port", port, *_per_rank(dirs[i]), str(script), *map(str, args)],
                                 cwd=ROOT, text=True, stdout=files[i][0], stderr=files[i][1], env=env(**extra),
                                 start_new_session=True)
                 for i, extra in enumerate(node_env)]
        for p in procs:
            p.own_group = True  # kill_all kills the agent's ranks with it
        return [_with_ranks(r, d) for r, d in zip(_collect(procs, files, timeout), dirs)]


def report(results) -> str:
    if isinstance(results, subprocess.CompletedProcess):
        results = [results]
    return "\n".join(f"--- exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}" for r in results)


def wait_for_ranks(procs, scenario, timeout):
    """Wait for the rank processes (stdout piped, stderr merged) of a multi-process
    test, killing any still running at the end, and assert that each exited 0 and
    printed "OK <scenario> rank <r>"; the failure message holds every rank's output."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        kill_all(procs)
    text = "\n".join(f"--- rank {r} (exit {p.returncode})\n{o[-6000:]}" for r, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), text
    for r, o in enumerate(outs):
        assert f"OK {scenario} rank {r}" in o, text


def start_ranks(script, scenario, work, world_size: int) -> list:
    """``world_size`` processes of ``script SCENARIO WORK`` with torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT on a free port), one thread each and 1 MiB x 4 engine buffers, stdout and stderr
    piped together (the multi-process DCP tests; :func:`wait_for_ranks` waits for them)."""
    e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
             OMP_NUM_THREADS="1", FASTCKPT_BUFFER_SIZE="1M", FASTCKPT_BUFFER_COUNT="4",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for r in range(world_size):
        e["RANK"] = str(r)
        procs.append(fastspawn.Popen([sys.executable, str(script), scenario, str(work)], env=dict(e),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs
