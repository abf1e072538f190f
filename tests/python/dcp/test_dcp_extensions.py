"""fastckpt.dcp.FastWriter with DCP stream transforms (``_extensions``).

Round trips FastWriter -> FastReader, FastWriter -> FileSystemReader and
FileSystemWriter -> FastReader, bitwise, with torch's ZStandard and with a
user-defined StreamTransformExtension registered in torch's ExtensionRegistry,
at world size 1 (in this process) and 2 (gloo ranks of this file run as a
script); the ``.metadata`` entries carry the descriptors torch records; the
transformed files go through the engine's commit path; a damaged compressed
record is reported as a FormatError naming the file.

Run as a script (``python test_dcp_extensions.py SCENARIO WORKDIR`` with
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set), this file is one rank of the
world-size-2 test.
"""

import errno
import io
import os
import sys
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist

if __name__ == "__main__":  # a rank of _run_ranks: the helpers, as tests/conftest.py puts them on sys.path
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "support"))
from dist_launch import start_ranks
import states

if __name__ != "__main__" and not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402

try:
    from torch.distributed.checkpoint._extension import (  # noqa: E402
        ExtensionRegistry, StreamTransformExtension, ZStandard,
    )
except ImportError:  # pragma: no cover (torch < 2.7)
    if __name__ != "__main__":
        pytest.skip("this torch has no DCP stream transforms (torch.distributed.checkpoint._extension)",
                    allow_module_level=True)
    raise

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if __name__ == "__main__":
    sys.path.insert(0, REPO)

from fastckpt import FormatError, _C  # noqa: E402
from fastckpt.dcp import FastReader, FastWriter  # noqa: E402

if __name__ != "__main__":
    from dcp_calls import dcp_unwrapped  # noqa: E402
    from leaks import temp_files  # noqa: E402
    from dist_launch import wait_for_ranks  # noqa: E402

    pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ZSTD_MISSING = ("ZStandard needs the zstandard (or pyzstd) package, not installed here "
                "(pip install zstandard; it is in requirements-dev.txt)")


# ---------------------------------------------------------------- a user-defined transform

class XorReverse(StreamTransformExtension):
    """XORs every byte with a key and reverses each record: a transform that is
    neither the identity nor length-changing-only, so a record written without
    it (or read without undoing it) is not a valid archive."""

    KEY = 0xA5

    @staticmethod
    def registry_name() -> str:
        return "fastckpt-test.xorrev"

    @staticmethod
    def from_descriptor(version: str) -> "XorReverse":
        if version != "1":
            raise ValueError(f"unknown {XorReverse.registry_name()} version {version!r}")
        return XorReverse()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    @classmethod
    def _code(cls, data: bytes) -> bytes:
        return (torch.frombuffer(bytearray(data), dtype=torch.uint8) ^ cls.KEY).flip(0).numpy().tobytes() \
            if data else b""

    def transform_to(self, output):
        code = self._code

        class Writer(io.RawIOBase):
            def __init__(self):
                super().__init__()
                self.parts = []

            def writable(self):
                return True

            def write(self, b):
                data = bytes(b)
                self.parts.append(data)
                return len(data)

            def close(self):
                if not self.closed:
                    output.write(code(b"".join(self.parts)))  # reversal needs the whole record
                    output.close()
                super().close()

        return Writer()

    def transform_from(self, input):
        return io.BytesIO(self._code(input.read()))


def registry() -> ExtensionRegistry:
    reg = ExtensionRegistry()
    reg.register(XorReverse)
    return reg


def make_extension(kind: str):
    if kind == "zstd":
        if not ZStandard.is_available():
            pytest.skip(ZSTD_MISSING)
        return ZStandard()
    return XorReverse()


# ---------------------------------------------------------------- state dicts

