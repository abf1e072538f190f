#!/usr/bin/env python
"""Crash-consistency driver: SIGKILL checkpoint saves at random moments and
check that nothing is lost (issue #6, README "Guarantees").

    python tests/crash/crash_driver.py --kills 200 --kinds save,async_save,dcp2,manager --seed 1

Each round: a good previous checkpoint exists and its bytes are remembered; a
child process saves a fresh, different checkpoint over it (or, for DCP, into
the next step directory beside it) and is killed with SIGKILL at a random
moment. The child is slowed down by the engine's fault hook (a plan taken from
the environment variable FASTCKPT_CRASH_FAULTS, "op:nth:delay_ms[:path],...")
so that kills land during writes, in fdatasync (between the data and the
rename), just before the rename, in the directory fsync after it, and during
the manager's `latest` update. Then the parent checks:

* the previous checkpoint is bitwise what it was, or (the save completed) the
  final name holds the new checkpoint, which loads with verify=True and equals
  what was being saved; nothing else ever sits under a final name;
* manager: `latest` names a complete checkpoint that loads and is exact;
* DCP (world size 2, gloo on 127.0.0.1, each step in its own directory): the
  previous step's directory is untouched; the new one either has no
  `.metadata` (and dcp.load refuses it) or loads exactly with FastReader;
* a manager start removes every `.fastckpt-tmp.` leftover, and the next save
  succeeds.

Children are forked from a multiprocessing forkserver that has torch and
fastckpt imported already (a kill round then costs milliseconds, not an
interpreter start). `--child KIND` runs one save in the foreground, for
reproducing a round by hand with FASTCKPT_CRASH_FAULTS set.

Prints counts per kind, per fault plan and per outcome; exits 1 on any violation.
"""

import argparse
import collections
import hashlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback

TMP_MARK = ".fastckpt-tmp."
KINDS = ("save", "async_save", "dcp2", "manager")
# name -> fault plan (FASTCKPT_CRASH_FAULTS syntax); {d} is a random delay in ms.
PLANS = {
    "none": "",
    "writes": "write:1:{d}",                       # kills land between/inside pwrites
    "fsync": "fsync:1:{D}",                        # in fdatasync, and in the directory fsync after the rename
    "rename": "rename:1:{D}",                      # data durable, not yet renamed
    "latest": "write:1:{D}:latest,fsync:1:{D}:latest,rename:1:{D}:latest",  # manager: the `latest` update
}
ENV = "FASTCKPT_CRASH_FAULTS"


# ---------------------------------------------------------------- shared by parent and children

def make_state(gen: int, rank: int = 0):
    """The checkpoint content of generation ``gen``: deterministic, different per gen."""
    import torch
    g = torch.Generator().manual_seed(1000 * gen + rank)
    return {
        "gen": gen,
        "w": torch.randn(256, 1024, generator=g),           # 1 MiB: 16 writes of 64 KiB
        "b": torch.randint(0, 1 << 30, (4099,), generator=g, dtype=torch.int64),
        "h": torch.randn(777, generator=g).to(torch.bfloat16),
        "meta": {"name": f"gen{gen}", "lr": 0.1 * gen},
    }


def same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def arm_faults(plan: str) -> None:
    """Arm the engine's fault hook from "op:nth:delay_ms[:path],..." (delays only)."""
    from fastckpt import _C
    for rule in filter(None, plan.split(",")):
        op, nth, delay, *rest = rule.split(":")
        _C.fault_inject(op, nth=int(nth), delay_ms=int(delay), times=0,
                        path_contains=rest[0] if rest else "")


