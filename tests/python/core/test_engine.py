"""The C++ engine through its bindings (fastckpt._C): round trips, backends,
O_DIRECT and io_uring fallbacks, injected faults, and concurrency."""
import errno
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt import _C
import fastspawn  # noqa: E402
from engines import drop_page_cache, make_config, uring_refusal
from leaks import fd_count, temp_files

SIZES = [0, 1, 4095, 4096, 4097, 3 * (64 << 10) + 5, (5 << 20) + 123]


def random_bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def save(engine, path, *chunks, expected=-1):
    w = _C.Writer(engine, str(path), expected)
    for c in chunks:
        w.write(c)
    return w.commit()


def read_all(engine, path, n):
    out = torch.empty(n, dtype=torch.uint8)
    _C.read_ranges(engine, str(path), [(out, 0)])
    return out


@pytest.mark.parametrize("size", SIZES)
def test_round_trip(small_engine, backend, tmp_path, size):
    data = random_bytes(size, seed=size)
    st = save(small_engine, tmp_path / "f.bin", data)
    assert st["bytes"] == size
    assert st["backend"] == ("io_uring" if backend == "uring" else "threads")
    assert os.path.getsize(tmp_path / "f.bin") == size
    assert (tmp_path / "f.bin").read_bytes() == data.numpy().tobytes()
    assert torch.equal(read_all(small_engine, tmp_path / "f.bin", size), data)
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("size", [1, 4097, (1 << 20) + 7])
def test_round_trip_buffered(tmp_path, size):
    eng = _C.Engine(make_config(direct=False, buffer_size=64 << 10, buffer_count=2))
    data = random_bytes(size)
    st = save(eng, tmp_path / "f.bin", data, expected=size)
    assert st["direct"] is False and "disabled" in st["fallback"]
    assert torch.equal(read_all(eng, tmp_path / "f.bin", size), data)


def test_many_chunks_and_preallocation(small_engine, tmp_path):
    chunks = [random_bytes(n, seed=n) for n in (1, 70000, 0, 4096, 131072, 3)]
    total = sum(c.numel() for c in chunks)
    st = save(small_engine, tmp_path / "f.bin", *chunks, expected=total + 10000)  # over-estimate
    assert st["bytes"] == total and os.path.getsize(tmp_path / "f.bin") == total
    assert torch.equal(read_all(small_engine, tmp_path / "f.bin", total), torch.cat(chunks))


def test_write_at_gaps_and_zeros(small_engine, tmp_path):
    a, b = random_bytes(100, 1), random_bytes(5000, 2)
    w = _C.Writer(small_engine, str(tmp_path / "f.bin"))
    w.write_at(a, 10)
    w.write_zeros(3)
    w.write_many([(b, 200000), b"xyz"])
    assert w.position == 205003
    with pytest.raises(ValueError, match="behind the current position"):
        w.write_at(a, 5)
    w.commit()
    raw = (tmp_path / "f.bin").read_bytes()
    assert len(raw) == 205003
    assert raw[:10] == bytes(10) and raw[10:110] == a.numpy().tobytes()
    assert raw[110:200000] == bytes(200000 - 110)
    assert raw[200000:205000] == b.numpy().tobytes() and raw[-3:] == b"xyz"


@pytest.mark.parametrize("max_len", [3000, 200000])
def test_read_ranges_scattered(small_engine, tmp_path, max_len):
    """Ranges in random order, overlapping, crossing buffer boundaries."""
    n = 1 << 20
    data = random_bytes(n, 7)
    save(small_engine, tmp_path / "f.bin", data)
    g = torch.Generator().manual_seed(max_len)
    ranges = []
    for _ in range(300):
        off = int(torch.randint(0, n - 1, (1,), generator=g))
        ln = int(torch.randint(0, min(max_len, n - off), (1,), generator=g))
        ranges.append((torch.empty(ln, dtype=torch.uint8), off))
    ranges.append((torch.empty(n, dtype=torch.uint8), 0))
    ranges.append((torch.empty(1, dtype=torch.uint8), n - 1))
    st = _C.read_ranges(small_engine, str(tmp_path / "f.bin"), ranges)
    for dst, off in ranges:
        assert torch.equal(dst, data[off:off + dst.numel()])
    assert st["bytes"] == sum(d.numel() for d, _ in ranges)
    if max_len == 3000:
        # 300 small ranges in 1 MiB: nearby ones share a read.
        assert st["requests"] < 100, st


