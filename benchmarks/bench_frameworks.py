#!/usr/bin/env python3
"""Framework checkpoints: each framework's own durable save against the same save through
fastckpt.integrations, for the same model and optimizer state.

* Lightning: ``trainer.save_checkpoint(path)`` (what ModelCheckpoint calls: the Trainer gathers the
  state, then its CheckpointIO plugin writes it) with the default ``TorchCheckpointIO`` (+ fsync of
  the file and its directory, so that both saves are durable) against ``FastCheckpointIO``;
* Accelerate: ``accelerator.save_state(dir)`` (safetensors weights, optimizer, scheduler, RNG) with
  Accelerate's own code (+ fsync of every file and of the directories) against ``use_fastckpt``
  (which is also atomic per directory).

The model: a stack of 4096x4096 (narrower below 600 MB) float32 linear layers with AdamW state (two more copies after one
step), about --size bytes of state in all. Every operation runs in a fresh Python process (the
framework, the model and one training step are set up before the clock starts; imports are not
timed), the operations interleaved round by round (--rounds); seconds are medians over the rounds.
The targets: Lightning and Accelerate checkpoints >= 2x faster than their (durable) defaults.

Run alone: ``python benchmarks/bench_frameworks.py [--size 1G] [--rounds 3] [--dir DIR] [--json OUT]
[--quick]``. Timing figures depend on the machine and on what else runs on it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks.harness import parse_size, emit_standalone, pair_targets  # noqa: E402
from fastckpt._core.units import human  # noqa: E402

OPS = ["Lightning TorchCheckpointIO+fsync", "Lightning FastCheckpointIO",
       "Accelerate save_state+fsync", "Accelerate save_state, use_fastckpt"]
PAIRS = {"Lightning FastCheckpointIO": ("Lightning TorchCheckpointIO+fsync", 2.0),
         "Accelerate save_state, use_fastckpt": ("Accelerate save_state+fsync", 2.0)}

_CHILD = r'''
import json, logging, os, sys, time, warnings
sys.path.insert(0, sys.argv[4])
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
import torch
size, op, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
WIDTH = 4096  # float32 params; AdamW adds two copies: size / 3 of parameters
if size / 3 < WIDTH * WIDTH * 4:  # small runs (tests): one narrower layer
    WIDTH = max(64, int((size / 12) ** 0.5))
layers = max(1, round(size / 3 / (WIDTH * WIDTH * 4)))
torch.manual_seed(0)

def model():
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])

def fsync_tree(root):
    if os.path.isfile(root):
        files, dirs = [root], [os.path.dirname(root)]
    else:
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        dirs = [root, os.path.dirname(root)]
    for p in files:
        fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)
    for p in dirs:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY); os.fsync(fd); os.close(fd)

if op.startswith("Lightning"):
    import lightning.pytorch as pl
    from fastckpt.integrations.lightning import FastCheckpointIO

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__(); self.net = model()
        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    fast = "Fast" in op
    t = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   plugins=[FastCheckpointIO()] if fast else None)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(2, WIDTH)), batch_size=2)
    t.fit(M(), dl)
    t0 = time.perf_counter()
    t.save_checkpoint(path)
    if not fast:
        fsync_tree(path)
    seconds = time.perf_counter() - t0
else:
    from accelerate import Accelerator
    from fastckpt.integrations.accelerate import use_fastckpt
    acc = Accelerator(cpu=True)
    if "fastckpt" in op:
        use_fastckpt(acc)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    m, opt, sched = acc.prepare(m, opt, sched)
    acc.backward(m(torch.randn(2, WIDTH)).pow(2).mean()); opt.step(); sched.step()
    t0 = time.perf_counter()
    acc.save_state(path)
    if "fastckpt" not in op:
        fsync_tree(path)
    seconds = time.perf_counter() - t0
nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) \
    if os.path.isdir(path) else os.path.getsize(path)
print(json.dumps({"seconds": seconds, "bytes": nbytes, "layers": layers, "width": WIDTH}))
'''


def run_op(size: int, op: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(size), op, path, REPO], capture_output=True,
                         text=True, check=False, env=dict(os.environ, PYTHONPATH=REPO))
    if out.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(size: int, rounds: int, directory: str) -> dict:
    times = {op: [] for op in OPS}
    nbytes = {}
    layers = width = 0
    for r in range(rounds):
        for i, op in enumerate(OPS):
            path = os.path.join(directory, f"op{i}-r{r}" + (".ckpt" if op.startswith("Lightning") else ""))
            res = run_op(size, op, path)
            times[op].append(res["seconds"])
            nbytes[op], layers, width = res["bytes"], res["layers"], res["width"]
            print(f"  round {r + 1}: {op}: {res['seconds']:.3f} s", file=sys.stderr, flush=True)
    return {"size": size, "rounds": rounds, "layers": layers, "width": width, "bytes": nbytes,
            "seconds": {op: statistics.median(v) for op, v in times.items()}}


def report(res: dict) -> dict:
    s = res["seconds"]
    rows = []
    for op in OPS:
        ref = PAIRS.get(op)
        speed = round(s[ref[0]] / s[op], 2) if ref and s[op] > 0 else ""
        rows.append([op, round(s[op], 3), round(res["bytes"][op] / s[op] / 1e9, 2) if s[op] > 0 else None,
                     res["bytes"][op], speed])
    targets = pair_targets(s, PAIRS)
    size = max(res["bytes"].values())
    return {"title": f"Framework checkpoints, {human(size)} of model and AdamW state: the frameworks' own "
                     "durable saves against fastckpt.integrations",
            "columns": ["operation", "seconds", "GB/s", "bytes written", "speed vs default"],
            "rows": rows, "targets": targets,
            "notes": [f"medians of {res['rounds']} interleaved round(s), a fresh process per operation; "
                      f"{res['layers']} layers of {res['width']}x{res['width']} float32 + AdamW state after one step; saves "
                      "durable (the defaults: fsync of every file written and of its directory, timed)",
                      "Lightning: trainer.save_checkpoint (state gathering + the CheckpointIO plugin); "
                      "Accelerate: save_state (weights as safetensors, optimizer, scheduler, RNG states; "
                      "use_fastckpt also writes the directory atomically)"],
            "errors": [], "raw": res}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="bytes of model + optimizer state (default 1G)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the results here (benchmarks/report.py's format)")
    ap.add_argument("--quick", action="store_true", help="200M, one round")
    a = ap.parse_args(argv)
    size = parse_size("200M" if a.quick else a.size)
    rounds = 1 if a.quick else a.rounds
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="bench_frameworks.") as d:
        res = bench(size, rounds, d)
    return emit_standalone(report(res), a.json)

if __name__ == "__main__":
    sys.exit(main())
