"""fastckpt.load(path, group=pg): every rank that has the file reads a share of
it and the shares are exchanged over the group (fastckpt/_collective_load.py).
Each rank is a subprocess (tests/support/workers/collective_load_worker.py) joined
through a FileStore."""
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.formats import zip as _zip

from collective_ranks import bytes_read, last_line, storage_bytes
from collective_ranks import run_ranks as _run_ranks
from workers import collective_worker as worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def run_ranks(tmp_path: Path, world: int, path: Path, case: str, mode: str = "ok"):
    return _run_ranks(tmp_path, world, path, case, mode, worker_script="collective_load_worker.py")




def save(path: Path, case: str, with_torch: bool = False) -> Path:
    (torch.save if with_torch else fastckpt.save)(worker.build(case), path)
    return path


def assert_all_ok(res):
    for r, (rc, text) in enumerate(res):
        assert rc == 0 and last_line(text) == "OK", f"rank {r} (exit {rc}): {text}"


@pytest.mark.parametrize("world,case,with_torch", [(1, "mixed", False), (2, "mixed", False), (3, "mixed", False),
                                                   (4, "mixed", False), (3, "mixed", True), (4, "few", False),
                                                   (3, "none", False), (4, "one_big", False)])
def test_collective_load_gives_every_rank_the_object_reading_the_file_once(tmp_path, world, case, with_torch):
    path = save(tmp_path / "ckpt.pt", case, with_torch)
    res = run_ranks(tmp_path, world, path, case)
    assert_all_ok(res)
    total = storage_bytes(path)
    reads = [bytes_read(text) for _, text in res]
    assert sum(reads) == total, reads  # the file's storages read once in total
    # Shares balanced by bytes (cuts move to the next 4 KiB of a record).
    assert max(reads) <= total // world + 4096, (reads, total)
    if case in ("mixed", "one_big"):
        assert min(reads) > 0, reads


def test_a_rank_without_the_file_gets_it_from_its_peers(tmp_path):
    path = save(tmp_path / "ckpt.pt", "mixed")
    res = run_ranks(tmp_path, 3, path, "mixed", "missing1")
    assert_all_ok(res)
    reads = [bytes_read(text) for _, text in res]
    assert reads[1] == 0 and sum(reads) == storage_bytes(path), reads


def test_no_rank_with_the_file_is_file_not_found_everywhere(tmp_path):
    path = tmp_path / "ckpt.pt"
    res = run_ranks(tmp_path, 2, path, "mixed", "missing_all")
    for r, (rc, text) in enumerate(res):
        line = last_line(text)
        assert rc == 0 and line.startswith("ERR FileNotFoundError: ") and f"{path}.absent" in line, text


def test_ranks_with_different_files_raise_everywhere(tmp_path):
    path = save(tmp_path / "ckpt.pt", "mixed")
    other = worker.build("mixed")
    other["big"][5] += 1
    fastckpt.save(other, str(path) + ".other")
    res = run_ranks(tmp_path, 3, path, "mixed", "other1")
    for r, (rc, text) in enumerate(res):
        line = last_line(text)
        assert rc == 0 and line.startswith("ERR ValueError: "), text
        assert "ranks 0 and 1 have different files" in line, line


def test_a_damaged_storage_is_named_on_every_rank(tmp_path):
    path = save(tmp_path / "ckpt.pt", "mixed")
    rec = _zip.Archive.open(str(path)).records["data/0"]  # "big" (the first storage pickled)
    data = bytearray(path.read_bytes())
    data[rec.data_offset + rec.size - 10] ^= 0x40  # in the last rank's share
    path.write_bytes(bytes(data))
    res = run_ranks(tmp_path, 3, path, "mixed")
    for r, (rc, text) in enumerate(res):
        line = last_line(text)
        assert rc == 0 and line.startswith("ERR FormatError: "), text
        assert "checksum mismatch" in line and "big" in line and str(path) in line, line


def test_a_read_error_on_one_rank_fails_every_rank(tmp_path):
    path = save(tmp_path / "ckpt.pt", "mixed")
    res = run_ranks(tmp_path, 3, path, "mixed", "fault")
    lines = [last_line(text) for _, text in res]
    assert all(rc == 0 for rc, _ in res), res
    assert lines[1].startswith("ERR OSError: ") and "Input/output error" in lines[1] and str(path) in lines[1], lines
    for r in (0, 2):
        assert lines[r].startswith("ERR OSError: ") and str(path) in lines[r], lines
        assert "rank 1 of the group failed to read its share" in lines[r] and "nothing was loaded" in lines[r], lines


@pytest.mark.parametrize("mode", ["kill", "kill_exchange"])
def test_a_killed_rank_fails_the_survivors(tmp_path, mode):
    path = save(tmp_path / "ckpt.pt", "mixed")
    res = run_ranks(tmp_path, 3, path, "mixed", mode)
    assert res[1][0] == -9, res[1]
    for r in (0, 2):
        rc, text = res[r]
        line = last_line(text)
        # Either the survivor noticed the dead peer (an OSError naming the
        # path), or (kill_exchange) its pieces had all arrived before rank 1 died.
        if line != "OK" or mode == "kill":
            assert rc == 0 and line.startswith("ERR OSError: "), f"rank {r} (exit {rc}): {text}"
            assert str(path) in line and "nothing was loaded" in line, line


@pytest.mark.parametrize("mode", ["meta", "unsafe"])
def test_map_location_and_weights_only_as_a_local_load(tmp_path, mode):
    path = save(tmp_path / "ckpt.pt", "mixed")
    assert_all_ok(run_ranks(tmp_path, 2, path, "mixed", mode))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_map_location_that_fails_fails_on_every_rank(tmp_path):
    path = save(tmp_path / "ckpt.pt", "few")
    res = run_ranks(tmp_path, 2, path, "few", "cuda_map")
    for rc, text in res:
        assert rc == 0 and last_line(text).startswith("ERR "), text


def test_legacy_files_load_on_every_rank_that_has_them(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save(worker.build("few"), path, _use_new_zipfile_serialization=False)
    assert_all_ok(run_ranks(tmp_path, 2, path, "few"))
    res = run_ranks(tmp_path, 2, path, "few", "missing1")
    for rc, text in res:
        assert rc == 0 and last_line(text).startswith("ERR ValueError: ") and "legacy format" in text, text


def test_group_needs_a_path_and_no_mmap(tmp_path):
    path = save(tmp_path / "ckpt.pt", "few")
    with pytest.raises(ValueError, match="needs a path"):
        fastckpt.load(io.BytesIO(path.read_bytes()), group=object())
    with pytest.raises(ValueError, match="mmap=False"):
        fastckpt.load(path, group=object(), mmap=True)