def test_read_aligned_destination_goes_direct(small_engine, tmp_path):
    n = 256 << 10
    data = random_bytes(n, 9)
    save(small_engine, tmp_path / "f.bin", data)
    buf = mmap.mmap(-1, n)  # page-aligned, writable
    drop_page_cache(tmp_path / "f.bin")  # cached bytes would be copied from the page cache instead
    st = _C.read_ranges(small_engine, str(tmp_path / "f.bin"), [(buf, 0)])
    if not st["direct"]:
        pytest.skip("this filesystem refused O_DIRECT")
    assert st["direct_requests"] > 0
    assert bytes(buf) == data.numpy().tobytes()
    # An unaligned length: the aligned body still goes direct, the tail through staging.
    buf2 = mmap.mmap(-1, n)
    drop_page_cache(tmp_path / "f.bin")  # the first read's cache miss may have started readahead
    st = _C.read_ranges(small_engine, str(tmp_path / "f.bin"), [(memoryview(buf2)[:n - 3], 0)])
    assert st["direct_requests"] > 0 and 0 < st["staged_bytes"] <= 4096, st
    assert bytes(buf2)[:n - 3] == data.numpy().tobytes()[:n - 3] and bytes(buf2)[n - 3:] == bytes(3)


def test_crc32_matches_zlib_on_random_sizes_and_offsets():
    """_C.crc32 (ISA-L or zlib, whichever this build has) equals zlib.crc32 on
    tensors, bytes and memoryviews of random sizes at random misalignments,
    continued from a running value, and crc32_combine joins pieces."""
    import random
    import zlib
    rng = random.Random(12)
    data = random_bytes((1 << 20) + 200, 3)
    raw = data.numpy().tobytes()
    sizes = [0, 1, 15, 16, 17, 63, 64, 65, 4095, 4096, 65535, 65536, 65537, 1 << 20]
    sizes += [rng.randrange(300) for _ in range(40)] + [rng.randrange((1 << 20) + 1) for _ in range(40)]
    for n in sizes:
        at = rng.randrange(64)
        want = zlib.crc32(raw[at:at + n])
        assert _C.crc32(data[at:at + n]) == want, (n, at)  # a tensor starting at any byte
        assert _C.crc32(raw[at:at + n]) == want, (n, at)
        assert _C.crc32(memoryview(raw)[at:at + n]) == want, (n, at)
        k = rng.randrange(n + 1)
        assert _C.crc32(raw[at + k:at + n], _C.crc32(raw[at:at + k])) == want, (n, at, k)
        seed = rng.randrange(1 << 32)
        assert _C.crc32(raw[at:at + n], seed) == zlib.crc32(raw[at:at + n], seed), (n, at, seed)
        assert _C.crc32_combine(zlib.crc32(raw[at:at + k]), zlib.crc32(raw[at + k:at + n]), n - k) == want
    assert _C.crc32_impl() in ("isa-l", "zlib")


@pytest.mark.parametrize("direct", [True, False])
def test_read_ranges_returns_crc32_of_each_range(tmp_path, direct):
    """read_ranges(..., crc=True) or (dest, off, True) items: each range's CRC
    as zlib.crc32 of its bytes, for direct, staged, coalesced, overlapping and
    empty ranges; None for ranges that did not ask."""
    import random
    import zlib
    eng = _C.Engine(make_config(direct=direct, buffer_size=256 << 10, buffer_count=4))
    n = (3 << 20) + 4321
    data = random_bytes(n, 5)
    raw = data.numpy().tobytes()
    save(eng, tmp_path / "f.bin", data)
    rng = random.Random(7)
    items = [(torch.empty(n, dtype=torch.uint8), 0), (mmap.mmap(-1, 3 << 18), 4096),
             (bytearray(0), 17), (torch.empty(1, dtype=torch.uint8), n - 1)]
    for _ in range(200):
        ln = rng.choice([rng.randrange(1, 3000), rng.randrange(1, 1 << 20)])
        off = rng.randrange(n - ln + 1)
        items.append((torch.empty(ln, dtype=torch.uint8), off))
    st = _C.read_ranges(eng, str(tmp_path / "f.bin"), items, crc=True)
    assert len(st["crcs"]) == len(items)
    for (dst, off), crc in zip(items, st["crcs"]):
        got = bytes(dst.numpy().tobytes() if isinstance(dst, torch.Tensor) else dst)
        assert got == raw[off:off + len(got)]
        assert crc == zlib.crc32(got), (off, len(got))
    # per item: only those that ask
    mixed = [(torch.empty(5000, dtype=torch.uint8), 10, True), (torch.empty(5000, dtype=torch.uint8), 20),
             (torch.empty(70000, dtype=torch.uint8), 8192, False), (torch.empty(70000, dtype=torch.uint8), 8192, True)]
    st = _C.read_ranges(eng, str(tmp_path / "f.bin"), mixed)
    assert st["crcs"] == [zlib.crc32(raw[10:5010]), None, None, zlib.crc32(raw[8192:8192 + 70000])]
    assert "crcs" not in _C.read_ranges(eng, str(tmp_path / "f.bin"), mixed[1:3])


