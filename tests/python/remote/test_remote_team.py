"""fastckpt.remote.team: a step replicated by every rank of a job, each uploading its part.

The ranks are threads of this process here, each with its own client of one c10d store
(HashStore; the manager uses the job's TCPStore the same way, test_manager_remote_ranks.py
runs it with real processes): rank 0's Replicator with its Coordinator, the other ranks'
Workers. Against moto's S3 server (through s3fs and the fault proxy) and a file:// tier:
sharded directories (each rank its own files), one file split across ranks (one multipart
upload, a share of its parts each), a rank failing its upload or dying (no manifest, the
failure named on rank 0 and on the failing rank), a lost answer to the shared upload's
complete, a step saved again while its upload is planned.
"""
import errno
import os
import uuid
import zlib

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from fastckpt.remote import LocalCheckpoint, Replicator, TransferOptions, open_store, read_manifest  # noqa: E402
from fastckpt.remote import manifest as mf  # noqa: E402
from fastckpt.remote.team import Coordinator, RanksFailed, Worker, owner_of  # noqa: E402

from s3_server import is_complete_upload, is_part_upload  # noqa: E402

MiB = 1 << 20
FAST = dict(part_size=5 * MiB, parallelism=2, attempts=2, backoff_s=0.01, max_backoff_s=0.02, peer_timeout=2)


class Team:
    """``world`` ranks replicating the checkpoints under ``directory`` to ``url``."""

    def __init__(self, url, opts, world, directory, missing=(), **transfer):
        self.opts = TransferOptions(**dict(FAST, **transfer))
        store = torch_dist.HashStore()
        prefix = f"test/{uuid.uuid4().hex}"
        self.rep = Replicator(url, opts, transfer=self.opts,
                              team=Coordinator(store.clone(), prefix, world, self.opts))
        self.workers = {r: Worker(store.clone(), prefix, r, world, open_store(url, opts), directory, self.opts)
                        for r in range(1, world) if r not in missing}
        self.store = self.rep.store

    def close(self):
        self.rep.close()
        for w in self.workers.values():
            w.close()


@pytest.fixture(params=["file", "s3"])
def tier(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'tier'}", None, None
    url, opts, proxy, _srv = request.getfixturevalue("s3")
    return url, opts, proxy


def _sharded(d, world, step, size=3000):
    files = {f"__{r}_0.distcp": os.urandom(size * (r + 1)) for r in range(world)}
    files[".metadata"] = b"m" * 100 + bytes([step])
    d.mkdir(parents=True)
    for k, v in files.items():
        (d / k).write_bytes(v)
    return files


def test_owner_of():
    assert [owner_of(n, 3) for n in ("__0_0.distcp", "__2_7.distcp", ".metadata", "__5_0.distcp", "x/__1_0.distcp")] \
        == [0, 2, 0, 0, 0]


def test_each_rank_uploads_its_own_files(tmp_path, tier):
    url, opts, proxy = tier
    team = Team(url, opts, 3, tmp_path / "ckpt")
    files = _sharded(tmp_path / "ckpt" / "step_7", 3, 7)
    try:
        m = team.rep.submit(7, tmp_path / "ckpt" / "step_7").result(60)
        assert [w.wait(30) for w in team.workers.values()] == [7, 7]
        assert sorted(f["path"] for f in m["files"]) == sorted(files)
        assert {f["path"]: f["crc32"] for f in m["files"]} == {k: zlib.crc32(v) for k, v in files.items()}
        # each rank sent the bytes of its own shard; rank 0 its own and .metadata
        assert team.rep.status()["bytes_uploaded"] == len(files["__0_0.distcp"]) + len(files[".metadata"])
        for r, w in team.workers.items():
            st = w.status()
            assert st["bytes_uploaded"] == len(files[f"__{r}_0.distcp"]) and st["last_complete"] == 7, st
        step, path = team.rep.restore(tmp_path / "fresh")
        assert step == 7 and all((tmp_path / "fresh" / "step_7" / k).read_bytes() == v for k, v in files.items())
    finally:
        team.close()