def _child(kind: str, directory: str, gen: int, plan: str, conn, rank: int = 0, port: int = 0) -> None:
    """One save (runs in a forked child, or in the foreground with --child)."""
    import fastckpt
    import torch
    if plan:
        os.environ[ENV] = plan
    arm_faults(os.environ.get(ENV, ""))
    with fastckpt.knobs.override(buffer_size=64 << 10, buffer_count=4, queue_depth=4):
        state = make_state(gen, rank)
        if kind == "dcp2":
            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp
            from fastckpt.dcp import FastWriter
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            sd = {f"r{rank}": state, "shared": make_state(gen, 99)["w"]}
            conn.send("started")
            dcp.save(sd, storage_writer=FastWriter(os.path.join(directory, f"step_{gen:04d}")))
            dist.barrier()
            dist.destroy_process_group()
        elif kind == "manager":
            mgr = fastckpt.CheckpointManager(directory, keep_last=2)
            conn.send("started")
            if gen % 2:
                mgr.async_save(gen, state)
                mgr.wait()
            else:
                mgr.save(gen, state)
        else:
            path = os.path.join(directory, "ckpt.pt")
            conn.send("started")
            if kind == "async_save":
                fastckpt.async_save(state, path).result()
            else:
                fastckpt.save(state, path)
    conn.send("done")


class _Stdout:
    def send(self, msg):
        print(msg, flush=True)


# ---------------------------------------------------------------- parent

def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tree_hash(directory) -> dict:
    return {n: _sha(os.path.join(directory, n)) for n in sorted(os.listdir(directory))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_dcp(directory):
    import torch
    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastReader
    gen = int(os.path.basename(directory).split("_")[1])
    target = {f"r{r}": {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v)
                        for k, v in make_state(gen, r).items()} for r in (0, 1)}
    target["shared"] = torch.empty_like(make_state(gen, 99)["w"])
    dcp.load(target, storage_reader=FastReader(directory, verify=True))
    return gen, target


def _expected_dcp(gen):
    return {"r0": make_state(gen, 0), "r1": make_state(gen, 1), "shared": make_state(gen, 99)["w"]}


