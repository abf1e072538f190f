"""A sharded safetensors set as a source: opened by its directory or its index file, its index
checked as fastckpt.safetensors.load_sharded checks it (one parse, formats/safetensors.parse_index)."""
import json

import pytest
import torch

from fastckpt import FormatError, safetensors as st
from fastckpt.sources import ShardedSafetensorsSource, open_source


def _set(tmp_path):
    state = {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}
    st.save_sharded(state, tmp_path / "hf", max_shard_size=40 << 10)
    return state, tmp_path / "hf"


def test_a_set_opens_by_directory_and_by_index_and_reads_every_tensor(tmp_path):
    state, d = _set(tmp_path)
    for p in (d, d / "model.safetensors.index.json"):
        with open_source(str(p)) as src:
            assert isinstance(src, ShardedSafetensorsSource) and len(src.shards) > 1
            tree = src.tree()
            assert list(tree) == list(state)
            for k, v in state.items():
                assert torch.equal(src.materialize(tree[k]), v), k


def _rewrite_index(d, change):
    p = d / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    change(index["weight_map"])
    p.write_text(json.dumps(index))
    return p


@pytest.mark.parametrize("damage", ["path", "wrong shard", "in no shard", "not json"])
def test_a_bad_index_is_a_format_error_naming_the_file(tmp_path, damage):
    _, d = _set(tmp_path)
    if damage == "not json":
        p = d / "model.safetensors.index.json"
        p.write_text("{not json")
    elif damage == "path":
        p = _rewrite_index(d, lambda wm: wm.update(w0="../escape.safetensors"))
    elif damage == "wrong shard":
        def swap(wm):
            a, b = sorted(set(wm.values()))[:2]
            for k, v in wm.items():
                wm[k] = b if v == a else a if v == b else v
        p = _rewrite_index(d, swap)
    else:
        p = _rewrite_index(d, lambda wm: wm.update(ghost=wm["w0"]))
    with pytest.raises(FormatError) as e:
        open_source(str(d)).close()
    assert str(d) in str(e.value)
    with pytest.raises(FormatError):
        st.load_sharded(d)
