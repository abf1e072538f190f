"""A pickle whose tensor reaches past its storage record (found by
test_fuzz_load's hostile-pickle fuzzer: a SIGSEGV in the loading process).

torch.load's storages are not resizable, so ``_rebuild_tensor``'s ``set_`` with
a size beyond the record is torch's RuntimeError. fastckpt.load's storages were
resizable: ``set_`` reallocated the storage, and the default load, which fills
the storages on a background thread while torch unpickles (read_behind), then
read into freed memory (a crash or heap damage); the other paths returned a
tensor holding bytes no record had (uninitialized memory). Every path must be
a clean error naming the file, and the storages fastckpt.load returns are not
resizable, as torch.load's are not.
"""
import io
import os
import subprocess
import sys
import zipfile

import pytest
import torch

import fastckpt
from fastckpt.formats import zip as _zip

from test_fuzz_load import _with_pickle
import fastspawn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL, BIG = 7, _zip.DIRECT_MIN // 4 + 1000  # a bf16 tensor in torch's memory; a float32 one read O_DIRECT


def _stretched(tmp_path, which: str) -> str:
    """A checkpoint whose tensor `which` claims more elements than its record holds
    (every CRC made to match: damage that only the sizes reveal)."""
    ref = tmp_path / "ref.pt"
    fastckpt.save({"small": torch.ones(SMALL, dtype=torch.bfloat16), "big": torch.arange(BIG, dtype=torch.float32),
                   "step": 3}, ref)
    data = ref.read_bytes()
    pkl = zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")
    if which == "small":  # BININT1 7, TUPLE1 (the size) -> 25
        old, new = b"K\x07\x85", b"K\x19\x85"
    else:  # BININT (4 bytes) BIG, TUPLE1 -> BIG + 5000
        old, new = b"J" + BIG.to_bytes(4, "little") + b"\x85", b"J" + (BIG + 5000).to_bytes(4, "little") + b"\x85"
    if pkl.count(old) != 1:  # BIG may pickle as BININT2 on another protocol
        old, new = b"M" + BIG.to_bytes(2, "little") + b"\x85", b"M" + (BIG + 5000).to_bytes(2, "little") + b"\x85"
    assert pkl.count(old) == 1, pkl
    path = tmp_path / f"stretched-{which}.pt"
    path.write_bytes(_with_pickle(data, pkl.replace(old, new)))
    return str(path)


@pytest.mark.parametrize("which", ["small", "big"])
def test_torch_refuses_the_stretched_tensor(tmp_path, which):
    """The oracle: torch.load's storages cannot be stretched."""
    path = _stretched(tmp_path, which)
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(path, weights_only=True)


@pytest.mark.parametrize("which", ["small", "big"])
@pytest.mark.parametrize("how", ["default", "verify_false", "verify_true", "map_cpu", "callable", "file_object"])
def test_a_stretched_tensor_is_a_format_error(tmp_path, which, how):
    path = _stretched(tmp_path, which)
    kw = {"default": {}, "verify_false": {"verify": False}, "verify_true": {"verify": True},
          "map_cpu": {"map_location": "cpu"}, "callable": {"map_location": lambda s, loc: s},
          "file_object": {}}[how]
    with pytest.raises((fastckpt.FormatError, RuntimeError)) as e:
        if how == "file_object":
            with open(path, "rb") as f:
                fastckpt.load(f)
        else:
            fastckpt.load(path, **kw)
    assert "not resizable" in str(e.value)
    if how != "file_object":  # a file object goes to torch.load, whose RuntimeError it is
        assert isinstance(e.value, fastckpt.FormatError) and path in str(e.value)


def test_weights_only_false_is_torchs_error(tmp_path):
    path = _stretched(tmp_path, "big")
    with pytest.raises(RuntimeError, match="not resizable") as ours:
        fastckpt.load(path, weights_only=False)
    with pytest.raises(RuntimeError, match="not resizable") as theirs:
        torch.load(path, weights_only=False)
    assert type(ours.value) is type(theirs.value) or isinstance(ours.value, fastckpt.FormatError)


@pytest.mark.parametrize("which", ["small", "big"])
def test_a_stretched_tensor_on_the_device_path_is_a_format_error(tmp_path, which):
    from sim_device import SimDevice
    path = _stretched(tmp_path, which)
    with SimDevice(seed=21) as sim:
        with pytest.raises(fastckpt.FormatError, match="not resizable"):
            fastckpt.load(path, map_location="sim:0")
        assert sim.violations == []
        # an intact file's device storages are resizable afterwards, as torch's restored ones are
        good = tmp_path / "good.pt"
        fastckpt.save({"big": torch.arange(BIG, dtype=torch.float32)}, good)
        got = fastckpt.load(good, map_location="sim:0")
        assert got["big"].untyped_storage().resizable()


def test_repeated_loads_in_one_process_do_not_crash(tmp_path):
    """The crash needed the background read still in flight when torch stretched
    the storage: many loads in one fresh process, which must exit cleanly."""
    paths = []
    for w in ("small", "big"):
        (tmp_path / w).mkdir()
        paths.append(_stretched(tmp_path / w, w))
    code = ("import sys, fastckpt\n"
            "for i in range(100):\n"
            "    for p in sys.argv[1:]:\n"
            "        try:\n"
            "            fastckpt.load(p, verify=bool(i % 2))\n"
            "        except fastckpt.FormatError:\n"
            "            pass\n"
            "        else:\n"
            "            raise SystemExit('loaded ' + p)\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    r = fastspawn.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout[-2000:], r.stderr[-4000:])


def test_loaded_storages_are_not_resizable_as_torchs(tmp_path):
    path = tmp_path / "c.pt"
    fastckpt.save({"small": torch.ones(SMALL), "big": torch.arange(BIG, dtype=torch.float32)}, path)
    ours, theirs = fastckpt.load(path), torch.load(path, weights_only=True)
    for k in ("small", "big"):
        assert ours[k].untyped_storage().resizable() == theirs[k].untyped_storage().resizable() is False, k
        with pytest.raises(RuntimeError, match="not resizable"):
            ours[k].resize_(ours[k].numel() * 2)
