#!/usr/bin/env python3
"""Device-to-disk save and disk-to-device load of a CUDA state dict.

Compares fastckpt.save (the staging pool: D2H copies overlapped with the
writes) with torch.save + fsync, and fastckpt.load(map_location="cuda")
(chunks read into the pool, copied to the device while the next are read)
with torch.load, all durable / from a cold page cache where drop_caches is
allowed; then times async_save's blocking part against its snapshot. Reports
GB/s, the extra host memory (peak anonymous RSS growth, sampled) and checks
the data.
Run by benchmarks/gpu_check.sh; needs a CUDA device.
"""
import argparse
import os
import resource
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fastckpt  # noqa: E402
from benchmarks import harness  # noqa: E402  (parse_size, drop_caches: one copy, shared with `fastckpt bench`)
parse_size = harness.parse_size


def drop_caches():
    return harness.drop_caches() is None


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_anon_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """Peak growth of the process's anonymous RSS (heap, pinned staging)
    while the block runs, sampled every 5 ms (MB)."""

    def __enter__(self):
        import threading
        self.base = self.peak = _rss_anon_mb()
        self._stop = threading.Event()

        def run():
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, _rss_anon_mb())
        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_anon_mb())

    @property
    def growth(self):
        return self.peak - self.base


def fsync_path(p):
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=".")
    ap.add_argument("--size", default="4G")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device")
        return 77
    total = parse_size(a.size)
    dev = torch.device("cuda:0")
    g = torch.Generator(device=dev).manual_seed(0)
    sd, left, i = {}, total, 0
    while left > 0:  # 256 MiB bf16/fp32 tensors plus small ones
        n = min(left, 256 << 20)
        dt = torch.bfloat16 if i % 2 else torch.float32
        sd[f"w{i}"] = torch.randn(n // torch.tensor([], dtype=dt).element_size(), device=dev, generator=g, dtype=dt)
        left -= n
        i += 1
    for j in range(200):
        sd[f"small{j}"] = torch.randn(1000, device=dev, generator=g)
    nbytes = sum(t.nbytes for t in sd.values())
    torch.cuda.synchronize()
    work = tempfile.mkdtemp(prefix=".bench-gpu-", dir=a.dir)
    print(f"state dict: {nbytes / 1e9:.2f} GB on {torch.cuda.get_device_name(0)}; dir {work}; "
          f"drop_caches {'works' if drop_caches() else 'NOT allowed: loads may be warm'}")
    try:
        p1, p2 = os.path.join(work, "f.pt"), os.path.join(work, "t.pt")
        for rep in range(a.reps):
            t = time.perf_counter()
            with PeakRss() as rs:
                fastckpt.save(sd, p1)
            ts = time.perf_counter() - t
            r0, r1 = 0, rs.growth
            t = time.perf_counter()
            torch.save(sd, p2)
            fsync_path(p2)
            tt = time.perf_counter() - t
            print(f"rep {rep}: save  fastckpt {nbytes / ts / 1e9:6.2f} GB/s (peak RSS +{r1 - r0:.0f} MB)   "
                  f"torch.save+fsync {nbytes / tt / 1e9:6.2f} GB/s")
            drop_caches()
            t = time.perf_counter()
            with PeakRss() as rl:
                x = fastckpt.load(p1, map_location="cuda:0")
                torch.cuda.synchronize()
            tl = time.perf_counter() - t
            ok = all(torch.equal(x[k], sd[k]) for k in sd)
            del x
            drop_caches()
            t = time.perf_counter()
            with PeakRss() as rt:
                y = torch.load(p2, map_location="cuda:0")
                torch.cuda.synchronize()
            tt = time.perf_counter() - t
            del y
            print(f"rep {rep}: load  fastckpt {nbytes / tl / 1e9:6.2f} GB/s (peak RSS +{rl.growth:.0f} MB)   "
                  f"torch.load {nbytes / tt / 1e9:6.2f} GB/s (peak RSS +{rt.growth:.0f} MB)   "
                  f"data {'equal' if ok else 'DIFFERENT'}")
            t = time.perf_counter()
            fut = fastckpt.async_save(sd, p2)
            tb = time.perf_counter() - t
            res = fut.result()
            print(f"rep {rep}: async_save blocked {tb:.2f} s (snapshot {res.snapshot_seconds:.2f} s, "
                  f"{nbytes / res.snapshot_seconds / 1e9:.1f} GB/s device-to-host), write {res.write_seconds:.2f} s")
            os.unlink(p2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
