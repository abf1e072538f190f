"""The staging pipeline on a simulated device (tests/support/sim_device.py).

No GPU runs here: tensors "on" sim:0 / sim:1 are CPU tensors the simulator
owns; their copies land late and out of order (or, with
``spontaneous=False``, only when an event covering them is waited for), and
the simulator raises StagingViolation when a host buffer is written to disk,
reused or freed before its copy's event fired. Checked here:

* save / async_save / FastWriter (sync path and stage()) of state on sim:0
  and sim:1 write files identical to the CPU save's;
* the FastWriter wrong-stream discipline (event recorded on the current
  device's stream while the copy runs on the tensor's device's stream) is
  caught, both injected into today's pipeline and as the old ``_host_tensors``
  code expressed on the simulator;
* buffer reuse or release before completion is caught;
* host staging memory stays bounded by the pool for saves and for loads onto
  the device, whatever the checkpoint's size, and is reused across saves;
* fastckpt.load(map_location=<device>) is correct (string, dict, callable,
  verify) while the host holds only the pool.
"""

import gc
import os
import threading
import uuid

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.staging import device as _staging
from fastckpt.staging.tohost import ToHost
from fastckpt import serialization
from fastckpt.saver import AsyncSaver
from sim_device import POISON, SimDevice, SimEvent, StagingViolation
import states

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

CHUNK_KNOB = 16 << 10            # engine buffer_size in these tests: the pool's chunk is 4x this
CHUNK = 4 * CHUNK_KNOB
POOL = CHUNK * _staging.POOL_BUFFERS


@pytest.fixture(autouse=True)
def small_pool(monkeypatch):
    """Small pool buffers (so tensors span several and small ones share one)
    and a fixed serialization id (so that files can be compared bytewise)."""
    monkeypatch.setattr(fastckpt.formats.archive.uuid, "uuid4", lambda: uuid.UUID(int=12))
    with fastckpt.knobs.override(buffer_size=CHUNK_KNOB):
        yield


def make_state(seed=0, big=1 << 18):
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(big, generator=g),                       # spans many pool buffers
        "w": torch.randn(300, 7, generator=g).t(),                  # non-contiguous
        "b": torch.randn(33, generator=g, dtype=torch.float64),     # small ones packed together
        "i": torch.arange(5, dtype=torch.int64),
        "flag": torch.tensor([True, False]),
        "s": torch.tensor(3.5),
        "empty": torch.zeros(0),
        "step": 7,
    }


def assert_same_state(a, b):
    states.assert_same(a, b, dtypes=False)


def on_sim(sim, sd):
    """`sd` with tensors alternately on sim:0 and sim:1."""
    out = {}
    for i, (k, v) in enumerate(sd.items()):
        out[k] = sim.tensor(v, i % 2) if isinstance(v, torch.Tensor) else v
    return out



# ---------------------------------------------------------------- save

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_save_from_sim_devices_writes_the_cpu_file(tmp_path, seed):
    sd = make_state(seed)
    fastckpt.save(sd, tmp_path / "cpu.pt")
    with SimDevice(seed=seed, max_delay=0.002) as sim:
        fastckpt.save(on_sim(sim, sd), tmp_path / "sim.pt")
        assert sim.violations == [] and sim.copies > 0
    assert (tmp_path / "sim.pt").read_bytes() == (tmp_path / "cpu.pt").read_bytes()
    assert_same_state(fastckpt.load(tmp_path / "sim.pt", verify=True), sd)


def test_save_copies_only_when_waited_for_still_correct(tmp_path):
    """Copies that land only when their event is synchronized: the pipeline
    waits for exactly what it writes (no copy lands by luck)."""
    sd = make_state(3)
    fastckpt.save(sd, tmp_path / "cpu.pt")
    with SimDevice(seed=3, spontaneous=False) as sim:
        fastckpt.save(on_sim(sim, sd), tmp_path / "sim.pt")
    assert (tmp_path / "sim.pt").read_bytes() == (tmp_path / "cpu.pt").read_bytes()