def _value(name, shape, dtype):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-1 << 40, 1 << 40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def make_state():
    big = _value("big", (300, 257), torch.float32)   # > 64 KiB: an aligned record without transforms
    big[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    return {
        "big": big,
        "half": _value("half", (33, 7), torch.bfloat16),
        "ints": _value("ints", (17,), torch.int64),
        "flags": _value("flags", (10,), torch.bool),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "view": _value("view", (20, 20), torch.float64)[::2, 1:],   # not contiguous
        "meta": {"step": 7, "tag": "fastckpt", "lr": [1e-3, 2e-3]},
    }


def assert_bitwise_equal(got, want, what=""):
    states.assert_same(got, want, what, bitwise=True)


def zeros_like_state(sd):
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        else:
            out[k] = {"step": 0, "tag": "", "lr": [0.0, 0.0]}
    return out




def load_with(reader, sd):
    tgt = zeros_like_state(sd)
    dcp.load(tgt, storage_reader=reader)
    return tgt


def readers(path):
    return {"FastReader": FastReader(path, _extension_registry=registry()),
            "FileSystemReader": dcp.FileSystemReader(path, _extension_registry=registry())}


def descriptors(path):
    md = FastReader(path).read_metadata()
    return {idx.fqn: getattr(info, "transform_descriptors", None) for idx, info in md.storage_data.items()}


# ---------------------------------------------------------------- world size 1

@pytest.mark.parametrize("kind", ["zstd", "xorrev"])
@pytest.mark.parametrize("layout", [dict(), dict(thread_count=2), dict(single_file_per_rank=False)],
                         ids=["one-file", "two-threads", "file-per-item"])
def test_fastwriter_roundtrip_with_both_readers(tmp_path, kind, layout):
    sd = make_state()
    dcp.save(sd, storage_writer=FastWriter(tmp_path, _extensions=[make_extension(kind)], **layout))
    assert temp_files(tmp_path) == []
    for name, reader in readers(tmp_path).items():
        assert_bitwise_equal(load_with(reader, sd), sd, f"FastWriter -> {name}")


@pytest.mark.parametrize("kind", ["zstd", "xorrev"])
def test_stock_writer_to_fastreader(tmp_path, kind):
    sd = make_state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[make_extension(kind)]))
    assert_bitwise_equal(load_with(FastReader(tmp_path, _extension_registry=registry()), sd), sd,
                         "FileSystemWriter -> FastReader")


@pytest.mark.parametrize("exts", [["zstd"], ["xorrev"], ["xorrev", "zstd"]], ids="+".join)
def test_metadata_records_descriptors_as_torch_does(tmp_path, exts):
    sd = make_state()
    dcp.save(sd, storage_writer=FastWriter(tmp_path / "fast", _extensions=[make_extension(k) for k in exts]))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "stock",
                                                     _extensions=[make_extension(k) for k in exts]))
    fast, stock = descriptors(tmp_path / "fast"), descriptors(tmp_path / "stock")
    assert fast == stock
    assert set(map(tuple, fast.values())) == {tuple(e.get_descriptor()
                                                    for e in reversed([make_extension(k) for k in exts]))}
    # and an empty list of extensions records no descriptors at all, as torch's writer
    dcp.save(sd, storage_writer=FastWriter(tmp_path / "none", _extensions=[]))
    assert set(descriptors(tmp_path / "none").values()) == {None}


def test_records_are_transformed(tmp_path):
    """Each record is the transform of a torch.save archive, not raw bytes."""
    if not ZStandard.is_available():
        pytest.skip(ZSTD_MISSING)
    import zstandard
    zeros = {"z": torch.zeros(1 << 18)}   # 1 MiB of zeros: compresses to almost nothing
    dcp.save(zeros, storage_writer=FastWriter(tmp_path, _extensions=[ZStandard()]))
    md = FastReader(tmp_path).read_metadata()
    (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == "z"]
    assert info.length < 64 << 10
    with open(tmp_path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    archive = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
    assert archive[:4] == b"PK\x03\x04"
    assert torch.equal(torch.load(io.BytesIO(archive), weights_only=True), zeros["z"])
    assert os.path.getsize(tmp_path / info.relative_path) < 64 << 10


@pytest.mark.parametrize("op", ["fsync", "rename"])
def test_transformed_files_go_through_the_engine_commit(tmp_path, op):
    """A fault injected into the engine's fdatasync or rename of a data file fails
    the save: the transformed bytes are written by the engine, under a temporary
    name, and become visible only after they are durable."""
    _C.fault_inject(op, nth=1, errno=errno.EIO, path_contains="distcp")
    with pytest.raises(OSError) as ei:
        dcp_unwrapped(dcp.save, make_state(), storage_writer=FastWriter(tmp_path, _extensions=[XorReverse()]))
    assert ei.value.errno == errno.EIO
    assert _C.fault_fired() >= 1
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".distcp", ".metadata"))]
    assert temp_files(tmp_path) == []


