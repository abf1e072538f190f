"""fastckpt.save(obj, path, group=pg, placement="node"): every node writes one
complete copy to its own disk, its ranks splitting it (fastckpt/_collective.py).
Nodes are emulated: each rank's FASTCKPT_NODE names its node, each node's
"local disk" is a directory of its own. Each rank is a subprocess
(tests/support/workers/collective_worker.py) joined through a FileStore."""
import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt

from collective_ranks import assert_no_fd_leak, last_line, leftovers, reference_bytes, run_ranks
from states import assert_same
from workers import collective_worker as worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def node_dirs(tmp_path: Path, nodes):
    """{node: its directory} (each node's local disk)."""
    dirs = {}
    for n in nodes:
        if n not in dirs:
            dirs[n] = tmp_path / f"node_{n}"
            dirs[n].mkdir()
    return dirs


def run_nodes(tmp_path: Path, nodes, paths, case: str, mode: str = "ok", timeout: float = 400):
    """Rank r runs on node nodes[r] and saves to paths[r] with placement="node"."""
    return run_ranks(tmp_path, len(nodes), list(paths), case, mode, timeout, extra=("node",),
                     rank_env=lambda r: {"FASTCKPT_NODE": nodes[r]})


def tagged(text: str, tag: str):
    return ast.literal_eval([x for x in text.splitlines() if x.startswith(tag + " ")][-1][len(tag) + 1:])


LAYOUTS = [["a", "b"],  # 2 nodes of 1 rank
           ["a", "a"],  # 1 node of 2 ranks
           ["a", "b", "a"],  # 2 nodes: ranks 0 and 2, rank 1
           ["a", "b", "a", "b"],  # 2 nodes of 2 ranks
           ["a", "a", "b", "b"],
           ["a", "b", "c", "d"],  # 4 nodes of 1 rank
           ["a", "a", "a", "a"]]  # 1 node of 4 ranks


@pytest.mark.parametrize("nodes", LAYOUTS, ids=["".join(x) for x in LAYOUTS])
def test_every_node_gets_the_single_process_file_its_ranks_splitting_it(tmp_path, nodes):
    dirs = node_dirs(tmp_path, nodes)
    paths = [dirs[n] / "ckpt.pt" for n in nodes]
    res = run_nodes(tmp_path, nodes, paths, "mixed")
    for r, (rc, text) in enumerate(res):
        assert rc == 0 and last_line(text) == "OK", f"rank {r} (exit {rc}): {text}"
        assert_no_fd_leak(text)
    ref = reference_bytes(tmp_path, "mixed")
    for n, d in dirs.items():
        assert (d / "ckpt.pt").read_bytes() == ref, f"node {n}"
        assert leftovers(d) == []
    assert_same(worker.build("mixed"), torch.load(paths[-1], weights_only=True))
    # Each node's ranks split its copy: disjoint regions, every byte written once
    # within the node, each rank about its node's file size / its node's ranks.
    size = len(ref)
    for n in dirs:
        ranks = [r for r in range(len(nodes)) if nodes[r] == n]
        regions = {r: tagged(res[r][1], "REGIONS") for r in ranks}
        spans = sorted((off, off + length, r) for r in ranks for off, length in regions[r])
        for (a0, a1, ra), (b0, b1, rb) in zip(spans, spans[1:]):
            assert a1 <= b0, f"node {n}: rank {ra}'s [{a0}, {a1}) overlaps rank {rb}'s [{b0}, {b1})"
        written = {r: sum(length for _, length in regions[r]) for r in ranks}
        assert size * 0.95 <= sum(written.values()) <= size, (n, written, size)
        for r in ranks:
            assert abs(written[r] - size / len(ranks)) <= size * 0.05, (n, written, size)


def test_ranks_of_one_node_with_different_paths_raise_on_every_rank(tmp_path):
    nodes = ["a", "a", "b"]
    dirs = node_dirs(tmp_path, nodes)
    other = tmp_path / "node_a_other"
    other.mkdir()
    paths = [dirs["a"] / "ckpt.pt", other / "ckpt.pt", dirs["b"] / "ckpt.pt"]
    for p in paths:
        p.write_bytes(b"previous")
    res = run_nodes(tmp_path, nodes, paths, "mixed")
    for r, (rc, text) in enumerate(res):
        line = last_line(text)
        assert rc == 0 and line.startswith("ERR ValueError: "), f"rank {r} (exit {rc}): {text}"
        assert "ranks 0 and 1 of node 'a' pass different paths" in line and str(paths[r]) in line, line
        assert_no_fd_leak(text)
    for p in paths:
        assert p.read_bytes() == b"previous"
        assert sorted(x.name for x in p.parent.iterdir()) == ["ckpt.pt"]