def test_save_host_memory_is_the_pool_and_is_reused(tmp_path):
    sd = make_state(4, big=1 << 20)  # 4 MiB of floats, 16x the pool
    with SimDevice(seed=4) as sim:
        dev = on_sim(sim, sd)
        fastckpt.save(dev, tmp_path / "a.pt")
        pool = _staging.pool_for(sim, CHUNK)
        assert sim.peak_locked_bytes <= POOL < sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))
        assert pool.held_bytes <= POOL and pool.peak_lent <= pool.count
        locked, made = sim.locked_bytes, pool._made
        fastckpt.save(dev, tmp_path / "b.pt")  # the same buffers again: nothing new is locked
        assert sim.locked_bytes == locked and pool._made == made
        _staging.clear_pools()
        assert sim.locked_bytes == 0 and pool.held_bytes == 0
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def test_a_failed_pin_gives_its_pool_slot_back(tmp_path, monkeypatch):
    """Pinning refused (out of locked memory) fails the save that asked, with its error; the pool keeps
    its capacity, so the next save gets every buffer again instead of waiting forever for one."""
    sd = make_state(5, big=1 << 20)
    with SimDevice(seed=5) as sim:
        dev = on_sim(sim, sd)
        real = sim._lock_pages
        fails = {"n": _staging.POOL_BUFFERS + 1}

        def refuse(t):
            if fails["n"]:
                fails["n"] -= 1
                raise RuntimeError("cannot lock pages: out of locked memory")
            return real(t)

        monkeypatch.setattr(sim, "_lock_pages", refuse)
        for _ in range(_staging.POOL_BUFFERS + 1):  # more failures than the pool has buffers
            with pytest.raises(RuntimeError, match="out of locked memory"):
                fastckpt.save(dev, tmp_path / "a.pt")
            assert not (tmp_path / "a.pt").exists()
        pool = _staging.pool_for(sim, CHUNK)
        assert pool._made == 0 and pool.held_bytes == 0 and pool._lent == 0
        # this save waited forever before: every slot had been lost to a failed pin
        t = threading.Thread(target=fastckpt.save, args=(dev, tmp_path / "a.pt"), daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the save after failed pins waits for a pool buffer that never comes"
        assert pool.peak_lent <= pool.count
        _staging.clear_pools()
    fastckpt.save(sd, tmp_path / "cpu.pt")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "cpu.pt").read_bytes()


def test_small_tensors_share_one_buffer(tmp_path):
    """Many small device tensors: one pool buffer holds many of them (copies
    issued ahead, not one buffer and one wait per tensor)."""
    g = torch.Generator().manual_seed(5)
    sd = {f"p{i}": torch.randn(10, generator=g) for i in range(200)}
    fastckpt.save(sd, tmp_path / "cpu.pt")
    with SimDevice(seed=5) as sim:
        dev = {k: sim.tensor(v, 1) for k, v in sd.items()}
        fastckpt.save(dev, tmp_path / "sim.pt")
        assert _staging.pool_for(sim, CHUNK).peak_lent == 1  # 200 x 40 bytes fit one buffer
    assert (tmp_path / "sim.pt").read_bytes() == (tmp_path / "cpu.pt").read_bytes()


# ---------------------------------------------------------------- violations are caught

class LyingEvents(SimDevice):
    """A broken copier: its events fire at once, whatever the copy."""

    def to_host_async(self, dst, src):
        super().to_host_async(dst, src)
        return SimEvent(self, [])


def test_writing_a_buffer_before_its_copy_landed_is_caught(tmp_path):
    with LyingEvents(spontaneous=False) as sim:
        dev = on_sim(sim, make_state(6))
        with pytest.raises(StagingViolation):
            fastckpt.save(dev, tmp_path / "x.pt")
        assert "handed to the writer" in sim.violations[0]
    assert not (tmp_path / "x.pt").exists()


def test_reuse_or_release_before_completion_is_caught():
    with SimDevice(spontaneous=False) as sim:
        src = sim.tensor(torch.arange(4096, dtype=torch.uint8), 1)
        hb = sim.alloc_host(4096)
        ev = sim.to_host_async(hb.tensor, src)
        assert torch.all(hb.tensor == POISON)  # nothing landed yet
        with pytest.raises(StagingViolation, match="earlier copy"):
            sim.to_host_async(hb.tensor[100:200], src[:100])   # reused as a destination
        with pytest.raises(StagingViolation, match="reused or released"):
            _staging.pool_for(sim, 4096).release(hb)           # given back to the pool
        with pytest.raises(StagingViolation, match="reused or released"):
            hb.free()                                          # freed
        with pytest.raises(StagingViolation, match="handed to the writer"):
            sim.check_ready(hb.tensor[:10])                    # written to disk
        ev.synchronize()
        sim._demand(list(sim._ops))
        assert ev.query() and torch.equal(hb.tensor[:100], src[:100])
        hb.free()  # now fine
        dst = sim.empty_device(4096, "sim:0")
        up = sim.to_device_async(torch.empty(0, dtype=torch.uint8).set_(dst), hb.tensor)
        with pytest.raises(StagingViolation, match="reused or released"):
            sim.check_idle(hb.tensor)  # the source of a pending host-to-device copy
        up.synchronize()
        sim.check_idle(hb.tensor)


