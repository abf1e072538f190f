"""Upload and download throughput against a local S3 endpoint.

fastckpt's uploader (:func:`fastckpt.remote.upload`: parallel multipart,
CRC-32 while reading) against ``s3fs``'s ``put_file`` and boto3's
``upload_file`` (its TransferManager), downloads likewise (fastckpt's ranged
parallel reads with the CRC check and the engine's commit, ``s3fs.get_file``,
boto3's ``download_file``), the upload of one file split across ``--ranks``
processes (each a share of the parts of one multipart upload, as the
CheckpointManager's ranks do in collective mode: fastckpt/remote/team.py),
and the time a fresh node takes to restore the newest step
(:meth:`Replicator.restore`: list, manifest, download, CRC, commit).

The endpoint is moto's standalone server on this machine
(tests/support/s3_server.py), an in-memory Python server: it is the
bottleneck, far slower than S3 or a real S3-compatible store, so the figures
compare the clients' overheads on one machine, not what a real store gives.

    python benchmarks/bench_remote.py --size 128M --reps 3 [--ranks 2] [--dir DIR] [--json out.json] [--quick]

``--json`` writes benchmarks/report.py's STANDALONE format (``make bench`` puts it in the report).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))

from s3_server import BUCKET, REGION, MotoServer  # noqa: E402


def _size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


def _timed(fn, reps):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


_worker_store = None


def _worker_init(url, opts):
    global _worker_store
    from fastckpt.remote import open_store
    _worker_store = open_store(url, opts)


def _worker_share(args):
    """One process's share of a shared multipart upload: its parts, sent; (what each returned, bytes)."""
    key, token, local, share = args
    from fastckpt.remote import TransferStats, TransferOptions
    from fastckpt.remote.transfer import send_parts
    stats = TransferStats()
    fd = os.open(local, os.O_RDONLY)
    try:
        up = _worker_store.join_upload(key, token)
        sent = send_parts(up, fd, share, TransferOptions(), local, _worker_store.key_url(key), stats)
    finally:
        os.close(fd)
    return sent, stats.bytes


