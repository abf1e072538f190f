"""Mounts crashfs, runs a scenario on it, then checks every crash state of the recorded op log.

``record(name, params, workdir, env)`` returns the op log of one run of scenarios.py NAME on a
fresh mount; ``check(name, params, log, workdir)`` replays it (crashfs.crash_states) and probes
each distinct state once, returning a :class:`Report`. The mount is always taken down, even when
the scenario fails or hangs: the daemon is a separate process with a deadline, and a hung FUSE
connection is aborted by killing that daemon.
"""

import contextlib
import dataclasses
import functools
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "support"))  # fastspawn
import crashfs  # noqa: E402
import fastspawn  # noqa: E402
import scenarios  # noqa: E402


def _missing() -> Optional[str]:
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE is not available in this kernel or container)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError, EnvironmentError) as e:
        return f"mfusepy/libfuse3 cannot be loaded ({e}); pip install mfusepy, apt-get install libfuse3-3"
    return None


def _is_mounted(mnt: str) -> bool:
    """From /proc/self/mounts: os.path.ismount says False for a mount whose daemon died (ENOTCONN)."""
    with open("/proc/self/mounts") as f:
        return any(line.split()[1].replace("\\040", " ") == mnt for line in f)


def _unmount(mnt: str) -> None:
    for cmd in (["fusermount3", "-u", mnt], ["fusermount3", "-uz", mnt], ["umount", "-l", mnt]):
        if not _is_mounted(mnt):
            return
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


@contextlib.contextmanager
def mounted(workdir: str) -> Iterator[Tuple[str, subprocess.Popen]]:
    """A fresh crashfs mount at WORKDIR/mnt, its op log written to WORKDIR/ops.pickle when it is
    taken down (always, on the way out): yields (mountpoint, daemon process)."""
    mnt, logfile = os.path.join(workdir, "mnt"), os.path.join(workdir, "ops.pickle")
    os.makedirs(mnt)
    with open(os.path.join(workdir, "crashfs.out"), "wb") as out:  # a file: a full pipe would stall the daemon
        daemon = subprocess.Popen([sys.executable, os.path.join(HERE, "crashfs.py"), mnt, logfile],
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if daemon.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(workdir, "crashfs.out"), errors="replace") as f:
                    raise RuntimeError(f"crashfs did not mount on {mnt}: {f.read()[-2000:]}")
            time.sleep(0.05)
        yield mnt, daemon
    finally:
        if daemon.poll() is None:
            _unmount(mnt)
        _stop(daemon, 30)
        _unmount(mnt)  # a killed daemon leaves a dead mount behind


@functools.lru_cache(maxsize=None)
def unavailable() -> Optional[str]:
    """Why crashfs cannot be mounted here, or None (tried once: a mount and an unmount)."""
    why = _missing()
    if why is None:
        with tempfile.TemporaryDirectory(prefix="crashfs-probe-") as d:
            try:
                with mounted(d) as (mnt, _):
                    os.listdir(mnt)
            except (RuntimeError, OSError) as e:
                why = f"a trial mount failed: {e}"
    return why