def test_events_are_per_device_and_stream():
    with SimDevice(spontaneous=False) as sim:
        a = sim.tensor(torch.ones(1000), 1)
        host = torch.zeros(1000)
        sim.copy_(host, a)                       # on sim:1's current stream
        assert sim.record_event(0).query()       # sim:0's stream has nothing to wait for
        ev1 = sim.record_event(1)
        assert not ev1.query()
        ev1.synchronize()
        assert torch.equal(host, torch.ones(1000))


# ---------------------------------------------------------------- FastWriter

def _dcp_save(sd, path, writer_cls=None, **kw):
    import torch.distributed.checkpoint as dcp
    from dcp_calls import dcp_unwrapped
    from fastckpt.dcp import FastWriter
    w = (writer_cls or FastWriter)(path, **kw)
    dcp_unwrapped(dcp.save, sd, storage_writer=w, no_dist=True)
    return w


def _data_files(path):
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path)) if n.endswith(".distcp")}


needs_dist = pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")


def _dcp_state(seed):
    sd = make_state(seed)
    del sd["empty"]
    return sd


@needs_dist
@pytest.mark.parametrize("spontaneous,threads", [(True, 1), (False, 1), (True, 3)])
def test_fastwriter_from_sim_devices_writes_the_cpu_files(tmp_path, spontaneous, threads):
    """threads=3: three files written at once, their pipelines sharing one pool."""
    sd = _dcp_state(8)
    _dcp_save(sd, tmp_path / "cpu", thread_count=threads)
    with SimDevice(seed=8, spontaneous=spontaneous) as sim:
        _dcp_save(on_sim(sim, sd), tmp_path / "sim", thread_count=threads)
        assert sim.violations == [] and sim.peak_locked_bytes <= POOL
    assert _data_files(tmp_path / "sim") == _data_files(tmp_path / "cpu") != {}
    assert len(_data_files(tmp_path / "sim")) == threads


class WrongStream(SimDevice):
    """FastWriter's old discipline injected into the copier: the copy runs on
    the tensor's device, the event is recorded on the *current* device's
    stream (torch.cuda.Event().record() with sim:0 current)."""

    def to_host_async(self, dst, src):
        super().to_host_async(dst, src)
        return self.record_event()