@pytest.mark.parametrize("nodes", [["a", "b"], ["a", "b", "a", "b"], ["a", "b", "c"]])
@pytest.mark.parametrize("mode", ["differ_data", "differ_pickle"])
def test_ranks_with_different_data_raise_on_every_rank(tmp_path, nodes, mode):
    dirs = node_dirs(tmp_path, nodes)
    paths = [dirs[n] / "ckpt.pt" for n in nodes]
    for d in dirs.values():
        (d / "ckpt.pt").write_bytes(b"previous")
    res = run_nodes(tmp_path, nodes, paths, "mixed", mode)
    for r, (rc, text) in enumerate(res):
        line = last_line(text)
        assert rc == 0 and line.startswith("ERR ValueError: "), f"rank {r} (exit {rc}): {text}"
        assert ("ranks hold different data" if mode == "differ_data" else "ranks hold different objects") in line
        assert str(paths[r]) in line
        assert_no_fd_leak(text)
    for d in dirs.values():
        assert (d / "ckpt.pt").read_bytes() == b"previous"
        assert sorted(x.name for x in d.iterdir()) == ["ckpt.pt"]


def test_copies_that_differ_only_across_nodes_raise(tmp_path):
    """Rank 1 is alone on its node: no other rank checks its share, only the
    comparison of the nodes' copies finds its changed (unsampled) value."""
    nodes = ["a", "b"]
    dirs = node_dirs(tmp_path, nodes)
    paths = [dirs[n] / "ckpt.pt" for n in nodes]
    res = run_nodes(tmp_path, nodes, paths, "mixed", "differ_data")
    for r, (rc, text) in enumerate(res):
        line = last_line(text)
        assert rc == 0 and line.startswith("ERR ValueError: "), f"rank {r} (exit {rc}): {text}"
        assert "archive/data/0 of node 'b' (ranks [1]) differs from that of node 'a' (ranks [0])" in line, line
    for d in dirs.values():
        assert list(d.iterdir()) == []


@pytest.mark.parametrize("nodes", [["a", "b", "a"], ["a", "a", "b", "b"]], ids=["lead", "member"])
def test_engine_fault_on_one_rank_leaves_every_node_its_previous_file(tmp_path, nodes):
    """Rank 1's writes fail with EIO: it leads node b's copy, or is node a's second rank."""
    dirs = node_dirs(tmp_path, nodes)
    paths = [dirs[n] / "ckpt.pt" for n in nodes]
    for d in dirs.values():
        (d / "ckpt.pt").write_bytes(b"previous")
    res = run_nodes(tmp_path, nodes, paths, "mixed", "fault")
    lines = [last_line(text) for _, text in res]
    for r, (rc, text) in enumerate(res):
        assert rc == 0, f"rank {r} exited with {rc}:\n{text}"
        assert_no_fd_leak(text)
        assert lines[r].startswith("ERR OSError: ") and str(paths[r]) in lines[r], lines
        assert tagged(text, "COMMITTED") is None
    assert "Input/output error" in lines[1], lines
    for r in range(len(nodes)):
        if r != 1:
            assert "rank 1 of the group failed to write its share" in lines[r], lines
    for d in dirs.values():
        assert (d / "ckpt.pt").read_bytes() == b"previous"
        assert sorted(x.name for x in d.iterdir()) == ["ckpt.pt"]


def test_rename_failing_on_one_node_is_a_partial_commit_on_every_rank(tmp_path):
    """Every copy is durable; node b's rename fails (EIO): node a holds the
    new file, node b its previous one, and every rank says so."""
    nodes = ["a", "b", "a", "b"]
    dirs = node_dirs(tmp_path, nodes)
    paths = [dirs[n] / "ckpt.pt" for n in nodes]
    for d in dirs.values():
        (d / "ckpt.pt").write_bytes(b"previous")
    res = run_nodes(tmp_path, nodes, paths, "mixed", "rename_fault")
    for r, (rc, text) in enumerate(res):
        line = last_line(text)
        assert rc == 0 and line.startswith("ERR OSError: "), f"rank {r} (exit {rc}): {text}"
        assert "partial commit" in line and "node 'b' (rank 1)" in line and str(paths[r]) in line, line
        assert tagged(text, "COMMITTED") == ["a"]
        assert_no_fd_leak(text)
    assert (dirs["a"] / "ckpt.pt").read_bytes() == reference_bytes(tmp_path, "mixed")
    assert (dirs["b"] / "ckpt.pt").read_bytes() == b"previous"
    for d in dirs.values():
        assert leftovers(d) == []