class Driver:
    def __init__(self, root: str, seed: int, verbose: bool = False):
        self.root = root
        self.rng = random.Random(seed)
        self.verbose = verbose
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "fastckpt", "torch.distributed.checkpoint", "fastckpt.dcp"])
        self.counts = collections.Counter()
        self.violations = []
        self.est = collections.defaultdict(lambda: 0.4)  # seconds a save of (kind, plan) takes
        self.gen = {}
        self.prev = {}   # kind -> what must still be there
        for k in KINDS:
            os.makedirs(os.path.join(root, k), exist_ok=True)

    def fail(self, kind, plan, msg):
        self.violations.append(f"[{kind}/{plan}] {msg}")
        print(f"VIOLATION [{kind}/{plan}]: {msg}", flush=True)

    # -- establishing a good previous checkpoint (in the parent, uninterrupted)
    def establish(self, kind):
        import fastckpt
        import torch.distributed.checkpoint as dcp  # noqa: F401
        d = os.path.join(self.root, kind)
        g = self.gen.get(kind, 0) + 1
        self.gen[kind] = g
        if kind in ("save", "async_save"):
            fastckpt.save(make_state(g), os.path.join(d, "ckpt.pt"))
            self.prev[kind] = (g, _sha(os.path.join(d, "ckpt.pt")))
        elif kind == "manager":
            fastckpt.CheckpointManager(d, keep_last=2).save(g, make_state(g))
            self.prev[kind] = (g, _sha(os.path.join(d, f"step_{g:08d}.pt")))
        else:  # dcp2: a complete step directory, written here by a (non-killed) 2-rank run
            self._run_children(kind, g, "", kill_at=None)
            sd = os.path.join(d, f"step_{g:04d}")
            self.prev[kind] = (g, _tree_hash(sd))
            for n in os.listdir(d):  # older steps are not needed any more
                if n != f"step_{g:04d}":
                    shutil.rmtree(os.path.join(d, n))

    def _run_children(self, kind, gen, plan, kill_at):
        """Start the child(ren), kill them ``kill_at`` seconds after they started
        saving (None: let them finish). Returns (killed, seconds)."""
        d = os.path.join(self.root, kind)
        ranks = (0, 1) if kind == "dcp2" else (0,)
        port = _free_port() if kind == "dcp2" else 0
        procs, conns = [], []
        for r in ranks:
            a, b = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=_child, args=(kind, d, gen, plan, b, r, port), daemon=True)
            p.start()
            b.close()
            procs.append(p)
            conns.append(a)
        try:
            for c in conns:
                if not c.poll(120):
                    raise RuntimeError(f"{kind}: child never started")
                assert c.recv() == "started"
            t0 = time.monotonic()
            deadline = t0 + (kill_at if kill_at is not None else 120)
            while time.monotonic() < deadline and any(p.is_alive() for p in procs):
                for p in procs:
                    p.join(timeout=0.002)
            alive = [p for p in procs if p.is_alive()]
            took = time.monotonic() - t0
            if kill_at is None and alive:
                raise RuntimeError(f"{kind}: uninterrupted save did not finish")
            for p in alive:
                os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join()
            if not alive:
                for p, c in zip(procs, conns):
                    if p.exitcode != 0 or not c.poll(0) or c.recv() != "done":
                        raise RuntimeError(f"{kind}: child exited {p.exitcode} without finishing")
            return bool(alive), took
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                    p.join()
            for c in conns:
                c.close()

    def round(self, kind):
        plans = ["none", "writes", "fsync", "rename"] + (["latest"] if kind == "manager" else [])
        plan_name = self.rng.choice(plans)
        plan = PLANS[plan_name].format(d=self.rng.randint(5, 40), D=self.rng.randint(100, 400))
        if kind not in self.prev:
            self.establish(kind)
        old_gen = self.prev[kind][0]
        new_gen = old_gen + 1
        est = self.est[(kind, plan_name)]
        kill_at = self.rng.uniform(0, est * 1.15)
        try:
            killed, took = self._run_children(kind, new_gen, plan, kill_at)
        except Exception as e:  # noqa: BLE001
            self.fail(kind, plan_name, f"child failed: {e}")
            return False
        if not killed:
            self.est[(kind, plan_name)] = 0.6 * est + 0.4 * took
        self.counts[(kind, "killed" if killed else "finished")] += 1
        try:
            outcome = getattr(self, "check_" + ("file" if kind in ("save", "async_save") else kind))(
                kind, old_gen, new_gen, killed)
        except Exception as e:  # noqa: BLE001
            self.fail(kind, plan_name, f"check raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
            outcome = "error"
        self.counts[(kind, plan_name, outcome)] += 1
        self.counts[(kind, outcome)] += 1
        if killed and outcome == "new_complete":
            self.counts[(kind, "killed_after_rename")] += 1
        return killed
        if self.verbose:
            print(f"{kind:10s} {plan_name:7s} kill_at={kill_at:.3f}s killed={killed} -> {outcome}", flush=True)

    # -- checks
    def _cleanup_with_manager(self, d):
        import fastckpt
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fastckpt.CheckpointManager(d, keep_last=None)  # its start removes leftovers of dead processes
        left = [n for n in os.listdir(d) if TMP_MARK in n]
        if left:
            raise AssertionError(f"manager start left temporaries: {left}")

    def check_file(self, kind, old_gen, new_gen, killed):
        import fastckpt
        d = os.path.join(self.root, kind)
        path = os.path.join(d, "ckpt.pt")
        names = os.listdir(d)
        tmps = [n for n in names if TMP_MARK in n]
        others = [n for n in names if TMP_MARK not in n and n != "ckpt.pt"]
        if others:
            raise AssertionError(f"unexpected names {others}")
        if not killed and tmps:
            raise AssertionError(f"a completed save left {tmps}")
        if _sha(path) == self.prev[kind][1]:
            got = fastckpt.load(path, verify=True)
            if not same(got, make_state(old_gen)):
                raise AssertionError("old checkpoint loads but differs from what was saved")
            outcome = "old_intact"
        else:
            got = fastckpt.load(path, verify=True)
            if not same(got, make_state(new_gen)):
                raise AssertionError("final name holds neither the old nor the new checkpoint")
            self.prev[kind] = (new_gen, _sha(path))
            self.gen[kind] = new_gen
            outcome = "new_complete"
        if tmps:
            self.counts[(kind, "leftover_tmp")] += 1
            self._cleanup_with_manager(d)
        return outcome

    def check_manager(self, kind, old_gen, new_gen, killed):
        import fastckpt
        d = os.path.join(self.root, kind)
        old_name, new_name = f"step_{old_gen:08d}.pt", f"step_{new_gen:08d}.pt"
        names = os.listdir(d)
        tmps = [n for n in names if TMP_MARK in n]
        if not killed and tmps:
            raise AssertionError(f"a completed save left {tmps}")
        if _sha(os.path.join(d, old_name)) != self.prev[kind][1]:
            raise AssertionError(f"{old_name} changed")
        latest = open(os.path.join(d, "latest")).read().strip()
        if latest not in (old_name, new_name):
            raise AssertionError(f"latest names {latest!r}")
        for n in names:  # whatever sits under a step name is complete
            if TMP_MARK not in n and n.startswith("step_"):
                g = int(n[5:13])
                if not same(fastckpt.load(os.path.join(d, n), verify=True), make_state(g)):
                    raise AssertionError(f"{n} is not what was saved")
        if tmps:
            self.counts[(kind, "leftover_tmp")] += 1
        if os.path.exists(os.path.join(d, new_name)) and latest == old_name:
            self.counts[(kind, "new_file_latest_old")] += 1
        mgr = fastckpt.CheckpointManager(d, keep_last=2)  # cleans leftovers
        left = [n for n in os.listdir(d) if TMP_MARK in n]
        if left:
            raise AssertionError(f"manager start left temporaries: {left}")
        r = mgr.load_latest()
        if r is None or not same(r.state, make_state(r.step)) or r.step not in (old_gen, new_gen):
            raise AssertionError(f"load_latest gave {r and r.step}")
        if latest == new_name:
            if r.step != new_gen:
                raise AssertionError("load_latest skipped the checkpoint latest names")
            self.prev[kind] = (new_gen, _sha(os.path.join(d, new_name)))
            self.gen[kind] = new_gen
            return "new_complete"
        if os.path.exists(os.path.join(d, new_name)):
            # complete but `latest` not moved yet: drop it, so the next round starts from a known state
            os.unlink(os.path.join(d, new_name))
        return "old_intact"

    def check_dcp2(self, kind, old_gen, new_gen, killed):
        from fastckpt.dcp import FastReader
        d = os.path.join(self.root, kind)
        old_dir, new_dir = os.path.join(d, f"step_{old_gen:04d}"), os.path.join(d, f"step_{new_gen:04d}")
        if _tree_hash(old_dir) != self.prev[kind][1]:
            raise AssertionError("the previous step directory changed")
        g, got = _load_dcp(old_dir)
        if not same(got, _expected_dcp(g)):
            raise AssertionError("previous step loads but differs")
        if os.path.exists(os.path.join(new_dir, ".metadata")):
            g, got = _load_dcp(new_dir)
            if not same(got, _expected_dcp(new_gen)):
                raise AssertionError("new step has .metadata but differs from what was saved")
            if [n for n in os.listdir(new_dir) if TMP_MARK in n]:
                raise AssertionError("complete DCP checkpoint with temporaries in it")
            shutil.rmtree(old_dir)
            self.prev[kind] = (new_gen, _tree_hash(new_dir))
            self.gen[kind] = new_gen
            return "new_complete"
        if not killed:
            raise AssertionError("finished save without .metadata")
        if os.path.isdir(new_dir):
            try:
                FastReader(new_dir).read_metadata()
            except FileNotFoundError as e:  # must be refused, clearly
                if "not a complete DCP checkpoint" not in str(e):
                    raise AssertionError(f"incomplete DCP dir refused with an unclear error: {e}")
            else:
                raise AssertionError("an incomplete DCP directory has readable metadata")
            if [n for n in os.listdir(new_dir) if TMP_MARK in n]:
                self.counts[(kind, "leftover_tmp")] += 1
            shutil.rmtree(new_dir)  # FORMAT.md 2.4: MAY be deleted
        return "old_intact"

    def final_saves(self, kinds):
        """After all the kills: one uninterrupted save per kind succeeds."""
        for kind in kinds:
            try:
                old_gen = self.prev[kind][0] if kind in self.prev else None
                if old_gen is None:
                    continue
                self._run_children(kind, old_gen + 1, "", kill_at=None)
                fn = getattr(self, "check_" + ("file" if kind in ("save", "async_save") else kind))
                if fn(kind, old_gen, old_gen + 1, False) != "new_complete":
                    raise AssertionError("final uninterrupted save did not complete")
                self.counts[(kind, "final_save_ok")] += 1
            except Exception as e:  # noqa: BLE001
                self.fail(kind, "final", f"{type(e).__name__}: {e}")

    def report(self, kinds, elapsed):
        print(f"crash driver: {elapsed:.1f} s, root {self.root}")
        total = 0
        for kind in kinds:
            k, f = self.counts[(kind, "killed")], self.counts[(kind, "finished")]
            total += k
            plans = sorted({key[1] for key in self.counts if len(key) == 3 and key[0] == kind})
            per_plan = ", ".join(
                f"{p}: " + "/".join(str(self.counts[(kind, p, o)]) for o in ("old_intact", "new_complete"))
                for p in plans)
            print(f"  {kind:10s} kills={k:4d} finished={f:3d}  old_intact={self.counts[(kind, 'old_intact')]:4d} "
                  f"new_complete={self.counts[(kind, 'new_complete')]:4d} leftover_tmp={self.counts[(kind, 'leftover_tmp')]:3d}"
                  + f" killed_after_rename={self.counts[(kind, 'killed_after_rename')]:3d}"
                  + (f" new_file_latest_old={self.counts[(kind, 'new_file_latest_old')]}" if kind == "manager" else "")
                  + f"  [plan: old/new {per_plan}]")
        print(f"  total kills={total} violations={len(self.violations)}")
        return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=200, help="kills in all, spread evenly over the kinds (saves that finish before their kill come on top)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="work directory (default: a fresh temporary one, removed on success)")
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("--child", choices=KINDS, help="run one save in the foreground (fault plan from $" + ENV + ")")
    ap.add_argument("--gen", type=int, default=1)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.dir or ".", args.gen, "", _Stdout())
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown kinds {bad}")
    import logging
    import warnings
    logging.getLogger("fastckpt").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = args.dir or tempfile.mkdtemp(prefix="fastckpt-crash-")
    drv = Driver(root, args.seed, args.verbose)
    t0 = time.monotonic()
    kills, i = collections.Counter(), 0
    per_kind = {k: args.kills // len(kinds) + (1 if j < args.kills % len(kinds) else 0) for j, k in enumerate(kinds)}
    while any(kills[k] < per_kind[k] for k in kinds) and i < 4 * args.kills + 8:
        kind = kinds[i % len(kinds)]
        i += 1
        if kills[kind] < per_kind[kind] and drv.round(kind):
            kills[kind] += 1
    drv.final_saves(kinds)
    drv.report(kinds, time.monotonic() - t0)
    if drv.violations:
        print("VIOLATIONS:\n" + "\n".join(drv.violations))
        return 1
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
