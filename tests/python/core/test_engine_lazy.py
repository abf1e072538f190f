"""Fixed costs grow lazily: a fresh process's engine touches and
registers only the staging buffers its I/O used, and `import fastckpt` does not
import what a plain save or load does not need. Counts, never times."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fastckpt
from fastckpt import _C
import fastspawn  # noqa: E402
from engines import drop_page_cache, held_in_page_cache, make_config, uring_refusal

MiB = 1 << 20

_FRESH_LOAD = textwrap.dedent("""
    import json, sys
    import fastckpt
    from fastckpt import _C
    path = sys.argv[1]
    # The disk path: every page-cache read reports a miss (the kernel's readahead,
    # 8 MiB on some disks, may have cached the whole file whatever the test evicts).
    _C.fault_inject("read_cached", nth=1, errno=11, times=0)
    eng = fastckpt.get_engine()
    before = {"touched": eng.buffers_touched, "registered": eng.buffers_registered,
              "resident": eng.buffers_resident_bytes}
    sd = fastckpt.load(path)
    assert sorted(sd) == sorted(sys.argv[2].split(",")), sorted(sd)
    after = {"touched": eng.buffers_touched, "registered": eng.buffers_registered,
             "resident": eng.buffers_resident_bytes, "available": eng.buffers_available,
             "backend": eng.backend, "count": eng.config.buffer_count, "size": eng.config.buffer_size}
    print(json.dumps({"before": before, "after": after}))