def test_one_file_is_split_across_ranks(tmp_path, tier):
    """A collective checkpoint (one file): on S3 one multipart upload, rank r sending share r of its
    parts, rank 0 completing it; on file:// (no upload to share) rank 0 alone."""
    url, opts, proxy = tier
    d = tmp_path / "ckpt"
    d.mkdir()
    data = os.urandom(16 * MiB + 5)  # 4 parts of 5 MiB: shares [1], [2], [3, 4]
    (d / "step_3.pt").write_bytes(data)
    team = Team(url, opts, 3, d)
    try:
        m = team.rep.submit(3, d / "step_3.pt").result(60)
        assert [w.wait(30) for w in team.workers.values()] == [3, 3]
        assert m["files"] == [{"path": "step_3.pt", "size": len(data), "crc32": zlib.crc32(data)}]
        got = [team.rep.status()["bytes_uploaded"]] + [w.status()["bytes_uploaded"] for w in team.workers.values()]
        if proxy is None:
            assert got == [len(data), 0, 0]
        else:
            assert got == [5 * MiB, 5 * MiB, 6 * MiB + 5]
            assert sum(1 for m_, p, _ in proxy.requests if is_part_upload(m_, p)) == 4
            assert sum(1 for m_, p, _ in proxy.requests if is_complete_upload(m_, p)) == 1
        step, path = team.rep.restore(tmp_path / "fresh")
        assert (step, open(path, "rb").read() == data) == (3, True)
    finally:
        team.close()


def test_a_rank_failing_its_upload_means_no_manifest(tmp_path, s3):
    url, opts, proxy, _ = s3
    team = Team(url, opts, 3, tmp_path / "ckpt")
    try:
        _sharded(tmp_path / "ckpt" / "step_1", 3, 1)
        team.rep.submit(1, tmp_path / "ckpt" / "step_1").result(60)
        [w.wait(30) for w in team.workers.values()]
        files = _sharded(tmp_path / "ckpt" / "step_2", 3, 2)
        proxy.add("500", count=None, match=lambda m, p: m == "PUT" and "step_2/__1_0.distcp" in p)
        fut = team.rep.submit(2, tmp_path / "ckpt" / "step_2")
        with pytest.raises(RanksFailed) as ei:
            team.rep.wait(60)
        msg = str(ei.value)
        assert ei.value.filename == f"{url}/step_2" and list(ei.value.failures) == [1], msg
        assert "rank 1:" in msg and f"{url}/step_2/__1_0.distcp" in msg and "injected by the test proxy" in msg, msg
        assert "no manifest written" in msg and isinstance(fut.exception(), RanksFailed)
        with pytest.raises(OSError) as e1:  # the failing rank: its own error
            team.workers[1].wait(30)
        assert f"{url}/step_2/__1_0.distcp" in str(e1.value) and "after 2 attempts" in str(e1.value), e1.value
        with pytest.raises(OSError, match="rank 1"):  # another rank: rank 0's verdict
            team.workers[2].wait(30)
        assert team.workers[2].status()["last_error_step"] == 2
        assert team.workers[2].wait(30) == 1  # raised once
        assert team.rep.list_steps() == [1]  # step 2 is never restored
        assert team.rep.restore(tmp_path / "fresh")[0] == 1
        assert all((tmp_path / "ckpt" / "step_2" / k).read_bytes() == v for k, v in files.items())  # untouched
        proxy.clear()
        _sharded(tmp_path / "ckpt" / "step_3", 3, 3)
        team.rep.submit(3, tmp_path / "ckpt" / "step_3").result(60)
        assert team.workers[2].wait(30) == 3 and team.rep.list_steps() == [1, 3]
    finally:
        team.close()