def test_unsupported_extensions_are_refused(tmp_path):
    class NotAStream:
        pass

    with pytest.raises(NotImplementedError, match="StreamTransformExtension"):
        FastWriter(tmp_path, _extensions=[NotAStream()])


def _damage(path, fqn, how):
    md = FastReader(path).read_metadata()
    (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == fqn]
    fname = os.path.join(path, info.relative_path)
    with open(fname, "r+b") as f:
        f.seek(info.offset)
        raw = bytearray(f.read(info.length))
        if how == "flip":
            for i in range(len(raw) // 3, len(raw) // 3 + 16):
                raw[i] ^= 0xFF
        else:  # garbage: the record no longer is a zstd frame at all
            raw[:] = b"\x00" * len(raw)
        f.seek(info.offset)
        f.write(raw)
    return fname


@pytest.mark.parametrize("how", ["flip", "garbage"])
def test_corrupt_compressed_record_names_the_file(tmp_path, how):
    if not ZStandard.is_available():
        pytest.skip(ZSTD_MISSING)
    sd = make_state()
    dcp.save(sd, storage_writer=FastWriter(tmp_path, _extensions=[ZStandard()]))
    fname = _damage(tmp_path, "big", how)
    with pytest.raises(FormatError) as ei:
        dcp_unwrapped(dcp.load, zeros_like_state(sd), storage_reader=FastReader(tmp_path))
    msg = str(ei.value)
    assert fname in msg and "big" in msg, msg


# ---------------------------------------------------------------- world size 2

def _run_ranks(scenario, world_size, work, timeout=240):
    if not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    wait_for_ranks(start_ranks(os.path.abspath(__file__), scenario, work, world_size), scenario, timeout)


def _kinds():
    return ["zstd", "xorrev"] if ZStandard.is_available() else ["xorrev"]


def test_world_size_2(tmp_path):
    """Two gloo ranks save a sharded state dict with FastWriter and with
    FileSystemWriter, each with ZStandard and the user transform, and load every
    checkpoint back with both readers; here, at world size 1, every checkpoint
    is loaded again (resharded) with both readers."""
    _run_ranks("ws2", 2, tmp_path)
    sd = make_state()
    for kind in _kinds():
        assert descriptors(tmp_path / f"fast-{kind}") == descriptors(tmp_path / f"stock-{kind}")
        for writer in ("fast", "stock"):
            for name, reader in readers(tmp_path / f"{writer}-{kind}").items():
                assert_bitwise_equal(load_with(reader, sd), sd, f"{writer} ({kind}, 2 ranks) -> {name} at 1")
    if not ZStandard.is_available():
        pytest.skip(f"world size 2 ran with the user transform only: {ZSTD_MISSING}")


def _rank_main(scenario, work):
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    assert scenario == "ws2", scenario
    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded():
        sd = make_state()
        for k in ("big", "half", "ints"):   # uneven shards on rows; the rest replicated
            sd[k] = distribute_tensor(sd[k], mesh, [Shard(0)])
        return sd

    def full(sd):
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}

    def zeros(sd):
        out = {}
        for k, v in sd.items():
            if isinstance(v, DTensor):
                out[k] = distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), mesh, [Shard(0)])
            elif isinstance(v, torch.Tensor):
                out[k] = torch.zeros(v.shape, dtype=v.dtype)
            else:
                out[k] = {"step": 0, "tag": "", "lr": [0.0, 0.0]}
        return out

    want = make_state()
    for kind in _kinds():
        ext = ZStandard() if kind == "zstd" else XorReverse()
        dcp.save(sharded(), storage_writer=FastWriter(os.path.join(work, f"fast-{kind}"), _extensions=[ext]))
        dcp.save(sharded(), storage_writer=dcp.FileSystemWriter(os.path.join(work, f"stock-{kind}"),
                                                                _extensions=[ext]))
        for writer in ("fast", "stock"):
            path = os.path.join(work, f"{writer}-{kind}")
            for name, reader in readers(path).items():
                tgt = zeros(sharded())
                dcp.load(tgt, storage_reader=reader)
                assert_bitwise_equal(full(tgt), want, f"{writer} ({kind}) -> {name} at 2, rank {rank}")
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK {scenario} rank {rank}", flush=True)


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
