"""Ranks of the collective tests (tests/python/collective/): each rank is a subprocess of a worker of
tests/support/workers/ (collective_worker.py by default), joined through a FileStore, and what the
tests read from the ranks' output and the files they wrote."""
import os
import subprocess
import sys
from pathlib import Path

import fastckpt
from fastckpt.formats import zip as _zip

import fastspawn
from dist_launch import kill_all
from paths import ROOT, WORKERS
from workers import collective_worker as worker


def run_ranks(tmp_path: Path, world: int, path, case: str, mode: str = "ok", timeout: float = 400,
              worker_script: str = "collective_worker.py", extra=(), rank_env=None):
    """`world` ranks of `worker_script` (STORE RANK WORLD PATH CASE MODE *extra); each rank's (exit status,
    output). `path`: one path for every rank, or a list (rank r's path); rank_env(r): more environment."""
    store = tmp_path / f"store.{os.urandom(4).hex()}"
    paths = path if isinstance(path, (list, tuple)) else [path] * world
    procs = []
    for r in range(world):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   **(rank_env(r) if rank_env else {}))
        procs.append(fastspawn.Popen([sys.executable, str(WORKERS / worker_script), str(store), str(r), str(world),
                                       str(paths[r]), case, mode, *extra], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append((p.returncode, out))
    finally:
        kill_all(procs)  # none left behind when a rank hangs
    return outs


def last_line(out: str) -> str:
    lines = out.strip().splitlines()
    return lines[-1] if lines else ""


def reference_bytes(tmp_path: Path, case: str, settings: bool = False) -> bytes:
    ref = tmp_path / f"ref_{case}.pt"
    orig = fastckpt.formats.archive.new_serialization_id
    fastckpt.formats.archive.new_serialization_id = lambda: worker.SID
    try:
        if settings:
            worker.torch_settings(True)
        fastckpt.save(worker.build(case), ref)
    finally:
        fastckpt.formats.archive.new_serialization_id = orig
        worker.torch_settings(False)
    return ref.read_bytes()


def assert_no_fd_leak(text: str):
    line = [x for x in text.splitlines() if x.startswith("FDS ")][-1]
    before, after = map(int, line.split()[1:])
    assert before == after, f"descriptors leaked: {line}"


def leftovers(d: Path):
    return [p.name for p in d.iterdir() if ".fastckpt-tmp." in p.name]


def bytes_read(out: str) -> int:
    return int([x for x in out.splitlines() if x.startswith("READ ")][-1].split()[1])


def storage_bytes(path: Path) -> int:
    archive = _zip.Archive.open(str(path))
    return sum(e.size for n, e in archive.records.items() if n.startswith("data/"))
