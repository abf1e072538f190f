#!/usr/bin/env python3
"""The remote tier: does compressing a checkpoint with zipnn before its upload pay?

For each kind of data, every tensor compressed by ``zipnn.ZipNN(bytearray_dtype=<its dtype>,
threads=<CPUs>)`` (its lossless byte-grouping + Huffman/zstd codec, one call per tensor, the
tensor's bytes in a buffer of their own, as a file read before an upload would be) and
decompressed again; bitwise-compared with the original. Data:

* the benchmark's state (``benchmarks/workload.py``: float32/bfloat16 weights and AdamW moments,
  ``torch.randn``): random mantissas barely compress;
* trained-looking weights: N(0, 0.02) cast to bfloat16, and the same in float32 (what zipnn is
  built for: the exponent byte of trained weights takes few values).

Per row: the size on disk with and without zipnn, compress and decompress GB/s (tensor bytes /
wall time, median of --reps) and CPU-s/GB (this process, every zipnn thread), and what it means
for an upload over a link of L bytes/s, compressing first (serially): raw / L against compress +
zipped / L; compressing pays below L* = (raw - zipped) / compress time; a restore (download, then
decompress) pays below (raw - zipped) / decompress time. Overlapping compression with the
upload (streaming) pays wherever zipped / L and the compress time both stay below raw / L,
i.e. for links slower than the compress rate. Nothing here uploads: the link speeds are
arithmetic on the measured figures.

Run alone: ``python benchmarks/bench_zipnn.py [--size 512M] [--reps 3] [--json OUT]`` (``--quick``:
32M, one repetition); report.py renders its JSON (its STANDALONE contract).
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if REPO_ROOT not in sys.path:  # the checkout's `benchmarks` package
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from benchmarks.harness import MiB, SEED, emit_standalone, parse_size, timed  # noqa: E402
from benchmarks.workload import build_state_dict, iter_tensors  # noqa: E402

LINKS = (100e6, 1e9)  # bytes/s: a cloud upload of one process, a fast one
DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def datasets(size: int):
    """(name, [tensors]) of about size bytes each."""
    g = torch.Generator().manual_seed(SEED)
    state = [t for t in iter_tensors(build_state_dict(size)) if t.dtype in DTYPES and t.numel() > 0]
    trained = (torch.randn(size // 4, generator=g) * 0.02)
    return [("bench state (workload.py: randn weights + AdamW moments, fp32/bf16)", state),
            ("trained-looking weights: N(0, 0.02) as bfloat16", [trained.to(torch.bfloat16).repeat(2)]),
            ("trained-looking weights: N(0, 0.02) as float32", [trained])]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def measure(tensors, reps: int, threads: int):
    import zipnn

    codecs = {dt: zipnn.ZipNN(bytearray_dtype=name, threads=threads) for dt, name in DTYPES.items()}
    raw = sum(t.nbytes for t in tensors)
    comp_s, dec_s, comp_cpu, dec_cpu, zipped, ok = [], [], [], [], 0, True
    for _ in range(reps):
        # zipnn's compress scrambles the buffer it is given (in place, even a bytes object): each call gets
        # a copy of the tensor's bytes, made outside the timing (a file's bytes read for the upload)
        bufs = [bytearray(_bytes(t)) for t in tensors]
        t, (out, _, _) = timed(lambda: [codecs[x.dtype].compress(b) for x, b in zip(tensors, bufs)])
        comp_s.append(t["seconds"])
        comp_cpu.append(t["cpu_s"])
        del bufs
        zipped = sum(len(c) for c in out)
        t, (back, _, _) = timed(lambda: [codecs[x.dtype].decompress(c) for x, c in zip(tensors, out)])
        dec_s.append(t["seconds"])
        dec_cpu.append(t["cpu_s"])
        ok = ok and all(bytes(b) == _bytes(x) for x, b in zip(tensors, back))
        del out, back
    c, d = statistics.median(comp_s), statistics.median(dec_s)
    return {"raw": raw, "zipped": zipped, "compress_s": c, "decompress_s": d,
            "compress_cpu_per_gb": statistics.median(comp_cpu) / (raw / 1e9),
            "decompress_cpu_per_gb": statistics.median(dec_cpu) / (raw / 1e9), "verified": ok}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=None, help="bytes of each data set (default 512M; --quick 32M)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions, medians (default 3; --quick 1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="zipnn threads (default: the CPUs)")
    ap.add_argument("--dir", default=None, help="unused (nothing is written to disk); accepted for report.py")
    ap.add_argument("--json", default=None, help="also write the results here (benchmarks/report.py's format)")
    ap.add_argument("--quick", action="store_true", help="32M, one repetition")
    a = ap.parse_args(argv)
    size = a.size or (32 * MiB if a.quick else 512 * MiB)
    reps = a.reps or (1 if a.quick else 3)
    rep = {"title": "zipnn before an upload: the remote tier's compression question",
           "columns": ["data", "raw MB", "zipnn MB", "zipnn/raw", "compress GB/s", "decompress GB/s",
                       "compress CPU-s/GB", "decompress CPU-s/GB"]
           + [f"upload s at {lk / 1e6:g} MB/s: raw / zipnn" for lk in LINKS]
           + ["zipnn pays for uploads below MB/s", "zipnn pays for restores below MB/s", "check"],
           "rows": [], "targets": [], "notes": [], "errors": [], "raw": {}}
    try:
        import zipnn  # noqa: F401
        from importlib.metadata import version
        zv = version("zipnn")
    except Exception as e:  # noqa: BLE001
        rep["errors"].append(f"zipnn not importable ({type(e).__name__}: {e}); install requirements-dev.txt "
                             "(`.venv/bin/pip install -c .venv/torch-constraint.txt -r requirements-dev.txt`)")
        return emit_standalone(rep, a.json)
    torch.set_num_threads(1)
    for name, tensors in datasets(size):
        print(f"zipnn: {name} ...", file=sys.stderr, flush=True)
        m = measure(tensors, reps, a.threads)
        rep["raw"][name] = m
        saved = m["raw"] - m["zipped"]
        up = [f"{m['raw'] / lk:.2f} / {m['compress_s'] + m['zipped'] / lk:.2f}" for lk in LINKS]
        pays_up = saved / m["compress_s"] / 1e6 if saved > 0 else 0.0
        pays_restore = saved / m["decompress_s"] / 1e6 if saved > 0 else 0.0
        rep["rows"].append([name, round(m["raw"] / 1e6, 1), round(m["zipped"] / 1e6, 1),
                            round(m["zipped"] / m["raw"], 3), round(m["raw"] / m["compress_s"] / 1e9, 3),
                            round(m["raw"] / m["decompress_s"] / 1e9, 3), round(m["compress_cpu_per_gb"], 2),
                            round(m["decompress_cpu_per_gb"], 2)] + up
                           + [round(pays_up, 1), round(pays_restore, 1),
                              "verified" if m["verified"] else "MISMATCH"])
        if not m["verified"]:
            rep["errors"].append(f"{name}: the decompressed bytes differ from the original")
    rep["notes"] += [
        f"zipnn {zv}, ZipNN(bytearray_dtype=<the tensor's dtype>, threads={a.threads}), one call per tensor; "
        f"{size / 1e6:.0f} MB per data set, medians of {reps}; nothing written to disk or uploaded",
        "upload s: raw / L against compress time + zipped / L (compress, then upload); zipnn pays for uploads below "
        "L* = (raw - zipped) / compress time, for restores (download, then decompress) below (raw - zipped) / "
        "decompress time; overlapped with the upload it pays on links slower than the compress GB/s",
        "zipnn's compress() scrambles the buffer it is given, in place (a torch tensor, a bytearray, even an "
        "immutable bytes object): the bench gives it a copy of each tensor's bytes (made outside the timing); "
        "a caller compressing live tensors must copy them first",
    ]
    return emit_standalone(rep, a.json)


if __name__ == "__main__":
    sys.exit(main())
