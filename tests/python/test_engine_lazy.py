"""Fixed costs grow lazily (issue 12): a fresh process's engine touches and
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
from conftest import make_config, uring_refusal

MiB = 1 << 20

_FRESH_LOAD = textwrap.dedent("""
    import json, sys
    import fastckpt
    path = sys.argv[1]
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
    r = subprocess.run([sys.executable, "-c", _FRESH_LOAD, str(path), ",".join(sd)], env=env,
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
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines == ["", "ok"], lines