@pytest.mark.parametrize("direct", [True, False])
def test_read_ranges_fills_what_no_item_covers_in_a_buffer_laid_out_as_the_file(tmp_path, direct):
    """read_ranges(..., fill=[(buffer, offset)]): the buffer's bytes that no item covers (before,
    between and after the items inside it) are read too, in the same batch; the items' CRCs are
    theirs alone; an item inside a fill buffer must sit where the file puts it."""
    import zlib
    eng = _C.Engine(make_config(direct=direct, buffer_size=256 << 10, buffer_count=4))
    n = (2 << 20) + 777
    data = random_bytes(n, 9)
    raw = data.numpy().tobytes()
    save(eng, tmp_path / "f.bin", data)
    start = 4096 + 100
    block = torch.full((n - start - 50,), 0xEE, dtype=torch.uint8)
    spans = [(30, 5000), (5016, 9000), (70000, 600000), (600001, 600002)]  # holes of 16, 61000 bytes, ...
    items = [(block[a:b], start + a, True) for a, b in spans]
    other = torch.empty(1000, dtype=torch.uint8)  # an item outside every fill buffer
    st = _C.read_ranges(eng, str(tmp_path / "f.bin"), items + [(other, 7)], fill=[(block, start)])
    assert block.numpy().tobytes() == raw[start:start + block.numel()]
    assert other.numpy().tobytes() == raw[7:1007]
    assert st["crcs"][:len(spans)] == [zlib.crc32(raw[start + a:start + b]) for a, b in spans]
    assert st["bytes"] <= block.numel() + 1000  # each byte once
    # a buffer without items inside is read whole; an empty one is nothing
    whole = torch.empty(10000, dtype=torch.uint8)
    _C.read_ranges(eng, str(tmp_path / "f.bin"), [], fill=[(whole, 12345), (bytearray(0), 3)])
    assert whole.numpy().tobytes() == raw[12345:22345]
    for bad in ([(block[10:20], start + 11)],  # not where the file puts it
                [(block[10:20], start + 10), (block[15:30], start + 15)],  # overlapping inside it
                [(block[:10], start)]):  # reaching into it from before it
        with pytest.raises(ValueError, match="fill buffer"):
            _C.read_ranges(eng, str(tmp_path / "f.bin"), bad, fill=[(block[4:], start + 4)])
    own = torch.empty(10, dtype=torch.uint8)  # memory of its own, outside the buffer: fine
    _C.read_ranges(eng, str(tmp_path / "f.bin"), [(own, start)], fill=[(block, start)])
    assert own.numpy().tobytes() == raw[start:start + 10]


def test_read_past_end_is_format_error(small_engine, tmp_path):
    save(small_engine, tmp_path / "f.bin", random_bytes(1000))
    with pytest.raises(fastckpt.FormatError, match="truncated"):
        _C.read_ranges(small_engine, str(tmp_path / "f.bin"), [(torch.empty(10, dtype=torch.uint8), 995)])


def test_missing_files_are_oserrors(small_engine, tmp_path):
    with pytest.raises(FileNotFoundError) as ei:
        _C.read_ranges(small_engine, str(tmp_path / "nope"), [])
    assert ei.value.errno == errno.ENOENT and ei.value.filename == str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        _C.Writer(small_engine, str(tmp_path / "no-dir" / "f.bin"))


def test_odirect_refused_at_open_falls_back(tmp_path):
    eng = _C.Engine(make_config(buffer_size=64 << 10, buffer_count=2))
    _C.fault_inject("open", nth=1, errno=errno.EINVAL)
    data = random_bytes(100003)
    st = save(eng, tmp_path / "f.bin", data)
    assert _C.fault_fired() == 1
    assert st["direct"] is False and "open" in st["fallback"]
    assert torch.equal(read_all(eng, tmp_path / "f.bin", data.numel()), data)


def test_odirect_refused_at_first_write_falls_back(tmp_path):
    eng = _C.Engine(make_config(buffer_size=64 << 10, buffer_count=2))
    _C.fault_inject("write", nth=1, errno=errno.EINVAL)
    data = random_bytes(100003)
    st = save(eng, tmp_path / "f.bin", data)
    assert st["direct"] is False and "write" in st["fallback"]
    assert (tmp_path / "f.bin").read_bytes() == data.numpy().tobytes()


def test_uring_refused_falls_back_to_threads(tmp_path):
    if not _C.uring_compiled():
        pytest.skip("built without liburing")
    _C.fault_inject("uring_setup", nth=1, errno=errno.EPERM)
    eng = _C.Engine(make_config(backend="auto", buffer_size=64 << 10, buffer_count=2))
    assert eng.backend == "threads"
    assert "Operation not permitted" in eng.uring_refusal
    data = random_bytes(70000)
    assert save(eng, tmp_path / "f.bin", data)["backend"] == "threads"

    _C.fault_inject("uring_setup", nth=1, errno=errno.EPERM)
    forced = _C.Engine(make_config(backend="uring", buffer_size=64 << 10, buffer_count=2))
    with pytest.raises(PermissionError, match="io_uring"):
        forced.backend


FAULTS = [
    # (op, nth, errno, expected exception type, text in the message)
    ("write", 3, errno.ENOSPC, OSError, "pwrite"),
    ("write", 2, errno.EIO, OSError, "pwrite"),
    ("fsync", 1, errno.EIO, OSError, "fdatasync"),
    ("rename", 1, errno.EXDEV, OSError, "rename"),
    ("truncate", 1, errno.EIO, OSError, "ftruncate"),
    ("fallocate", 1, errno.ENOSPC, OSError, "fallocate"),
    ("open", 1, errno.EACCES, PermissionError, "open"),
]