@needs_dist
def test_fastwriter_wrong_stream_discipline_is_caught(tmp_path):
    sd = _dcp_state(9)
    with WrongStream(seed=9, spontaneous=False) as sim:
        dev = {k: sim.tensor(v, 1) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
        with pytest.raises(StagingViolation):
            _dcp_save(dev, tmp_path / "sim")
        assert "handed to the writer" in sim.violations[0]


def old_host_tensors_on_sim(sim):
    """FastWriter's ``_host_tensors`` before the staging component, written
    against the simulator's torch.cuda-like API: the copy on the tensor's
    device's current stream, ``torch.cuda.Event().record()`` on the current
    device's; the buffer is handed to the writer (``check_ready``) after that
    event's synchronize()."""
    from fastckpt.dcp.writer import _host_tensor

    def _host_tensors(entries, planner, on_resolve=None):
        def ready(item):
            e, host, ev = item
            if ev is not None:
                ev.synchronize()
                sim.check_ready(host)
            return e, host, (None if host is None else [host.reshape(-1).view(torch.uint8)])

        pending = None
        for e in entries:
            if e.payload is not None:
                cur = (e, None, None)
            else:
                t = planner.resolve_data(e.item).detach()
                if sim.owns(t):
                    host = torch.empty(t.shape, dtype=t.dtype)
                    sim.copy_(host, t)
                    cur = (e, host, sim.record_event())
                else:
                    cur = (e, _host_tensor(t), None)
            if pending is not None:
                yield ready(pending)
            pending = cur
        if pending is not None:
            yield ready(pending)
    return _host_tensors


@needs_dist
@pytest.mark.parametrize("device", [0, 1])
def test_old_fastwriter_discipline_fails_on_sim1(tmp_path, monkeypatch, device):
    """Today's logic expressed on the simulator: correct on device 0 (the
    current device), caught on device 1."""
    from fastckpt.dcp import writer
    sd = _dcp_state(10)
    _dcp_save(sd, tmp_path / "cpu")
    with SimDevice(seed=10, spontaneous=False) as sim:
        monkeypatch.setattr(writer, "_host_tensors", old_host_tensors_on_sim(sim))
        dev = {k: sim.tensor(v, device) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
        if device == 0:
            _dcp_save(dev, tmp_path / "sim")
            assert _data_files(tmp_path / "sim") == _data_files(tmp_path / "cpu")
        else:
            with pytest.raises(StagingViolation):
                _dcp_save(dev, tmp_path / "sim")
            assert "handed to the writer" in sim.violations[0]


@needs_dist
def test_fastwriter_stage_from_sim_devices(tmp_path):
    from fastckpt.dcp import FastWriter
    sd = _dcp_state(11)
    with SimDevice(seed=11, spontaneous=False) as sim:
        dev = on_sim(sim, sd)
        w = FastWriter(tmp_path / "x")
        staged = w.stage(dev)
        assert sim.violations == []
        assert_same_state({k: v for k, v in staged.items()}, sd)
        n, locked = w.staging_allocations, sim.locked_bytes
        need = sum((v.nbytes + 63) // 64 * 64 for v in sd.values() if isinstance(v, torch.Tensor))
        assert n == 1 and locked == (need + (1 << 20) - 1) // (1 << 20) * (1 << 20)  # one arena, as async_save's
        del staged
        gc.collect()
        staged = w.stage(dev)  # the same buffers, nothing allocated or locked
        assert w.staging_allocations == n and sim.locked_bytes == locked
        assert_same_state(dict(staged), sd)


# ---------------------------------------------------------------- async_save

@pytest.mark.parametrize("spontaneous", [True, False])
def test_async_save_from_sim_devices_writes_the_cpu_file(tmp_path, spontaneous):
    sd = make_state(12)
    fastckpt.save(sd, tmp_path / "cpu.pt")
    with SimDevice(seed=12, spontaneous=spontaneous) as sim:
        saver = AsyncSaver()
        dev = on_sim(sim, sd)
        saver.save(dev, tmp_path / "sim.pt").result(timeout=120)
        st = saver.stager
        arena = st._free[0]
        need = sum((v.nbytes + 63) // 64 * 64 for v in sd.values() if isinstance(v, torch.Tensor))
        assert arena.pinned and arena.capacity == (need + (1 << 20) - 1) // (1 << 20) * (1 << 20)
        assert sim.locked_bytes == arena.capacity  # the snapshot only, page-locked once
        saver.save(dev, tmp_path / "sim2.pt").result(timeout=120)
        assert st.allocations == 1 and sim.locked_bytes == arena.capacity
        del arena
        st.clear()  # released on request
        gc.collect()
        assert sim.locked_bytes == 0
    assert (tmp_path / "sim.pt").read_bytes() == (tmp_path / "cpu.pt").read_bytes()
    assert (tmp_path / "sim2.pt").read_bytes() == (tmp_path / "cpu.pt").read_bytes()


# ---------------------------------------------------------------- load onto the device

def _host_bytes_read(monkeypatch):
    """Bytes of records _Records read into host memory, per load."""
    seen = []
    orig = fastckpt.torchsave.device.DeviceRecords.finish

    def finish(self, verify):
        seen.append(self.host.allocated)
        return orig(self, verify)
    monkeypatch.setattr(fastckpt.torchsave.device.DeviceRecords, "finish", finish)
    return seen


@pytest.mark.parametrize("how", ["str", "dict", "callable", "weights_only_false"])
def test_load_onto_sim_device_through_the_pool(tmp_path, monkeypatch, how):
    sd = make_state(13, big=1 << 20)
    path = tmp_path / "c.pt"
    fastckpt.save(sd, path)
    seen = _host_bytes_read(monkeypatch)
    with SimDevice(seed=13) as sim:
        ml = {"str": "sim:1", "dict": {"cpu": "sim:1"}, "weights_only_false": "sim:1",
              "callable": lambda s, loc: sim.to_device(s, 1)}[how]
        got = fastckpt.load(path, map_location=ml, verify=True, weights_only=how != "weights_only_false")
        assert sim.violations == []
        for k, v in got.items():
            if isinstance(v, torch.Tensor) and v.numel():
                assert sim.device_key(v) == "sim:1", k
        assert_same_state(got, sd)
        total = os.path.getsize(path)
        assert sim.peak_locked_bytes <= POOL < total // 8  # the host held the pool, not the checkpoint
        assert seen and seen[0] < 64 << 10                 # only the small records went to host memory


def test_load_verify_names_the_damaged_tensor_on_the_device_path(tmp_path):
    sd = {"a": torch.zeros(1 << 16), "b": torch.ones(1 << 16)}
    path = tmp_path / "c.pt"
    fastckpt.save(sd, path)
    from fastckpt.formats import zip as _zip
    with open(path, "rb") as fh:
        rec = _zip.Archive.parse(fh, str(path)).records["data/1"]
    with open(path, "r+b") as fh:
        fh.seek(rec.data_offset + 1000)
        fh.write(b"\x42")
    with SimDevice(seed=14) as sim:
        with pytest.raises(fastckpt.FormatError, match=r"checksum mismatch.*tensor b"):
            fastckpt.load(path, map_location="sim:0", verify=True)
        # verify is on by default, on the device path too
        with pytest.raises(fastckpt.FormatError, match=r"checksum mismatch.*tensor b"):
            fastckpt.load(path, map_location="sim:0")
        got = fastckpt.load(path, map_location="sim:0", verify=False)  # opted out: loads
        assert torch.equal(got["a"], sd["a"])


def test_callable_that_keeps_some_storages_on_the_host_verifies_them(tmp_path):
    # a callable map_location sends one storage to the device and keeps the other
    # on the host: the host-kept one is read in the deferred batch and checked too
    sd = {"a": torch.zeros(1 << 16), "b": torch.ones(1 << 16)}
    path = tmp_path / "c.pt"
    fastckpt.save(sd, path)
    from fastckpt.formats import zip as _zip
    with open(path, "rb") as fh:
        rec = _zip.Archive.parse(fh, str(path)).records["data/1"]
    with SimDevice(seed=17) as sim:
        def first_to_device(calls=[]):  # the first storage (tensor a) to sim:0, the others stay
            def ml(s, loc):
                calls.append(loc)
                return sim.to_device(s, 0) if len(calls) == 1 else s
            return ml

        got = fastckpt.load(path, map_location=first_to_device([]))
        assert sim.device_key(got["a"]) == "sim:0" and torch.equal(got["b"], sd["b"])
        with open(path, "r+b") as fh:
            fh.seek(rec.data_offset + 1000)
            fh.write(b"\x42")
        with pytest.raises(fastckpt.FormatError, match=r"checksum mismatch.*tensor b"):
            fastckpt.load(path, map_location=first_to_device([]))
        assert sim.violations == []


def test_device_load_of_a_file_without_checksums_warns_by_default(tmp_path):
    from torch.utils.serialization import config as torch_config
    sd = {"a": torch.arange(1 << 14, dtype=torch.float32)}
    path = tmp_path / "c.pt"
    old = torch_config.save.compute_crc32
    torch_config.save.compute_crc32 = False
    try:
        fastckpt.save(sd, path)
    finally:
        torch_config.save.compute_crc32 = old
    with SimDevice(seed=16) as sim:
        with pytest.warns(UserWarning, match="records no checksums"):
            got = fastckpt.load(path, map_location="sim:0")
        assert torch.equal(got["a"], sd["a"])
        with pytest.raises(fastckpt.FormatError, match="records no checksums"):
            fastckpt.load(path, map_location="sim:0", verify=True)


def test_load_to_sim_with_lying_events_is_caught(tmp_path):
    class LyingUploads(SimDevice):
        def to_device_async(self, dst, src):
            super().to_device_async(dst, src)
            return SimEvent(self, [])

    path = tmp_path / "c.pt"
    fastckpt.save(make_state(15, big=1 << 18), path)
    with LyingUploads(seed=15, spontaneous=False) as sim:
        with pytest.raises(StagingViolation):
            fastckpt.load(path, map_location="sim:0")
        assert "reused or released" in sim.violations[0]


def _save_with_locations(path, sd, tag_of, monkeypatch):
    """`sd` saved with the location tag `tag_of(i)` for storage i (as a file
    saved from those devices would carry)."""
    tags = {}

    def location_tag(storage):
        return tags.setdefault(storage._cdata, tag_of(len(tags)))
    with monkeypatch.context() as m:
        m.setattr(fastckpt.formats.pickler.ts, "location_tag", location_tag)
        fastckpt.save(sd, path)
    return len(tags)


def test_load_without_map_location_follows_device_tags(tmp_path, monkeypatch):
    """No map_location, a file saved from devices: the storages go back to
    their devices through the pool (mixed with host ones, read in one batch)."""
    sd = make_state(16, big=1 << 20)
    path = tmp_path / "c.pt"
    n = _save_with_locations(path, sd, lambda i: "cpu" if i % 3 == 2 else f"sim:{i % 2}", monkeypatch)
    assert n >= 6
    seen = _host_bytes_read(monkeypatch)
    with SimDevice(seed=16) as sim:
        got = fastckpt.load(path, verify=True)
        assert sim.violations == [] and sim.peak_locked_bytes <= POOL
        where = {k: (sim.device_key(v) if sim.owns(v) else str(v.device)) for k, v in got.items()
                 if isinstance(v, torch.Tensor) and v.numel()}
        assert where["emb"] == "sim:0" and "cpu" in where.values() and "sim:1" in where.values(), where
        assert_same_state(got, sd)
    assert len(seen) == 1
    fastckpt.load(tmp_path / "c.pt", map_location="cpu")  # not a device load
    fastckpt.save(sd, path)
    with SimDevice(seed=16):
        assert_same_state(fastckpt.load(path), sd)      # cpu tags: the host path
    assert len(seen) == 1


def test_host_tensors_are_resolved_at_most_two_ahead():
    """A planner may materialize a tensor when it is resolved (fastckpt
    convert): the pipeline resolves host tensors only just ahead of the
    writes, while device tensors are copied further ahead."""
    resolved = []

    def tensor_of(i):
        resolved.append(i)
        return torch.full((10,), float(i))
    pipe = ToHost(range(100), tensor_of)
    for i, (item, t, pieces) in enumerate(pipe):
        assert item == i and torch.equal(t, torch.full((10,), float(i)))
        assert len(resolved) <= i + 3, (i, len(resolved))
        list(pieces)
    pipe.close()
    with SimDevice(seed=17, spontaneous=False) as sim:
        dev = [sim.tensor(torch.full((10,), float(i)), 1) for i in range(100)]
        pipe = ToHost(dev)
        it = iter(pipe)
        next(it)
        assert sim.copies == 100  # all issued ahead into one packed buffer
        pipe.close()


def test_device_load_reads_the_file_it_parsed(tmp_path, monkeypatch):
    """The storages are read after the unpickler ran: a file replaced
    meanwhile is an error, never a mix of two checkpoints."""
    path = tmp_path / "c.pt"
    fastckpt.save(make_state(18), path)
    orig = fastckpt.torchsave.device.DeviceRecords.finish

    def finish(self, verify):
        os.replace(tmp_path / "other.pt", path)
        return orig(self, verify)
    fastckpt.save(make_state(19), tmp_path / "other.pt")
    monkeypatch.setattr(fastckpt.torchsave.device.DeviceRecords, "finish", finish)
    with SimDevice(seed=18):
        with pytest.raises(fastckpt.FormatError, match="replaced or changed"):
            fastckpt.load(path, map_location="sim:0")


def test_device_load_verifies_a_storage_read_in_many_pieces(tmp_path):
    """A storage larger than a pool buffer is read in pieces whose CRC-32s the
    engine computes during the reads and load combines: a byte flipped in the
    last piece is found (and the intact file loads)."""
    big = torch.arange(3 * (POOL // 4) // 4 + 123, dtype=torch.float32)  # spans several pool buffers
    sd = {"a": torch.ones(1000), "big": big}
    path = tmp_path / "c.pt"
    fastckpt.save(sd, path)
    with SimDevice(seed=15) as sim:
        assert_same_state(fastckpt.load(path, map_location="sim:1"), sd)
        assert sim.violations == []
    from fastckpt.formats import zip as _zip
    with open(path, "rb") as fh:
        rec = _zip.Archive.parse(fh, str(path)).records["data/1"]
    with open(path, "r+b") as fh:
        fh.seek(rec.data_offset + rec.size - 5)
        b = fh.read(1)
        fh.seek(rec.data_offset + rec.size - 5)
        fh.write(bytes([b[0] ^ 0x10]))
    with SimDevice(seed=16):
        with pytest.raises(fastckpt.FormatError, match=r"checksum mismatch.*tensor big"):
            fastckpt.load(path, map_location="sim:1")
