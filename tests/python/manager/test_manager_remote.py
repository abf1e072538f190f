"""CheckpointManager(replicate_to=URL): committed steps reach the remote tier in the
background, retention applies per tier, and load_latest restores from the remote tier when the
local copy is missing or damaged, never an incomplete or damaged remote step; against a real S3
endpoint (moto's server, through s3fs and a fault-injecting proxy) and a second local filesystem
(file://)."""
import json
import os
import shutil
import time
import warnings

import pytest
import torch

import fastckpt
from fastckpt import CheckpointManager
from fastckpt.remote import list_steps, open_store
from fastckpt.remote.manifest import MANIFEST, step_prefix


def state(step: int):
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)},
            "optim": {"step": step, "m": torch.randn(1000, generator=g)}, "step": step}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.fixture(params=["file", "s3"])
def tier(request, tmp_path):
    """(URL, storage_options) of an empty remote tier."""
    if request.param == "file":
        d = tmp_path / "shared"
        d.mkdir()
        return f"file://{d}", None
    url, opts, _proxy, _srv = request.getfixturevalue("s3")
    return url, opts


def test_steps_are_replicated_and_kept_per_tier(tmp_path, tier):
    url, opts = tier
    with CheckpointManager(tmp_path / "a", keep_last=1, replicate_to=url, storage_options=opts,
                           keep_last_remote=2) as m:
        for step in (10, 20, 30):
            m.save(step, state(step))
            assert m.wait_remote() == step
        assert m.remote_status()["last_complete"] == 30 and m.remote_status()["last_error"] is None
        assert m.steps() == [30]  # local retention: 1
    assert list_steps(open_store(url, opts)) == [20, 30]  # remote retention: 2, the newest


def test_async_saves_are_replicated_after_their_commit(tmp_path, tier):
    url, opts = tier
    with CheckpointManager(tmp_path / "a", replicate_to=url, storage_options=opts) as m:
        fut = m.async_save(5, state(5))
        fut.result()
        assert m.wait_remote() == 5
    assert list_steps(open_store(url, opts)) == [5]


def test_a_fresh_node_restores_the_newest_step(tmp_path, tier):
    url, opts = tier
    with CheckpointManager(tmp_path / "old_node", replicate_to=url, storage_options=opts) as m:
        for step in (1, 2):
            m.save(step, state(step))
        m.wait_remote()
    with pytest.warns(RuntimeWarning, match="restored step 2"):
        with CheckpointManager(tmp_path / "new_node", replicate_to=url, storage_options=opts) as m2:
            r = m2.load_latest()
            assert r.step == 2 and same(r.state, state(2))
            assert m2.latest_name() == m2.name_for(2) and m2.steps() == [2]
            assert fastckpt.load(m2.path_for(2))["step"] == 2  # a local checkpoint now
            m2.wait_remote()
    # nothing was uploaded again for the restore (the remote tier still has the old node's two steps)
    assert list_steps(open_store(url, opts)) == [1, 2]


def test_a_damaged_local_copy_is_replaced_by_the_remote_one(tmp_path, tier):
    url, opts = tier
    d = tmp_path / "a"
    with CheckpointManager(d, replicate_to=url, storage_options=opts) as m:
        for step in (1, 2):
            m.save(step, state(step))
        m.wait_remote()
        p = m.path_for(2)
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside tensor data: a CRC mismatch
        p.write_bytes(bytes(data))
        with pytest.warns(RuntimeWarning, match="damaged"):
            r = m.load_latest()
        assert r.step == 2 and same(r.state, state(2))  # step 2 from the remote tier, not step 1 locally
        assert same(fastckpt.load(p), state(2))


