"""fastckpt.save writes torch.save's ``.format_version`` record, and with it a
layout torch.load can predict: every storage record on the one alignment that
``.storage_alignment`` states, so that torch's offset calculation (used by
``calculate_storage_offsets``, mmap loads, meta and fake-tensor loads' recorded
offsets) finds each storage where it is."""

import os
import zipfile

import pytest
import torch
from torch.utils.serialization import config as torch_config

import fastckpt
from fastckpt.formats import zip as _zip


def _states():
    g = torch.Generator().manual_seed(0)
    large = {f"w{i}": torch.randn(64 << 10, generator=g) for i in range(4)}            # 256 KiB each
    mixed = {**large, **{f"step{i}": torch.tensor(float(i)) for i in range(8)},      # optimizer-style scalars
             "bias": torch.randn(100, generator=g)}
    tiny = {f"s{i}": torch.tensor(i) for i in range(2000)}                            # many small, one large
    tiny["big"] = torch.randn(32 << 10, generator=g)
    small = {"a": torch.arange(10), "b": torch.ones(3, 3)}
    return {"large": large, "mixed": mixed, "tiny": tiny, "small": small}


def _records(path):
    with zipfile.ZipFile(path) as z:
        out = {}
        for i in z.infolist():
            name = i.filename.split("/", 1)[1]
            with open(path, "rb") as f:
                f.seek(i.header_offset)
                h = f.read(30)
            n, m = int.from_bytes(h[26:28], "little"), int.from_bytes(h[28:30], "little")
            out[name] = (i.header_offset + 30 + n + m, i.file_size, z.read(i.filename) if name[:1] == "." else None)
        return out


@pytest.mark.parametrize("kind", ["large", "mixed", "tiny", "small"])
def test_format_version_is_written_and_offsets_are_predictable(tmp_path, kind, monkeypatch):
    sd = _states()[kind]
    p = tmp_path / "c.pt"
    fastckpt.save(sd, p)
    recs = _records(p)
    assert recs[".format_version"][2] == b"1"  # as torch.save writes it
    align = int(recs[".storage_alignment"][2])
    storages = {n: r for n, r in recs.items() if n.startswith("data/")}
    assert all(off % align == 0 for off, _, _ in storages.values()), (align, storages)
    if kind in ("large", "mixed"):  # large storages are read O_DIRECT straight into place
        assert align % _zip.ALIGNMENT == 0
    if kind in ("small", "tiny"):  # torch's own alignment (no 4 KiB padding for each of 2,000 scalars)
        assert align == _zip.TORCH_ALIGNMENT

    # torch's calculated offsets, checked by torch's own debug assert, and the loaded values
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    torch_config.load.calculate_storage_offsets = True
    try:
        for mmap in (False, True):
            got = torch.load(p, mmap=mmap, weights_only=True)
            assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    finally:
        torch_config.load.calculate_storage_offsets = False
    # a meta load records each storage's offset in the file: it must be the record's
    meta = torch.load(p, map_location="meta", weights_only=True)
    for k, t in meta.items():
        off = t.untyped_storage()._checkpoint_offset
        assert any(off == o for o, n, _ in storages.values() if n == t.untyped_storage().nbytes()), k
    monkeypatch.delenv("TORCH_SERIALIZATION_DEBUG")
    got = fastckpt.load(p)
    assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_the_alignment_rule_bounds_the_padding():
    A = _zip.ALIGNMENT
    big = _zip.DIRECT_MIN
    assert _zip.storage_alignment([big] * 4, 64) == A
    assert _zip.storage_alignment([10] * 5, 64) == 64                    # nothing large: torch's layout
    assert _zip.storage_alignment([big] + [8] * 100, 64) == A            # 400 KiB of padding < 1 MiB
    assert _zip.storage_alignment([big] + [8] * 1000, 64) == 64          # 4 MiB of padding for 64 KiB of data
    assert _zip.storage_alignment([1 << 30] + [8] * 1000, 64) == A       # 4 MiB next to 1 GiB
    assert _zip.storage_alignment([big] * 4, 64, direct_min=None) == 64  # torch.save's own layout asked for
    assert _zip.storage_alignment([big], 8192) == 8192                   # torch's configured alignment kept


def test_stock_reader_in_a_fresh_process_agrees(tmp_path):
    """A stock torch.load in a process with the debug assert on from the start."""
    import subprocess
    import sys
    p = tmp_path / "c.pt"
    fastckpt.save(_states()["mixed"], p)
    code = ("import torch, sys; from torch.utils.serialization import config as c; "
            "c.load.calculate_storage_offsets = True; sd = torch.load(sys.argv[1], mmap=True); print(len(sd))")
    r = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TORCH_SERIALIZATION_DEBUG="1"))
    assert r.returncode == 0 and r.stdout.strip() == "13", r.stderr