def _split_upload(store, pool, ranks, local, n, key):
    """Rank 0 (here) creates the upload and sends share 0, the pool's processes the others, rank 0 completes
    it; returns every process's bytes."""
    from fastckpt.remote import TransferOptions, TransferStats
    from fastckpt.remote.transfer import complete_upload, plan_parts, send_parts, split_parts
    opts = TransferOptions()
    shares = split_parts(plan_parts(store, n, opts), ranks)
    up = store.begin_upload(key, n)
    others = pool.map_async(_worker_share, [(key, up.token, local, shares[r]) for r in range(1, ranks)])
    stats = TransferStats()
    fd = os.open(local, os.O_RDONLY)
    try:
        sent = send_parts(up, fd, shares[0], opts, local, store.key_url(key), stats)
    finally:
        os.close(fd)
    got = others.get(600)
    for s, _ in got:
        sent.update(s)
    complete_upload(store, up, key, sent, n, opts, f"upload of {local}")
    return [stats.bytes] + [b for _, b in got]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="128M", help="bytes of the checkpoint file (K/M/G)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the figures here too (benchmarks/report.py's STANDALONE format)")
    ap.add_argument("--dir", default=None, help="where the local files go (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="32M, one repetition")
    ap.add_argument("--ranks", type=int, default=2, help="processes sharing one upload (the split row)")
    a = ap.parse_args(argv)
    if a.quick:
        a.size, a.reps = "32M", 1
    size = _size(a.size)

    import boto3
    import s3fs
    import torch
    import fastckpt
    from fastckpt.remote import Replicator, download, open_store, upload

    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-remote-", dir=a.dir) as d:
        srv = MotoServer(os.path.join(d, "moto.log"))
        try:
            opts = srv.storage_options()
            local = os.path.join(d, "step_1.pt")
            fastckpt.save({"w": torch.randint(0, 255, (size,), dtype=torch.uint8)}, local)
            n = os.path.getsize(local)
            store = open_store(f"s3://{BUCKET}/bench", opts)
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
            b3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name=REGION, aws_access_key_id=srv.key,
                              aws_secret_access_key=srv.secret)

            def fc_up():
                fd = os.open(local, os.O_RDONLY)
                try:
                    upload(store, "fc.pt", fd, n, name=local)
                finally:
                    os.close(fd)

            rows = {}
            rows["upload fastckpt"] = _timed(fc_up, a.reps)
            rows["upload s3fs put_file"] = _timed(lambda: fs.put_file(local, f"{BUCKET}/bench/s3fs.pt"), a.reps)
            rows["upload boto3 upload_file"] = _timed(lambda: b3.upload_file(local, BUCKET, "bench/boto3.pt"), a.reps)
            import multiprocessing
            with multiprocessing.get_context("spawn").Pool(a.ranks - 1, _worker_init,
                                                           (f"s3://{BUCKET}/bench", opts)) as pool:
                pool.map(abs, range(a.ranks - 1))  # started before the clock runs
                shares = []
                rows[f"upload fastckpt split across {a.ranks} processes"] = _timed(
                    lambda: shares.append(_split_upload(store, pool, a.ranks, local, n, "split.pt")), a.reps)
            if store.size("split.pt") != n or shares[-1] and sum(shares[-1]) != n:
                raise RuntimeError(f"the split upload sent {shares[-1]} bytes of {n}")
            out = os.path.join(d, "out.pt")
            rows["download fastckpt (CRC checked)"] = _timed(lambda: download(store, "fc.pt", out), a.reps)
            rows["download s3fs get_file"] = _timed(lambda: fs.get_file(f"{BUCKET}/bench/s3fs.pt", out), a.reps)
            rows["download boto3 download_file"] = _timed(lambda: b3.download_file(BUCKET, "bench/boto3.pt", out),
                                                          a.reps)
            rep = Replicator(f"s3://{BUCKET}/run", opts)
            rep.submit(1, local).result()
            k = [0]

            def restore():
                k[0] += 1
                rep.restore(os.path.join(d, f"fresh{k[0]}"))

            rows["restore newest step (fresh node)"] = _timed(restore, a.reps)
            rep.close()
        finally:
            srv.stop()
    print(f"checkpoint {n / 2**20:.0f} MiB, median of {a.reps}, moto server on this machine (it is the bottleneck)")
    print(f"split upload: bytes per process {shares[-1]}")
    print("| operation | seconds | MB/s |")
    print("| --- | ---: | ---: |")
    for name, t in rows.items():
        print(f"| {name} | {t:.2f} | {n / t / 1e6:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report(n, a.reps, rows, shares[-1]), f, indent=1)
    return 0


def report(n: int, reps: int, rows: dict, shares=None) -> dict:
    """The STANDALONE contract of benchmarks/report.py: one table, no numeric target (none is asked for
    the figures), the endpoint said."""
    ref = {"upload": "upload fastckpt", "download": "download fastckpt (CRC checked)"}
    table = []
    for name, t in rows.items():
        mine = ref.get(name.split()[0])
        vs = round(rows[name] / rows[mine], 2) if mine and mine != name and rows[mine] > 0 else ""
        table.append([name, round(t, 3), round(n / t / 1e6, 1), vs])
    return {"title": f"Remote tier: upload, download and restore of a {n / 2 ** 20:.0f} MiB checkpoint "
                     "against a local S3 endpoint",
            "columns": ["operation", "seconds", "MB/s", "fastckpt's speed vs it"],
            "rows": table, "targets": [],
            "notes": [f"medians of {reps}; the endpoint is moto's standalone server on this machine, an in-memory "
                      "Python server and the bottleneck: the figures compare the clients' overheads here, not what "
                      "S3 or a real S3-compatible store gives",
                      "fastckpt's download includes the CRC-32 check and the engine's durable commit; the restore "
                      "is Replicator.restore on a fresh directory (list, manifest, download, CRC, commit)",
                      "the split upload: one multipart upload, each process sending a contiguous share of its parts "
                      f"(bytes per process: {shares}); on one machine the shared server is the limit, across nodes "
                      "each node's network is"],
            "errors": [], "raw": {"bytes": n, "reps": reps, "seconds": rows, "split_bytes_per_process": shares}}


if __name__ == "__main__":
    sys.exit(main())