def test_a_damaged_or_incomplete_remote_step_is_never_restored(tmp_path, moto_server, s3):
    url, opts, _proxy, _srv = s3
    with CheckpointManager(tmp_path / "a", replicate_to=url, storage_options=opts) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
            m.wait_remote()  # (a step still queued when the next one comes is superseded)
    store = open_store(url, opts)
    key = [k for k in store.list(step_prefix(2) + "/") if not k.endswith(MANIFEST)][0]
    raw = bytearray(store.get_range(key, 0, store.size(key)))
    raw[len(raw) // 2] ^= 0xFF
    store.put(key, bytes(raw))          # step 2: data that does not match its manifest's CRC-32
    store.delete([f"{step_prefix(3)}/{MANIFEST}"])  # step 3: no manifest (an upload killed before the end)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with CheckpointManager(tmp_path / "b", replicate_to=url, storage_options=opts, clean=False) as m2:
            r = m2.load_latest()
    assert r.step == 1 and same(r.state, state(1))
    assert any("step 2" in str(x.message) for x in w), [str(x.message) for x in w]


def test_remote_steps_newer_than_latest_are_not_restored(tmp_path, tier):
    """`latest` stays authoritative: after a rollback to step 1 locally, the remote step 2 is not loaded."""
    url, opts = tier
    d = tmp_path / "a"
    with CheckpointManager(d, keep_last=None, replicate_to=url, storage_options=opts) as m:
        for step in (1, 2):
            m.save(step, state(step))
            m.wait_remote()  # (step 1 still queued when step 2 comes would be superseded: never uploaded)
        (d / "latest").write_text(m.name_for(1) + "\n")  # a rollback: latest names step 1
        os.unlink(m.path_for(1))                        # ... whose local copy is gone
        with pytest.warns(RuntimeWarning):
            r = m.load_latest()
        assert r.step == 1 and same(r.state, state(1))


def test_upload_failures_are_reported_and_never_touch_training(tmp_path, s3):
    url, opts, proxy, _srv = s3
    with CheckpointManager(tmp_path / "a", replicate_to=url, storage_options=opts) as m:
        proxy.add("500", count=None, match=lambda method, path: method in ("PUT", "POST"))
        t = time.perf_counter()
        m.save(1, state(1))           # returns at once: the upload fails in the background
        assert time.perf_counter() - t < 30
        with pytest.raises(OSError) as ei:
            m.wait_remote()
        assert url.split("://")[1].split("/")[0] in str(ei.value)
        assert m.remote_status()["last_error"] is not None
        proxy.clear()
        assert same(m.load_latest().state, state(1))   # the local checkpoint is untouched
        m.save(2, state(2))
        assert m.wait_remote() == 2                     # the next step goes through
    assert list_steps(open_store(url, opts)) == [2]


def test_bad_credentials_or_bucket_fail_at_construction(tmp_path, moto_server, s3):
    url, opts, _proxy, _srv = s3
    bad = dict(opts, secret="wrong")
    with pytest.raises(PermissionError):
        CheckpointManager(tmp_path / "a", replicate_to=url, storage_options=bad)
    with pytest.raises(FileNotFoundError):
        CheckpointManager(tmp_path / "b", replicate_to="s3://no-such-bucket-here/x", storage_options=opts)


def test_sharded_checkpoints_are_replicated_and_restored(tmp_path, tier):
    url, opts = tier
    with CheckpointManager(tmp_path / "a", sharded=True, replicate_to=url, storage_options=opts) as m:
        m.save(7, {"w": torch.arange(1000.0), "step": 7})
        m.wait_remote()
    got = {"w": torch.zeros(1000), "step": 0}
    with pytest.warns(RuntimeWarning, match="restored step 7"):
        with CheckpointManager(tmp_path / "b", sharded=True, replicate_to=url, storage_options=opts) as m2:
            r = m2.load_latest(state=got)
    assert r.step == 7 and torch.equal(got["w"], torch.arange(1000.0))
    assert (tmp_path / "b" / m2.name_for(7) / ".metadata").exists()


def test_without_replicate_to_nothing_changes(tmp_path):
    with CheckpointManager(tmp_path / "a") as m:
        m.save(1, state(1))
        assert m.wait_remote() is None and m.remote_status() is None