def record(name: str, params: dict, workdir: str, env: Optional[Dict[str, str]] = None,
           timeout: float = 300) -> List[tuple]:
    """Runs scenario ``name`` on a fresh crashfs mount under ``workdir``; returns its op log."""
    with mounted(workdir) as (mnt, daemon):
        cenv = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
        child = fastspawn.Popen([sys.executable, os.path.join(HERE, "scenarios.py"), name, mnt, json.dumps(params)],
                                 env=cenv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            daemon.kill()  # first: aborts the FUSE connection, so a child stuck in it can die
            child.kill()
            out, _ = child.communicate(timeout=60)
            raise RuntimeError(f"scenario {name} did not finish within {timeout} s:\n{out.decode()[-4000:]}")
        if child.returncode != 0:
            with open(os.path.join(workdir, "crashfs.out"), errors="replace") as f:
                daemon_out = f.read()[-2000:]
            raise RuntimeError(f"scenario {name} failed (exit {child.returncode}):\n{out.decode()[-4000:]}"
                               f"\ncrashfs daemon output:\n{daemon_out}")
    with open(os.path.join(workdir, "ops.pickle"), "rb") as f:  # our own daemon's record of this run
        return pickle.load(f)


@dataclasses.dataclass
class Report:
    scenario: str
    ops: int = 0
    cuts: int = 0
    states: int = 0  # crash states checked: cuts x variants x checks
    distinct: int = 0  # distinct states probed (the rest were seen before)
    seen: Dict[str, Dict[object, int]] = dataclasses.field(default_factory=dict)  # check -> observed -> count
    violations: List[str] = dataclasses.field(default_factory=list)  # the first few, described
    violation_count: int = 0

    def line(self) -> str:
        seen = "; ".join(f"{k}: " + ", ".join(f"{v}x{n}" for v, n in sorted(d.items(), key=str))
                         for k, d in self.seen.items())
        return (f"[powerloss] {self.scenario}: {self.ops} ops, {self.cuts} cut points, {self.states} crash states "
                f"checked ({self.distinct} distinct), {self.violation_count} violations | seen {seen}")


def _describe(op: tuple) -> str:
    return "(" + ", ".join(f"<{len(x)} bytes>" if isinstance(x, bytes) else repr(x) for x in op) + ")"


def _aside_of(path: str, rel: str) -> bool:
    """Whether ``path`` lies in a copy of directory ``rel`` that an interrupted fallback directory
    commit left aside (``.fastckpt-tmp.<key>.....old`` beside it): fastckpt's readers read it
    while ``rel`` is missing, and the cleanup renames it back, so the probes see it too."""
    parent, name = os.path.split(rel)
    first = path[len(parent) + 1:] if parent else path
    if parent and not path.startswith(parent + "/"):
        return False
    top = first.split("/", 1)[0]
    from fastckpt._core.tempnames import parse_temp
    t = parse_temp(top)
    return t is not None and t.kind == "old" and t.is_for(name)


def check(name: str, params: dict, log: List[tuple], workdir: str, max_violations: int = 20,
          per_client: Optional[bool] = None) -> Report:
    """Every crash state of ``log`` against the acceptable versions at its cut point (under
    crashfs's per-client model for the scenarios in scenarios.PER_CLIENT, unless ``per_client``
    says otherwise)."""
    if per_client is None:
        per_client = name in scenarios.PER_CLIENT
    rep = Report(name, ops=len(log), cuts=len(log) + 1)
    checks = scenarios.CHECKS[name]
    committed: Dict[str, object] = {}  # mark key -> version of the last save that returned
    inflight: Dict[str, set] = {}  # mark key -> versions being saved
    cache: Dict[tuple, object] = {}
    scratch = tempfile.mkdtemp(dir=workdir, prefix="state-")
    for cut, variant, tree, model in crashfs.crash_states(log, per_client=per_client):
        if variant == crashfs.VARIANTS[0][2] and cut and log[cut - 1][0] == "mark":
            words = log[cut - 1][1].split()
            kind, key, v = words[0], words[1], int(words[2])
            if kind == "begin":
                inflight.setdefault(key, set()).add(v)
                if "may-vanish" in words:
                    inflight[key].add("absent")
            else:
                inflight[key].discard(v)
                if not any(isinstance(x, int) for x in inflight[key]):
                    inflight[key].discard("absent")
                committed[key] = v
        for check_name, key, rel, probe in checks:
            rows = tuple(r for r in tree if ((r[0] == rel or r[0].startswith(rel + "/"))
                                             and "fastckpt-tmp" not in r[0])  # temporaries: never read, only cleaned
                         or _aside_of(r[0], rel))
            if (check_name, rows) not in cache:
                d = os.path.join(scratch, str(len(cache)))
                os.makedirs(d)
                crashfs.materialize(rows, model, d)
                got = probe(os.path.join(d, rel), params)
                cache[(check_name, rows)] = got.replace(d + "/", "") if isinstance(got, str) else got
                shutil.rmtree(d)
            got = cache[(check_name, rows)]
            rep.states += 1
            counts = rep.seen.setdefault(check_name, {})
            counts[got] = counts.get(got, 0) + 1
            ok = {committed.get(key, "absent")} | inflight.get(key, set())
            if got not in ok:
                rep.violation_count += 1
            if got not in ok and len(rep.violations) < max_violations:
                last = "; ".join(_describe(op) for op in log[max(0, cut - 3):cut])
                rep.violations.append(f"cut {cut}/{len(log)} [{variant}] {check_name}: found {got!r}, "
                                      f"acceptable {sorted(ok, key=str)}; last ops: {last}")
    rep.distinct = len(cache)
    shutil.rmtree(scratch, ignore_errors=True)
    return rep


def run(name: str, params: dict, workdir: str, env: Optional[Dict[str, str]] = None) -> Report:
    log = record(name, params, workdir, env)
    return check(name, params, log, workdir)