def test_killed_rank_fails_the_survivors_and_no_node_changes(tmp_path):
    nodes = ["a", "b", "a"]  # rank 1, node b's only rank, dies after writing its share
    dirs = node_dirs(tmp_path, nodes)
    paths = [dirs[n] / "ckpt.pt" for n in nodes]
    for d in dirs.values():
        (d / "ckpt.pt").write_bytes(b"previous")
    res = run_nodes(tmp_path, nodes, paths, "mixed", "kill")
    assert res[1][0] == -9, res[1]
    for r in (0, 2):
        rc, text = res[r]
        line = last_line(text)
        assert rc == 0 and line.startswith("ERR OSError: "), f"rank {r} (exit {rc}): {text}"
        assert str(paths[r]) in line and "nothing was committed" in line, line
    for d in dirs.values():
        assert (d / "ckpt.pt").read_bytes() == b"previous"
    assert leftovers(dirs["a"]) == []
    assert len(leftovers(dirs["b"])) == 1  # rank 1 died holding node b's temporary file
    # The next save (node b's lead creates its temporary file) removes it.
    res = run_nodes(tmp_path, nodes, paths, "mixed")
    for r, (rc, text) in enumerate(res):
        assert rc == 0 and last_line(text) == "OK", f"rank {r} (exit {rc}): {text}"
    ref = reference_bytes(tmp_path, "mixed")
    for d in dirs.values():
        assert (d / "ckpt.pt").read_bytes() == ref
        assert leftovers(d) == []


def test_placement_is_checked_before_any_collective(tmp_path):
    target = tmp_path / "x.pt"
    with pytest.raises(ValueError, match="placement='disk' is not"):
        fastckpt.save({}, target, group=object(), placement="disk")
    with pytest.raises(ValueError, match="placement='node' needs group="):
        fastckpt.save({}, target, placement="node")
    import io
    with pytest.raises(ValueError, match="needs a path on each node's disk"):
        fastckpt.save({}, io.BytesIO(), group=object(), placement="node")
    assert list(tmp_path.iterdir()) == []


def test_node_local_copies_with_one_missing_load_on_every_rank(tmp_path):
    """Saved with placement="node" on 2 nodes, node b's copy then lost: a
    collective load gives every rank the state; node b's ranks read nothing
    from disk (they get everything from node a's), the file's storages are
    read once in total."""
    from collective_ranks import bytes_read, storage_bytes
    nodes = ["a", "b", "a", "b"]
    dirs = node_dirs(tmp_path, nodes)
    paths = [dirs[n] / "ckpt.pt" for n in nodes]
    res = run_nodes(tmp_path, nodes, paths, "mixed")
    for r, (rc, text) in enumerate(res):
        assert rc == 0 and last_line(text) == "OK", f"rank {r} (exit {rc}): {text}"
    (dirs["b"] / "ckpt.pt").unlink()
    outs = run_ranks(tmp_path, len(nodes), paths, "mixed", worker_script="collective_load_worker.py",
                     rank_env=lambda r: {"FASTCKPT_NODE": nodes[r]})
    for r, (rc, text) in enumerate(outs):
        assert rc == 0 and last_line(text) == "OK", f"rank {r} (exit {rc}): {text}"
    reads = [bytes_read(text) for _, text in outs]
    assert reads[1] == reads[3] == 0, reads
    assert reads[0] > 0 and reads[2] > 0 and sum(reads) == storage_bytes(paths[0]), reads


def test_rank_killed_while_the_nodes_rename_is_a_partial_commit_for_the_survivors(tmp_path):
    """Rank 1 (node b's lead) dies after its rename, when the outcomes are
    gathered: the survivors cannot know every node's outcome and say so; every
    node holds a complete file (here the new one: both renames were done)."""
    nodes = ["a", "b", "a"]
    dirs = node_dirs(tmp_path, nodes)
    paths = [dirs[n] / "ckpt.pt" for n in nodes]
    for d in dirs.values():
        (d / "ckpt.pt").write_bytes(b"previous")
    res = run_nodes(tmp_path, nodes, paths, "mixed", "kill_commit")
    assert res[1][0] == -9, res[1]
    for r, state in ((0, "renamed its copy"), (2, "unknown to this rank")):
        rc, text = res[r]
        line = last_line(text)
        assert rc == 0 and line.startswith("ERR OSError: "), f"rank {r} (exit {rc}): {text}"
        assert "partial commit: a rank died" in line and f"this rank's node 'a': {state}" in line, line
        assert str(paths[r]) in line
    ref = reference_bytes(tmp_path, "mixed")
    for d in dirs.values():
        assert (d / "ckpt.pt").read_bytes() == ref
        assert leftovers(d) == []