""")


def _small_state():
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate([51200, 25600, 12800, 6400, 4000])}
    sd["step"] = torch.tensor(7)
    return sd


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_fresh_process_small_load_touches_only_what_it_used(tmp_path, backend):
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    path = tmp_path / "small.pt"
    sd = _small_state()
    fastckpt.save(sd, path)
    assert os.path.getsize(path) < 1 * MiB
    env = dict(os.environ, FASTCKPT_BACKEND=backend)
    for k in ("FASTCKPT_BUFFER_SIZE", "FASTCKPT_BUFFER_COUNT"):
        env.pop(k, None)  # the defaults: 8 x 8 MiB
    r = fastspawn.run([sys.executable, "-c", _FRESH_LOAD, str(path), ",".join(sd)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    before, after = out["before"], out["after"]
    # Making the engine (and its backend) touched no buffer.
    assert before == {"touched": 0, "registered": 0, "resident": 0}
    assert after["backend"] == ("io_uring" if backend == "uring" else "threads")
    assert after["count"] == 8 and after["size"] == 8 * MiB
    assert after["available"] == after["count"]
    # A load of a few hundred KB used a few buffers (3 today: parallel windows), not the pool.
    assert 1 <= after["touched"] < after["count"]
    # Only buffers handed out have backed pages, and not even all of theirs
    # (a 2 MiB huge page or a few small pages each): at most a quarter of the pool.
    assert 0 < after["resident"] <= after["touched"] * after["size"]
    assert after["resident"] <= after["count"] * after["size"] // 4
    # Small transfers pin no buffer.
    assert after["registered"] == 0


_FRESH_CACHED_LOAD = textwrap.dedent("""
    import json, sys
    import torch
    import fastckpt
    path = sys.argv[1]
    eng = fastckpt.get_engine()
    made = eng.backends_created
    sd = fastckpt.load(path)  # verify on (the default): CRCs checked
    ref = torch.load(path)
    assert sorted(sd) == sorted(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    print(json.dumps({"made_by_get_engine": made, "backends": eng.backends_created,
                      "touched": eng.buffers_touched, "resident": eng.buffers_resident_bytes}))
""")


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_fresh_process_small_cached_load_makes_no_backend_and_touches_no_buffer(tmp_path, backend):
    """A just-saved small checkpoint that is in the page cache (as torch.load would
    find it) is read with page-cache reads on the calling thread: no ring or thread
    pool is made, no staging buffer touched."""
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    path = tmp_path / "small.pt"
    fastckpt.save(_small_state(), path)
    env = dict(os.environ, FASTCKPT_BACKEND=backend)
    with held_in_page_cache(path):  # into the page cache (fastckpt.save writes with O_DIRECT), kept there
        r = fastspawn.run([sys.executable, "-c", _FRESH_CACHED_LOAD, str(path)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"made_by_get_engine": 0, "backends": 0, "touched": 0, "resident": 0}, out


def test_cold_load_still_reads_and_verifies(tmp_path):
    """The same checkpoint with its pages evicted from the page cache
    (posix_fadvise DONTNEED on the file: a cold cache for this file, without
    dropping the whole shared machine's) still loads right with verify on, and a
    damaged byte is still caught, whatever mix of cached and disk reads the
    kernel's readahead makes of it."""
    path = tmp_path / "small.pt"
    sd = _small_state()
    fastckpt.save(sd, path)
    drop_page_cache(path)
    got = fastckpt.load(path, verify=True)
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    raw = bytearray(path.read_bytes())
    off = raw.find(sd["w0"][:4].numpy().tobytes())
    assert off > 0
    raw[off + 4 * 1000 + 1] ^= 0x40
    path.write_bytes(bytes(raw))
    drop_page_cache(path)
    with pytest.raises(fastckpt.FormatError, match="w0"):
        fastckpt.load(path, verify=True)


def test_load_with_every_cached_read_missing_uses_the_disk_path(tmp_path):
    """The page cache refusing (RWF_NOWAIT unsupported: EOPNOTSUPP) or missing
    everything (EAGAIN): the load goes through a backend and staging, same result."""
    path = tmp_path / "small.pt"
    sd = _small_state()
    fastckpt.save(sd, path)
    path.read_bytes()  # cached: only the injected refusal sends the reads to the disk
    for err in (95, 11):  # EOPNOTSUPP, EAGAIN
        eng = _C.Engine(make_config())
        _C.fault_clear()
        _C.fault_inject("read_cached", nth=1, errno=err, times=0)
        out = torch.empty(os.path.getsize(path), dtype=torch.uint8)
        st = _C.read_ranges(eng, str(path), [(out, 0, True)])
        assert _C.fault_fired() >= 1
        assert st["cached_bytes"] == 0 and st["requests"] >= 1 and eng.backends_created == 1
        assert bytes(out.numpy()) == path.read_bytes()
        assert st["crcs"] == [_C.crc32(path.read_bytes())]
    _C.fault_clear()
    eng = _C.Engine(make_config())
    with held_in_page_cache(path):
        st = _C.read_ranges(eng, str(path), [(out, 0, True)])
    assert st["cached_bytes"] == out.numel() and st["requests"] == 0 and eng.backends_created == 0
    assert eng.buffers_touched == 0 and st["crcs"] == [_C.crc32(path.read_bytes())]


def test_large_transfers_register_their_buffers_once(tmp_path):
    if uring_refusal():
        pytest.skip(uring_refusal())
    eng = _C.Engine(make_config(backend="uring", buffer_size=1 * MiB, buffer_count=4, queue_depth=4))
    assert (eng.buffers_touched, eng.buffers_registered, eng.buffers_resident_bytes) == (0, 0, 0)
    data = torch.randint(0, 256, (4 * MiB + 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for name in ("a.bin", "b.bin"):
        w = _C.Writer(eng, str(tmp_path / name), -1)
        w.write(data)
        w.commit()
        assert (tmp_path / name).read_bytes() == data.numpy().tobytes()
    assert eng.buffers_touched >= 2
    assert eng.buffers_registered == eng.buffers_touched  # each at its first full-buffer write, once
    assert eng.buffer_registrations_refused == 0
    assert eng.buffers_available == 4


def test_small_transfers_leave_their_buffers_unregistered(tmp_path):
    # Registering faults in and pins the whole buffer: a save or load that fills less than half
    # of one (a 1 MiB state in 8 MiB buffers) pays for its own pages only.
    if uring_refusal():
        pytest.skip(uring_refusal())
    eng = _C.Engine(make_config(backend="uring", buffer_size=4 * MiB, buffer_count=4, queue_depth=4))
    data = torch.randint(0, 256, (MiB + 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for name in ("a.bin", "b.bin"):
        w = _C.Writer(eng, str(tmp_path / name), -1)
        w.write(data)
        assert w.commit()["direct"]
    out = torch.empty_like(data)
    _C.read_ranges(eng, str(tmp_path / "a.bin"), [(out, 0)])
    assert torch.equal(out, data) and (tmp_path / "b.bin").read_bytes() == data.numpy().tobytes()
    assert eng.buffers_touched >= 1 and eng.buffers_registered == 0
    assert eng.buffers_resident_bytes < 4 * MiB  # the pages the transfers used, not whole buffers
    # A transfer that fills the buffer registers it.
    big = torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    w = _C.Writer(eng, str(tmp_path / "c.bin"), -1)
    w.write(big)
    w.commit()
    assert eng.buffers_registered >= 1


def test_refused_registration_falls_back_to_plain_io(tmp_path):
    if uring_refusal():
        pytest.skip(uring_refusal())
    eng = _C.Engine(make_config(backend="uring", buffer_size=1 * MiB, buffer_count=4, queue_depth=4))
    data = torch.randint(0, 256, (3 * MiB + 7,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    _C.fault_inject("uring_register", nth=2, errno=12)  # the first buffer's registration: ENOMEM
    w = _C.Writer(eng, str(tmp_path / "a.bin"), -1)
    w.write(data)
    st = w.commit()
    assert _C.fault_fired() == 1
    assert st["backend"] == "io_uring"
    assert (tmp_path / "a.bin").read_bytes() == data.numpy().tobytes()
    out = torch.empty_like(data)
    _C.read_ranges(eng, str(tmp_path / "a.bin"), [(out, 0)])
    assert torch.equal(out, data)
    assert eng.buffer_registrations_refused == 1
    # The other full-buffer writes registered theirs (the read's small tail did not).
    assert 1 <= eng.buffers_registered <= eng.buffers_touched - 1


def test_import_fastckpt_leaves_the_manager_and_dcp_for_later():
    code = textwrap.dedent("""
        import sys
        import fastckpt
        heavy = ("fastckpt.manager", "fastckpt.dcp", "torch.distributed.checkpoint")
        print(",".join(m for m in heavy if m in sys.modules))
        from fastckpt import CheckpointManager
        assert fastckpt.CheckpointManager is CheckpointManager
        assert fastckpt.manager.CheckpointManager is CheckpointManager
        assert "CheckpointManager" in dir(fastckpt) and "FastWriter" in dir(fastckpt)
        assert callable(fastckpt.async_save) and not isinstance(fastckpt.async_save, type(sys))
        print("ok")
    """)
    r = fastspawn.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines == ["", "ok"], lines


def test_parsing_a_small_checkpoint_reads_it_once(tmp_path, monkeypatch):
    """The zip directory of a small file (<= 1 MiB) is parsed from one read of
    the whole file, not a block, the tail and a batch of local headers one after
    the other; a larger file still reads its local headers in a batch."""
    from fastckpt.formats import zip as _zip
    small, large = tmp_path / "small.pt", tmp_path / "large.pt"
    fastckpt.save(_small_state(), small)
    fastckpt.save({"big": torch.zeros(600_000), **_small_state()}, large)
    assert os.path.getsize(small) <= _zip._WHOLE_FILE < os.path.getsize(large)
    preads, batches = [], []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: preads.append((n, off)) or real_pread(fd, n, off))

    def read_many(items):
        batches.append(len(items))
        for buf, off in items:
            buf[:] = real_pread(fd, len(buf), off)

    with open(small, "rb") as f:
        fd = f.fileno()
        a = _zip.Archive.parse(f, str(small), read_many)
    assert preads == [(os.path.getsize(small), 0)] and batches == []
    assert sorted(a.records) == sorted(_zip.Archive.open(str(small)).records)
    preads.clear()
    with open(large, "rb") as f:
        fd = f.fileno()
        a = _zip.Archive.parse(f, str(large), read_many)
    assert len(batches) == 1 and len(a.records) == len(_zip.Archive.open(str(large)).records)