@pytest.mark.parametrize("op,nth,err,exc,text", FAULTS)
def test_fault_leaves_old_file_and_no_debris(small_engine, tmp_path, op, nth, err, exc, text):
    target = tmp_path / "ckpt.bin"
    old = random_bytes(300001, 1)
    save(small_engine, target, old)
    new = random_bytes(500003, 2)
    fds = fd_count()
    _C.fault_inject(op, nth=nth, errno=err)
    with pytest.raises(exc) as ei:
        save(small_engine, target, new, expected=new.numel())
    assert _C.fault_fired() == 1
    e = ei.value
    assert e.errno == err
    assert text in str(e) and os.strerror(err) in str(e)
    assert str(tmp_path) in e.filename
    if op == "write":
        assert "off=" in str(e) and "len=" in str(e)
    assert target.read_bytes() == old.numpy().tobytes()  # untouched
    assert temp_files(tmp_path) == []
    assert fd_count() == fds
    assert small_engine.buffers_available == 4
    _C.fault_clear()
    save(small_engine, target, new)  # the engine still works
    assert target.read_bytes() == new.numpy().tobytes()


def test_fault_while_writing_inside_write_call_cleans_up(small_engine, tmp_path):
    # The error surfaces from write() (a buffer completes with an error while
    # later ones are being filled); the writer is unusable afterwards.
    _C.fault_inject("write", nth=2, errno=errno.EIO)
    w = _C.Writer(small_engine, str(tmp_path / "f.bin"))
    with pytest.raises(OSError) as ei:
        for _ in range(8):
            w.write(random_bytes(256 << 10))
    assert ei.value.errno == errno.EIO
    assert temp_files(tmp_path) == [] and not (tmp_path / "f.bin").exists()
    with pytest.raises(ValueError, match="aborted"):
        w.commit()


@pytest.mark.parametrize("op", ["write", "read"])
def test_short_transfers_and_eintr_are_retried(small_engine, tmp_path, op):
    data = random_bytes((1 << 20) + 17, 4)
    if op == "read":
        save(small_engine, tmp_path / "f.bin", data)
    _C.fault_inject(op, nth=2, short=4096, times=5)
    _C.fault_inject(op, nth=10, errno=errno.EINTR, times=50)
    _C.fault_inject(op, nth=70, errno=errno.EAGAIN, times=3)
    if op == "write":
        st = save(small_engine, tmp_path / "f.bin", data)
        assert st["requeued"] >= 58
    got = read_all(small_engine, tmp_path / "f.bin", data.numel())
    assert _C.fault_fired() >= 58
    assert torch.equal(got, data)


def test_read_fault_is_oserror(small_engine, tmp_path):
    save(small_engine, tmp_path / "f.bin", random_bytes(1 << 20))
    fds = fd_count()
    _C.fault_inject("read", nth=3, errno=errno.EIO)
    with pytest.raises(OSError) as ei:
        read_all(small_engine, tmp_path / "f.bin", 1 << 20)
    assert ei.value.errno == errno.EIO and "pread" in str(ei.value)
    assert fd_count() == fds and small_engine.buffers_available == 4


def test_writer_misuse(small_engine, tmp_path):
    with _C.Writer(small_engine, str(tmp_path / "f.bin")) as w:
        w.write(b"abc")
        tmp = w.tmp_path
        assert os.path.exists(tmp) and ".fastckpt-tmp." in tmp
    assert not os.path.exists(tmp) and not (tmp_path / "f.bin").exists()  # left without commit
    w = _C.Writer(small_engine, str(tmp_path / "f.bin"))
    w.write(b"abc")
    w.commit()
    with pytest.raises(ValueError, match="committed"):
        w.commit()
    with pytest.raises(ValueError, match="committed"):
        w.write(b"x")
    w.abort()  # no effect after commit
    assert (tmp_path / "f.bin").read_bytes() == b"abc"


def test_rejects_non_contiguous_and_cuda(small_engine, tmp_path):
    w = _C.Writer(small_engine, str(tmp_path / "f.bin"))
    with pytest.raises(ValueError, match="contiguous"):
        w.write(torch.zeros(4, 4).t())
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU"):
            w.write(torch.zeros(4, device="cuda"))
    w.abort()