def test_a_rank_that_died_means_no_manifest(tmp_path, tier):
    """Rank 2 is gone (it never answers): rank 0 gives up after peer_timeout, names it, writes no
    manifest; the others learn the verdict."""
    url, opts, _ = tier
    team = Team(url, opts, 3, tmp_path / "ckpt", missing=(2,))
    try:
        _sharded(tmp_path / "ckpt" / "step_5", 3, 5)
        team.rep.submit(5, tmp_path / "ckpt" / "step_5")
        with pytest.raises(RanksFailed) as ei:
            team.rep.wait(60)
        assert list(ei.value.failures) == [2] and "gave no sign of life" in str(ei.value), ei.value
        with pytest.raises(OSError, match="rank 2 gave no sign of life"):
            team.workers[1].wait(30)
        assert team.rep.list_steps() == []
        assert sorted(mf.list_step_prefixes(team.store)) == [5]  # rank 0's and 1's files, no manifest
        Replicator(url, opts)  # the next start deletes the incomplete step
        assert sorted(mf.list_step_prefixes(team.store)) == []
    finally:
        team.close()


def test_a_lost_answer_to_the_shared_complete_is_checked(tmp_path, s3):
    url, opts, proxy, _ = s3
    d = tmp_path / "ckpt"
    d.mkdir()
    data = os.urandom(11 * MiB)
    (d / "step_4.pt").write_bytes(data)
    team = Team(url, opts, 2, d)
    try:
        fault = proxy.add("drop_reply", count=None, match=is_complete_upload)
        m = team.rep.submit(4, d / "step_4.pt").result(60)
        assert fault.fired >= 1 and m["files"][0]["crc32"] == zlib.crc32(data)
        assert team.workers[1].wait(30) == 4 and team.workers[1].status()["bytes_uploaded"] == 6 * MiB
        assert read_manifest(team.store, 4)["files"][0]["size"] == len(data)
    finally:
        team.close()


def test_a_step_saved_again_is_not_mixed(tmp_path):
    d = tmp_path / "step_1"
    _sharded(d, 2, 1)
    ino = os.stat(d).st_ino
    os.rename(d, tmp_path / "old")
    _sharded(d, 2, 1)  # saved again: another directory under the same name
    with pytest.raises(OSError) as ei:
        LocalCheckpoint(d, files=["__1_0.distcp"], ino=ino)
    assert ei.value.errno == errno.ESTALE and ei.value.filename == str(d)
    assert LocalCheckpoint(d, files=["__1_0.distcp"], ino=os.stat(d).st_ino).fds


def test_a_step_stays_pending_until_every_rank_uploaded_it(tmp_path, monkeypatch):
    """The manager's retention leaves alone what pending_names() names: a step queued or being
    uploaded (each rank opens its files only when its part begins)."""
    import threading
    from fastckpt.remote import team as team_mod
    gate, started = threading.Event(), threading.Event()
    real = team_mod._share

    def slow(store, job, rank, *a, **kw):
        if rank == 1:
            started.set()
            gate.wait(30)
        return real(store, job, rank, *a, **kw)

    monkeypatch.setattr(team_mod, "_share", slow)
    team = Team(f"file://{tmp_path / 'tier'}", None, 2, tmp_path / "ckpt")
    try:
        for s in (1, 2):
            _sharded(tmp_path / "ckpt" / f"step_{s}", 2, s)
        f1 = team.rep.submit(1, tmp_path / "ckpt" / "step_1")
        assert started.wait(30)
        team.rep.submit(2, tmp_path / "ckpt" / "step_2")
        assert sorted(team.rep.pending_names()) == ["step_1", "step_2"]
        gate.set()
        assert f1.result(30)["step"] == 1 and team.rep.wait(30) == 2
        assert team.rep.pending_names() == [] and team.workers[1].wait(30) == 2
    finally:
        gate.set()
        team.close()
