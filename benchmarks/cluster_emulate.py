#!/usr/bin/env python3
"""Emulate N nodes on one machine and run the cluster benchmark (benchmarks/bench_cluster.py) at
each world size: ``make bench-cluster``.

What is emulated (root, cgroup v1 blkio, loop devices):

* each node's own disk: one ext4 filesystem per node on a loop device (``losetup --direct-io=on``
  over a sparse file on ``--dir``'s disk), mounted under a private temporary directory;
* the shared filesystem: one more such filesystem that every rank uses;
* each node's link: every rank (one per node) runs in its own blkio cgroup whose
  ``blkio.throttle.read_bps_device`` and ``write_bps_device`` are B (``--link-mbps``) for the shared
  filesystem's loop device and for its node's loop device: N nodes together reach N x B at most.
  cgroup v1 charges I/O to the task that submits it: O_DIRECT, reads and the bench's own syncs are
  throttled, buffered writeback done by the kernel's flusher threads is not (the report says so);
* ranks are started here with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK=0,
  LOCAL_WORLD_SIZE=1, GROUP_RANK, MASTER_ADDR/PORT) and FASTCKPT_NODE=node<i> (fastckpt's node
  identity), gloo over loopback. All ranks share this machine's CPUs, memory and page cache.

Everything set up (mounts, loop devices, cgroups, image files) is removed on exit, also on an error,
Ctrl-C or SIGTERM. ``--no-emulate`` runs the same ranks on plain directories (no root needed, no
throttling): the smoke test uses it.

Output (``--out``, default build/bench-cluster/): w<N>.json and w<N>.md per world size (bench_cluster.py's),
then CLUSTER.md, cluster.json, cluster_scaling.png (benchmarks/cluster_report.py). ``--json FILE`` also
writes benchmarks/report.py's standalone JSON (then --out defaults to FILE's directory/cluster).

Examples::

    sudo .venv/bin/python benchmarks/cluster_emulate.py                       # N = 1,2,4, 512M, B = 100 MB/s
    sudo .venv/bin/python benchmarks/cluster_emulate.py --worlds 2 --size 256M --link-mbps 200
    .venv/bin/python benchmarks/cluster_emulate.py --no-emulate --worlds 2 --size 16M
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
from benchmarks import cluster_report  # noqa: E402  (no torch import: the parent stays light)
from benchmarks.ports import free_port  # noqa: E402

BLKIO = "/sys/fs/cgroup/blkio"
DEFAULT_OUT = os.path.join(REPO_ROOT, "build", "bench-cluster")
MiB = 1 << 20
RANK_GRACE_S = 30.0  # after one rank failed, how long the others may take to fail on their own


def log(msg: str) -> None:
    print(f"[cluster_emulate] {msg}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    try:
        return int(float(t[:-1]) * mult[t[-1]]) if t and t[-1] in mult else int(t)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 1G)") from None


class EmulationError(Exception):
    """This machine cannot emulate nodes (not root, no cgroup v1 blkio, no loop devices): said, not traced."""


def _run(cmd: List[str]) -> str:
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        raise EmulationError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout.strip()


def why_not_emulated() -> Optional[str]:
    """None if this process can set up the emulation, else why not."""
    if os.geteuid() != 0:
        return "not root (loop devices, mounts and blkio cgroups need root)"
    if not os.path.exists(os.path.join(BLKIO, "blkio.throttle.read_bps_device")):
        if os.path.isdir("/sys/fs/cgroup"):
            try:
                os.makedirs(BLKIO, exist_ok=True)
                _run(["mount", "-t", "cgroup", "-o", "blkio", "cgroup", BLKIO])
            except (OSError, EmulationError) as e:
                return f"no cgroup v1 blkio hierarchy at {BLKIO} and mounting one failed ({e})"
        if not os.path.exists(os.path.join(BLKIO, "blkio.throttle.read_bps_device")):
            return f"no cgroup v1 blkio throttling at {BLKIO} (blkio.throttle.read_bps_device missing)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (no loop devices in this environment)"
    return None


class Emulation:
    """N node filesystems + one shared, each on its own loop device, and one blkio cgroup per node
    throttled to B on the shared device and its own. A context manager: everything is undone on exit."""

    def __init__(self, parent: str, nodes: int, fs_bytes: int, link_bps: int):
        self.parent, self.nodes, self.fs_bytes, self.link_bps = parent, nodes, fs_bytes, link_bps
        self.base: Optional[str] = None
        self.loops: List[str] = []  # loop devices attached, in order
        self.mounts: List[str] = []  # mount points mounted, in order
        self.cgroups: List[str] = []  # cgroup directories made, parents first
        self.fs: Dict[str, Dict[str, str]] = {}  # name -> {"mount", "dev", "majmin", "image"}

    def __enter__(self) -> "Emulation":
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _filesystem(self, name: str) -> None:
        img = os.path.join(self.base, name + ".img")
        with open(img, "wb") as f:
            f.truncate(self.fs_bytes)
        dev = _run(["losetup", "--direct-io=on", "--find", "--show", img])
        self.loops.append(dev)
        _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev])
        mnt = os.path.join(self.base, name)
        os.mkdir(mnt)
        _run(["mount", "-o", "noatime", dev, mnt])
        self.mounts.append(mnt)
        st = os.stat(dev)
        self.fs[name] = {"mount": mnt, "dev": dev, "majmin": f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}",
                         "image": img}

    def setup(self) -> None:
        why = why_not_emulated()
        if why:
            raise EmulationError(why)
        self.base = tempfile.mkdtemp(prefix="fastckpt-cluster-emu-", dir=self.parent)
        for name in ["shared"] + [f"node{i}" for i in range(self.nodes)]:
            self._filesystem(name)
        root = os.path.join(BLKIO, f"fastckpt-cluster-emu-{os.getpid()}")
        os.mkdir(root)
        self.cgroups.append(root)
        for i in range(self.nodes):
            cg = os.path.join(root, f"node{i}")
            os.mkdir(cg)
            self.cgroups.append(cg)
            for dev in (self.fs["shared"]["majmin"], self.fs[f"node{i}"]["majmin"]):
                for knob in ("read_bps_device", "write_bps_device"):
                    with open(os.path.join(cg, "blkio.throttle." + knob), "w") as f:
                        f.write(f"{dev} {self.link_bps}\n")

    def cgroup(self, i: int) -> str:
        return self.cgroups[1 + i]

    def teardown(self) -> List[str]:
        """Undo everything set up, each step on its own (one failure does not stop the rest);
        returns what could not be undone (also logged)."""
        left = []
        for cg in self.cgroups[::-1]:
            try:
                with open(os.path.join(cg, "cgroup.procs")) as f:
                    pids = [int(x) for x in f.read().split()]
                for pid in pids:  # only ranks this script started live here
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                for _ in range(50):
                    try:
                        os.rmdir(cg)
                        break
                    except OSError:
                        time.sleep(0.1)
                else:
                    os.rmdir(cg)
            except OSError as e:
                left.append(f"cgroup {cg}: {e}")
        self.cgroups = []
        for mnt in self.mounts[::-1]:
            p = subprocess.run(["umount", mnt], stderr=subprocess.PIPE, text=True)
            if p.returncode:
                p = subprocess.run(["umount", "-l", mnt], stderr=subprocess.PIPE, text=True)
            if p.returncode:
                left.append(f"mount {mnt}: {p.stderr.strip()}")
        self.mounts = []
        for dev in self.loops[::-1]:
            p = subprocess.run(["losetup", "-d", dev], stderr=subprocess.PIPE, text=True)
            if p.returncode:
                left.append(f"loop device {dev}: {p.stderr.strip()}")
        self.loops = []
        if self.base and not left:
            shutil.rmtree(self.base, ignore_errors=True)
            if os.path.exists(self.base):
                left.append(f"directory {self.base} not removed")
        for x in left:
            log(f"CLEANUP FAILED: {x}")
        return left


def run_world(n: int, args: argparse.Namespace, emu: Optional[Emulation], plain: Optional[str],
              json_path: str, md_path: str) -> int:
    """Start n ranks of bench_cluster.py (one per emulated node), wait for them; rank 0's exit status."""
    port = free_port()
    desc = describe(args, emu is not None)
    procs = []
    with open(md_path, "w") as md:
        try:
            for r in range(n):
                shared = emu.fs["shared"]["mount"] if emu else os.path.join(plain, "shared")
                local = emu.fs[f"node{r}"]["mount"] if emu else os.path.join(plain, f"node{r}")
                os.makedirs(shared, exist_ok=True)
                os.makedirs(local, exist_ok=True)
                env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                           WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(r),
                           GROUP_WORLD_SIZE=str(n), ROLE_RANK=str(r), ROLE_WORLD_SIZE=str(n),
                           FASTCKPT_NODE=f"node{r}", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                           PYTHONPATH=os.pathsep.join([REPO_ROOT] + [p for p in os.environ.get(
                               "PYTHONPATH", "").split(os.pathsep) if p]))
                cmd = [sys.executable, os.path.join(HERE, "bench_cluster.py"), "--dir", shared, "--local-dir", local,
                       "--size", str(args.size), "--modes", args.modes, "--json", json_path,
                       "--timeout", str(args.timeout), "--emulation", json.dumps({"description": desc})]
                if args.link_mbps and emu:
                    cmd += ["--link-mbps", str(args.link_mbps)]
                if emu:
                    cmd += ["--blkio-stats", os.path.join(emu.cgroup(r), "blkio.throttle.io_service_bytes")]
                if args.drop_caches:
                    cmd.append("--drop-caches")
                procs_file = os.path.join(emu.cgroup(r), "cgroup.procs") if emu else None

                def enter_cgroup(path=procs_file):
                    if path:  # in the child, before exec: every byte it moves is charged to its node
                        with open(path, "w") as f:
                            f.write(str(os.getpid()))

                procs.append(subprocess.Popen(cmd, env=env, stdout=md if r == 0 else subprocess.DEVNULL,
                                              preexec_fn=enter_cgroup, cwd=REPO_ROOT))
            # Every rank's exit; a rank that failed leaves the others blocked in a collective until the
            # group's timeout: they get RANK_GRACE_S to fail on their own, then are killed.
            deadline = time.monotonic() + args.timeout * 3
            failed_at = None
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if failed_at is None and any(c for c in codes if c is not None):
                    failed_at = now
                    log(f"world {n}: a rank failed (exit statuses {codes}); the others get {RANK_GRACE_S:.0f} s")
                if now > deadline or (failed_at is not None and now > failed_at + RANK_GRACE_S):
                    log(f"world {n}: ranks still running ({codes}): killed")
                    return 124
                time.sleep(0.2)
            if any(codes):
                log(f"world {n}: exit statuses {codes}")
            return codes[0] or (1 if any(codes) else 0)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def describe(args: argparse.Namespace, emulated: bool) -> str:
    if not emulated:
        return ("not emulated (--no-emulate): every rank on this machine, plain directories on one disk, no "
                "throttling; 'nodes' are FASTCKPT_NODE names only")
    return (f"emulated on one machine: N nodes = N ranks, each in its own cgroup v1 blkio cgroup throttled to "
            f"B = {args.link_mbps:g} MB/s read and write on the shared filesystem's loop device and on its node's own "
            f"(ext4 on loop devices, losetup --direct-io=on, over sparse files on {args.dir}); ranks share this "
            f"machine's {os.cpu_count()} CPUs, memory and page cache (a buffered read by one rank can serve another), "
            f"gloo over loopback; other work on the machine is not stopped (the load average at each world "
            f"size's start is in the notes)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=REPO_ROOT, help="where the filesystem images (or plain directories) go "
                                                     "(default: the repository root, i.e. the project's disk)")
    ap.add_argument("--worlds", default=None, help="world sizes = emulated nodes (default 1,2,4; --quick: 1,2)")
    ap.add_argument("--size", type=parse_size, default=None, help="state dict bytes (default 512M; --quick: 64M)")
    ap.add_argument("--link-mbps", type=float, default=100.0, help="B, each node's read and write bandwidth, MB/s "
                                                                   "(default 100)")
    ap.add_argument("--modes", default="rank0,collective,node,fastdcp,dcp", help="bench_cluster.py --modes")
    ap.add_argument("--out", default=None, help="results directory (default build/bench-cluster, or with --json "
                                               "its directory/cluster)")
    ap.add_argument("--json", default=None, help="also write benchmarks/report.py's standalone JSON here")
    ap.add_argument("--no-emulate", action="store_true", help="plain directories, no root, no throttling")
    ap.add_argument("--drop-caches", action="store_true", help="bench_cluster.py --drop-caches")
    ap.add_argument("--quick", action="store_true", help="--size 64M --worlds 1,2")
    ap.add_argument("--timeout", type=float, default=600, help="per-rank process group timeout, s (default 600)")
    args = ap.parse_args(argv)
    args.worlds = [int(x) for x in (args.worlds or ("1,2" if args.quick else "1,2,4")).split(",") if x]
    args.size = args.size or parse_size("64M" if args.quick else "512M")
    args.dir = os.path.abspath(args.dir)
    args.out = os.path.abspath(args.out or (os.path.join(os.path.dirname(os.path.abspath(args.json)), "cluster")
                                            if args.json else DEFAULT_OUT))
    if not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir}: not a directory")

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through the emulation's teardown
    signal.signal(signal.SIGTERM, on_term)
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):  # one run's files, never a mix of two runs
        if name.startswith("w") and name.endswith((".json", ".md")):
            os.remove(os.path.join(args.out, name))
    errors: List[str] = []
    runs: List[Dict[str, Any]] = []
    why = None if args.no_emulate else why_not_emulated()
    if why:
        log(f"cannot emulate nodes here: {why} (--no-emulate runs on plain directories, unthrottled)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"title": cluster_report.TITLE, "columns": [], "rows": [], "targets": [],
                           "notes": [f"not run: cannot emulate nodes here: {why}"], "errors": []}, f, indent=1)
            return 0
        return 2
    fs_bytes = int(args.size * 1.5) + 256 * MiB
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        emu = None
        plain = None
        if args.no_emulate:
            plain = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastckpt-cluster-plain-", dir=args.dir))
        else:
            log(f"setting up {max(args.worlds)} node filesystems + 1 shared ({fs_bytes / 1e9:.2f} GB each, loop "
                f"devices on {args.dir}), blkio cgroups at {args.link_mbps:g} MB/s")
            emu = stack.enter_context(Emulation(args.dir, max(args.worlds), fs_bytes, int(args.link_mbps * 1e6)))
        for n in args.worlds:
            js, md = os.path.join(args.out, f"w{n}.json"), os.path.join(args.out, f"w{n}.md")
            log(f"== world size {n}: {n} rank(s), {args.size / 1e9:.2f} GB state dict")
            t = time.perf_counter()
            code = run_world(n, args, emu, plain, js, md)
            log(f"   world size {n}: exit {code} in {time.perf_counter() - t:.0f} s")
            if os.path.exists(js):
                with open(js) as f:
                    runs.append(json.load(f))
            if code:
                errors.append(f"world size {n}: bench_cluster.py exited {code} (see {md} and the log above)")
    paths = cluster_report.write(runs, args.out)
    log(f"done in {time.perf_counter() - t0:.0f} s")
    for p in paths:
        print(os.path.relpath(p))
    if args.json:
        png = next((p for p in paths if p.endswith(".png")), None)
        rel = os.path.relpath(png, os.path.dirname(os.path.abspath(args.json))) if png else None
        with open(args.json, "w") as f:
            json.dump(cluster_report.standalone(runs, rel, errors), f, indent=1)
            f.write("\n")
    for e in errors:
        log(f"ERROR: {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