def test_concurrent_writers_share_one_engine(backend, tmp_path):
    eng = _C.Engine(make_config(backend=backend, buffer_size=64 << 10, buffer_count=3, queue_depth=4))
    datas = [random_bytes((1 << 20) + i * 4099, seed=i) for i in range(6)]
    errors = []

    def work(i):
        try:
            for rep in range(3):
                save(eng, tmp_path / f"f{i}.bin", datas[i])
                assert torch.equal(read_all(eng, tmp_path / f"f{i}.bin", datas[i].numel()), datas[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert eng.buffers_available == 3
    assert temp_files(tmp_path) == []


def test_knobs_env_and_override(tmp_path):
    env = dict(os.environ, FASTCKPT_BACKEND="threads", FASTCKPT_BUFFER_SIZE="1M", FASTCKPT_QUEUE_DEPTH="3")
    code = "import fastckpt; e = fastckpt.get_engine(); print(e.backend, e.config.buffer_size, e.config.queue_depth)"
    out = fastspawn.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["threads", str(1 << 20), "3"]
    bad = dict(os.environ, FASTCKPT_BUFFER_SIZE="12345")
    r = fastspawn.run([sys.executable, "-c", code], env=bad, capture_output=True, text=True)
    assert r.returncode != 0 and "multiple of 4096" in r.stderr

    base = fastckpt.knobs.config().buffer_size
    with fastckpt.knobs.override(buffer_size=128 << 10, backend="threads"):
        eng = fastckpt.get_engine()
        assert eng.config.buffer_size == 128 << 10 and eng.backend == "threads"
    assert fastckpt.knobs.config().buffer_size == base
    with pytest.raises(ValueError, match="unknown fastckpt knob"):
        with fastckpt.knobs.override(bufer_size=1):
            pass
    with pytest.raises(ValueError):
        with fastckpt.knobs.override(backend="spdk"):
            pass


def test_kill_during_save_leaves_previous_file(tmp_path):
    """SIGKILL in the middle of a save: the final name keeps the old bytes."""
    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"old checkpoint")
    script = textwrap.dedent(f"""
        import sys, torch, fastckpt
        from fastckpt import _C
        eng = fastckpt.get_engine()
        _C.fault_inject("write", nth=1, delay_ms=20, times=0)  # slow every write down
        w = _C.Writer(eng, {str(target)!r})
        print("writing", flush=True)
        w.write(torch.ones(64 << 20, dtype=torch.uint8))
        w.commit()
        print("committed", flush=True)
    """)
    p = fastspawn.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    time.sleep(0.1)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    assert target.read_bytes() == b"old checkpoint"


def test_reading_while_this_thread_holds_every_buffer_raises_instead_of_hanging(small_engine, tmp_path):
    src = tmp_path / "src.bin"
    data = os.urandom(100000)
    src.write_bytes(data)
    drop_page_cache(src)  # from the page cache, the read would need no staging buffer
    w = _C.Writer(small_engine, str(tmp_path / "w.bin"), -1)
    w.write(torch.frombuffer(bytearray(os.urandom(1 << 20)), dtype=torch.uint8))  # holds all 4 buffers
    dst = torch.empty(len(data) + 1, dtype=torch.uint8)[1:]  # misaligned: needs staging buffers
    with pytest.raises(ValueError, match="this same thread"):
        _C.read_ranges(small_engine, str(src), [(dst, 0)])
    w.commit()
    _C.read_ranges(small_engine, str(src), [(dst, 0)])
    assert bytes(dst.numpy()) == data


# ---------------------------------------------------------------- leftovers, fork, inputs, errors

def _wait_for(cond, what, limit=120.0):
    """Poll until cond() is true; a hang guard, not a timing assertion."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


_SLOW_SAVE = textwrap.dedent("""
    import sys, torch, fastckpt
    from fastckpt import _C
    _C.fault_inject("write", nth=1, delay_ms=200, times=0)  # every write is slow (~50 s): killed mid-save
    with fastckpt.knobs.override(buffer_size=64 << 10, buffer_count=4, queue_depth=2):
        fastckpt.save({"w": torch.ones(16 << 20, dtype=torch.uint8)}, sys.argv[1])
""")


def _start_slow_saves(target, n):
    """n processes in the middle of fastckpt.save(..., target), all at once."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [fastspawn.Popen([sys.executable, "-c", _SLOW_SAVE, str(target)], env=env) for _ in range(n)]
    for p in procs:
        _wait_for(lambda: _temps_of(target, p.pid) or p.poll() is not None, "the child's temporary file")
    assert all(p.poll() is None for p in procs), "a slow save ended before it could be killed"
    return procs


def _temps_of(target, pid=None):
    """Temporary files of target's saves (of process pid only, if given)."""
    out = []
    for n in os.listdir(target.parent):
        info = _C.parse_temp_name(n, target.name)
        if info and (pid is None or info["pid"] == pid):
            out.append(n)
    return sorted(out)


def test_temporary_name_format(tmp_path):
    w = _C.Writer(_C.Engine(make_config(buffer_size=64 << 10, buffer_count=2)), str(tmp_path / "step.pt"))
    name = os.path.basename(w.tmp_path)
    w.abort()
    assert name.startswith(f".fastckpt-tmp.{_C.temp_key('step.pt')}.{os.getpid()}.")
    assert "step" not in name  # the target's name is not spelled out: no scan for checkpoint names matches
    info = _C.parse_temp_name(name, "step.pt")
    assert info["pid"] == os.getpid() and info["host"] == _C.temp_host() and info["start"] > 0
    assert _C.parse_temp(name) == dict(info, key=_C.temp_key("step.pt"), target="step.pt")


def test_leftovers_of_sigkilled_saves_are_removed_by_the_next_save(tmp_path):
    target = tmp_path / "ckpt.pt"
    fastckpt.save({"w": torch.zeros(3)}, target)
    *killed, live = _start_slow_saves(target, 4)  # all alive at once: none removes another's file
    for p in killed:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        assert p.returncode == -signal.SIGKILL
    left = _temps_of(target)
    assert len(left) == 4
    # A file of another host (shared filesystem) with a pid that is dead here: never removed.
    other_host = f".ckpt.pt.fastckpt-tmp.{killed[0].pid}.some-other-node.12345.0.1"
    (tmp_path / other_host).write_bytes(b"in flight elsewhere")
    fastckpt.save({"w": torch.ones(3)}, target)
    assert torch.equal(fastckpt.load(target)["w"], torch.ones(3))
    remaining = _temps_of(target)
    assert other_host in remaining
    assert [n for n in remaining if n != other_host] == _temps_of(target, live.pid) != []
    os.kill(live.pid, signal.SIGKILL)
    live.wait()
    w = _C.Writer(fastckpt.get_engine(), str(target))
    w.write(b"x")
    st = w.commit()
    assert len(st["leftovers_removed"]) == 1
    assert _C.parse_temp_name(st["leftovers_removed"][0], "ckpt.pt")["pid"] == live.pid
    assert _temps_of(target) == [other_host]
    assert _C.remove_leftovers(str(target)) == []


_FORK_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys, torch, fastckpt
    from fastckpt import _C
    backend, how, d = sys.argv[1], sys.argv[2], sys.argv[3]
    # torch's own OpenMP pool does not survive fork() (a child's parallel op hangs in
    # libgomp): not fastckpt's to fix, so this script keeps torch single-threaded.
    torch.set_num_threads(1)
    sd = {"w": torch.arange(300000, dtype=torch.float32), "b": torch.ones(7)}

    def child_work():
        try:
            _C.Writer(parent_engine, os.path.join(d, "refused.pt"))
            return 10  # the parent's engine must refuse in the child
        except ValueError as e:
            if "fork" not in str(e):
                return 11
        fastckpt.save(sd, os.path.join(d, "child.pt"))
        got = fastckpt.load(os.path.join(d, "child.pt"))
        if not all(torch.equal(got[k], sd[k]) for k in sd):
            return 12
        if fastckpt.get_engine() is parent_engine or fastckpt.get_engine().backend != parent_engine.backend:
            return 13
        return 0

    def mp_target():
        os._exit(child_work())

    with fastckpt.knobs.override(backend=backend, buffer_size=64 << 10, buffer_count=4, queue_depth=4):
        fastckpt.save(sd, os.path.join(d, "parent.pt"))  # the engine exists: threads running / ring open
        parent_engine = fastckpt.get_engine()
        if how == "os.fork":
            pid = os.fork()
            if pid == 0:
                os._exit(child_work())
            _, status = os.waitpid(pid, 0)
            rc = os.waitstatus_to_exitcode(status)
        else:
            p = multiprocessing.get_context("fork").Process(target=mp_target)
            p.start()
            p.join()
            rc = p.exitcode
        assert rc == 0, f"child failed with {rc}"
        fastckpt.save(sd, os.path.join(d, "parent2.pt"))  # the parent still works
        got = fastckpt.load(os.path.join(d, "parent2.pt"))
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        assert fastckpt.get_engine() is parent_engine
    print("ok")
""")


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_save_and_load_in_a_forked_child(backend, tmp_path, how):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        r = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, backend, how, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a save after fork ({how}, {backend}) hung")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    assert torch.equal(fastckpt.load(tmp_path / "child.pt")["b"], torch.ones(7))


def test_writer_errors_name_the_users_file(small_engine, tmp_path):
    target = tmp_path / "step.pt"
    _C.fault_inject("write", nth=2, errno=errno.ENOSPC)
    with pytest.raises(OSError) as ei:
        save(small_engine, target, random_bytes(1 << 20))
    e = ei.value
    assert e.errno == errno.ENOSPC and e.filename == str(target)
    assert f"(saving {target}) off=" in str(e)
    assert str(e).startswith(f"[Errno {errno.ENOSPC}] pwrite {tmp_path}/.fastckpt-tmp.{_C.temp_key('step.pt')}.")
    _C.fault_inject("open", nth=1, errno=errno.EACCES)
    with pytest.raises(PermissionError) as ei:
        _C.Writer(small_engine, str(target))
    assert ei.value.filename == str(target) and f"(saving {target})" in str(ei.value)
    with pytest.raises(FileNotFoundError) as ei:
        _C.Writer(small_engine, str(tmp_path / "no-dir" / "x.pt"))
    assert ei.value.filename == str(tmp_path / "no-dir" / "x.pt")


def test_write_many_refuses_a_negative_offset(small_engine, tmp_path):
    w = _C.Writer(small_engine, str(tmp_path / "f.bin"))
    with pytest.raises(ValueError, match="negative offset -5 in item 1"):
        w.write_many([b"abc", (b"def", -5)])
    w.write_many([b"abc", (b"def", 5)])
    w.commit()
    assert (tmp_path / "f.bin").read_bytes() == b"abc\0\0def"


@pytest.mark.parametrize("name,value,text", [
    ("FASTCKPT_BUFFER_SIZE", "17179869184G", "too large"),     # 2^64 after the suffix: wrapped to 0 before
    ("FASTCKPT_BUFFER_SIZE", "-4096", "not a size"),
    ("FASTCKPT_QUEUE_DEPTH", "4294967297", "too large"),       # wrapped to 1 and accepted before
    ("FASTCKPT_IO_THREADS", "4294967300", "too large"),        # wrapped to 4 and accepted before
    ("FASTCKPT_FLUSH_INTERVAL", "20000000000G", "too large"),
])
def test_size_knobs_that_overflow_are_refused(monkeypatch, name, value, text):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as ei:
        _C.EngineConfig.from_env()
    assert name in str(ei.value) and text in str(ei.value)


def test_staging_pool_larger_than_memory_is_refused(monkeypatch):
    monkeypatch.setenv("FASTCKPT_BUFFER_SIZE", "1G")
    monkeypatch.setenv("FASTCKPT_BUFFER_COUNT", "4096")
    with pytest.raises(ValueError, match="FASTCKPT_BUFFER_SIZE x FASTCKPT_BUFFER_COUNT"):
        _C.EngineConfig.from_env()


def test_failed_io_uring_submit_never_reuses_the_ring(tmp_path):
    if uring_refusal():
        pytest.skip(uring_refusal())
    eng = _C.Engine(make_config(backend="uring", buffer_size=64 << 10, buffer_count=6, queue_depth=4))
    save(eng, tmp_path / "warm.bin", random_bytes(1000))
    _C.fault_inject("uring_submit", nth=3, errno=errno.EIO)
    with pytest.raises(OSError) as ei:
        save(eng, tmp_path / "a.bin", random_bytes(1 << 20, 1))
    assert ei.value.errno == errno.EIO and "io_uring_submit" in str(ei.value)
    assert ei.value.filename == str(tmp_path / "a.bin")
    _C.fault_clear()
    assert eng.buffers_available == 6 and temp_files(tmp_path) == []
    for i in range(3):  # a reused ring would send the failed save's stale SQE into these
        data = random_bytes((1 << 20) + 4099 * i, 10 + i)
        save(eng, tmp_path / f"b{i}.bin", data)
        assert (tmp_path / f"b{i}.bin").read_bytes() == data.numpy().tobytes()


def test_buffers_of_unreaped_io_uring_requests_are_quarantined(tmp_path):
    if uring_refusal():
        pytest.skip(uring_refusal())
    eng = _C.Engine(make_config(backend="uring", buffer_size=64 << 10, buffer_count=8, queue_depth=4))
    save(eng, tmp_path / "warm.bin", random_bytes(1000))
    _C.fault_inject("uring_wait", nth=1, errno=errno.EBADR, times=0)
    with pytest.raises(OSError, match="io_uring_wait_cqe"):
        save(eng, tmp_path / "a.bin", random_bytes(1 << 20, 1))
    _C.fault_clear()
    lost = eng.buffers_quarantined
    assert 1 <= lost <= 4 and eng.buffers_available == 8 - lost
    data = random_bytes(1 << 20, 2)
    save(eng, tmp_path / "a.bin", data)  # a new ring, the remaining buffers
    assert (tmp_path / "a.bin").read_bytes() == data.numpy().tobytes()


_FORK_ASYNC_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time, torch, fastckpt
    from fastckpt import _C
    backend, how, inflight, d = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
    torch.set_num_threads(1)  # torch's OpenMP pool does not survive fork() (see _FORK_SCRIPT)
    sd = {"w": torch.arange(300000, dtype=torch.float32), "b": torch.ones(7)}
    big = {"w": torch.ones(1 << 20, dtype=torch.uint8)}

    def child_work():
        if inflight:
            # The parent's save in flight at fork() is not the child's: its future fails at
            # once, and neither the manager's wait() nor the saver's waits for it.
            try:
                parent_fut.result(timeout=60)
                return 20
            except RuntimeError as e:
                if "forked" not in str(e):
                    return 21
            mgr.wait()
            if not fastckpt.wait_for_saves(timeout=60):
                return 22
        fut = fastckpt.async_save(sd, os.path.join(d, "child_async.pt"))
        try:
            fut.result(timeout=60)
        except TimeoutError:
            return 23
        got = fastckpt.load(os.path.join(d, "child_async.pt"))
        if not all(torch.equal(got[k], sd[k]) for k in sd):
            return 24
        return 0  # a normal exit: atexit handlers (which wait for saves) must not hang either

    def mp_target():
        sys.exit(child_work())

    def wait_child(pid):
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "hung"

    with fastckpt.knobs.override(backend=backend, buffer_size=64 << 10, buffer_count=4, queue_depth=4):
        fastckpt.async_save(sd, os.path.join(d, "parent.pt")).result()  # saver thread and engine exist
        if inflight:
            os.mkdir(os.path.join(d, "zz_slow_dir"))
            mgr = fastckpt.CheckpointManager(os.path.join(d, "zz_slow_dir"))
            # every write of that save is slow (~3 s): it is still in flight at fork()
            _C.fault_inject("write", nth=1, delay_ms=200, times=0, path_contains="zz_slow_dir")
            parent_fut = mgr.async_save(1, big)
            assert not parent_fut.done()
        if how == "os.fork":
            pid = os.fork()
            if pid == 0:
                code = 99
                try:
                    code = child_work()
                finally:
                    sys.exit(code)
            rc = wait_child(pid)
        else:
            p = multiprocessing.get_context("fork").Process(target=mp_target)
            p.start()
            p.join(90)
            rc = p.exitcode
            if rc is None:
                p.kill()
                p.join()
                rc = "hung"
        assert rc == 0, f"child failed with {rc}"
        if inflight:
            parent_fut.result()  # the parent's save was not disturbed
            _C.fault_clear()
            assert torch.equal(mgr.load_latest().state["w"], big["w"])
        fut = fastckpt.async_save(sd, os.path.join(d, "parent2.pt"))  # the parent still works
        fut.result()
        got = fastckpt.load(os.path.join(d, "parent2.pt"))
        assert all(torch.equal(got[k], sd[k]) for k in sd)
    print("ok")
""")


_ASAN_FORK_SKIP = pytest.mark.skipif(
    bool(os.environ.get("FASTCKPT_SANITIZED_DIR")),
    reason="under make fuzz-sanitized (ASan/UBSan preloaded) the forked child of this multi-threaded "
           "process hung in all 9 cases (2026-11-30; not diagnosed: ASan's runtime and fork()); "
           "these tests run in make test without the sanitizers")


@_ASAN_FORK_SKIP
@pytest.mark.parametrize("inflight", [False, True], ids=["idle", "inflight"])
@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_async_save_in_a_forked_child(backend, tmp_path, how, inflight):
    """fastckpt.async_save in a child made by fork() (item 10's class): the
    parent's saver thread does not exist there; with a save of the parent
    (through the checkpoint manager) in flight at fork() too."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        r = subprocess.run([sys.executable, "-c", _FORK_ASYNC_SCRIPT, backend, how, str(int(inflight)),
                            str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"async_save after fork ({how}, {backend}, inflight={inflight}) hung")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    assert torch.equal(fastckpt.load(tmp_path / "child_async.pt")["b"], torch.ones(7))


_FORK_LOCKS_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time, torch, fastckpt
    import fastckpt.manager  # imported on first use otherwise
    from fastckpt.dcp import FastWriter
    A, M, S = (sys.modules[f"fastckpt.{m}"] for m in ("saver", "manager.ranks", "serialization"))
    d = sys.argv[1]
    torch.set_num_threads(1)  # torch's OpenMP pool does not survive fork() (see _FORK_SCRIPT)
    sd = {"w": torch.arange(1000, dtype=torch.float32)}
    fastckpt.async_save(sd, os.path.join(d, "parent.pt")).result()
    writer = FastWriter(os.path.join(d, "dcp"))
    mgr = fastckpt.CheckpointManager(os.path.join(d, "mgr"))
    locks = [A._default_lock, A.default_saver()._cv, A.default_saver().stager._lock, M._exit_lock, mgr._lock,
             sys.modules["fastckpt.staging.device"]._pools_lock, writer._stager._lock]
    held, release = threading.Event(), threading.Event()

    def hold():  # another thread of the parent holds every lock at fork()
        for lk in locks:
            lk.acquire()
        held.set()
        release.wait()
        for lk in reversed(locks):
            lk.release()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            staged = writer.stage(sd)
            assert torch.equal(staged["w"], sd["w"])
            fastckpt.async_save(sd, os.path.join(d, "child.pt")).result(timeout=60)
            mgr.save(1, sd)
            assert torch.equal(mgr.load_latest().state["w"], sd["w"])
            fastckpt.CheckpointManager(os.path.join(d, "mgr2")).save(2, sd)  # a new manager: _exit_lock
            code = 0
        finally:
            os._exit(code)
    release.set()
    t.join()
    deadline = time.monotonic() + 90
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise SystemExit("the child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert torch.equal(fastckpt.load(os.path.join(d, "child.pt"))["w"], sd["w"])
    print("ok")
""")


@_ASAN_FORK_SKIP
def test_fork_while_another_thread_holds_fastckpt_locks(tmp_path):
    """A lock another thread of the parent holds at fork() stays held in the
    child: every module-level and per-object lock the child may need
    (async saver, manager, pinned-buffer pool, DCP staging) is made anew there."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        r = subprocess.run([sys.executable, "-c", _FORK_LOCKS_SCRIPT, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the forked child hung")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
