"""ZipSource's object tree (what ``fastckpt inspect``, ``verify``, ``convert`` and
``load_into`` read): a plain state dict's data.pkl is built by CPython's C unpickler, as
``fastckpt.load`` builds it; anything else by torch's weights-only unpickler. Both give the tree
``torch.load(map_location="meta")`` gives, with each storage tagged with its record."""
import pytest
import torch
import torch.serialization as ts

import fastckpt
from fastckpt.sources import ZipSource, storage_of


def _state():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(40, 30, generator=g)
    return {"w": base, "view": base[3:9, ::2], "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
            "i64": torch.arange(9), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4),
            "nested": {"list": [torch.ones(3), 7, "x", 1.5], "tuple": (torch.zeros(2, 2), None)},
            "param": torch.nn.Parameter(torch.randn(5, generator=g))}


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix, tree


def _same_tree(got, want):
    g, w = list(_leaves(got)), list(_leaves(want))
    assert [k for k, _ in g] == [k for k, _ in w]
    for (k, a), (_, b) in zip(g, w):
        assert type(a) is type(b), k
        if isinstance(a, torch.Tensor):
            assert a.is_meta and (a.dtype, a.shape, a.stride(), a.storage_offset()) == \
                (b.dtype, b.shape, b.stride(), b.storage_offset()), k
        else:
            assert a == b, k


@pytest.mark.parametrize("writer", [torch.save, fastckpt.save], ids=["torch.save", "fastckpt.save"])
def test_a_plain_state_dicts_tree_is_built_by_the_c_unpickler(tmp_path, writer, monkeypatch):
    path = tmp_path / "s.pt"
    sd = _state()
    writer(sd, path)
    want = torch.load(path, map_location="meta")

    def no_torch_unpickler(*a, **k):
        raise AssertionError("torch's unpickler ran for a plain state dict")
    monkeypatch.setattr(ts, "_load", no_torch_unpickler)
    with ZipSource(str(path)) as src:
        tree = src.tree()
        _same_tree(tree, want)
        # every tensor knows its record; views of one storage share it
        assert storage_of(tree["w"]) is storage_of(tree["view"])
        assert storage_of(tree["w"]).key != storage_of(tree["i64"]).key
        for _, t in _leaves(tree):
            if isinstance(t, torch.Tensor):
                s = storage_of(t)
                assert s.key in src.storages and s.dtype == t.dtype
    monkeypatch.undo()
    loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    loaded["nested"] = {"list": [torch.zeros(3), 7, "x", 1.5], "tuple": (torch.ones(2, 2), None)}
    fastckpt.load_into(loaded, path)
    assert torch.equal(loaded["view"], sd["view"]) and torch.equal(loaded["bf16"], sd["bf16"])
    assert torch.equal(loaded["nested"]["list"][0], sd["nested"]["list"][0])


def test_anything_else_goes_to_torchs_unpickler(tmp_path, monkeypatch):
    # torch.device is on torch's allow-list and not in the plain vocabulary
    path = tmp_path / "s.pt"
    sd = {"w": torch.randn(4, 4), "where": torch.device("cpu")}
    torch.save(sd, path)
    calls = []
    real = ts._load

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(ts, "_load", counted)
    with ZipSource(str(path)) as src:
        tree = src.tree()
    assert calls == [1]
    _same_tree(tree, torch.load(path, map_location="meta"))
    assert storage_of(tree["w"]).nbytes == 64


def test_a_plain_pickle_naming_a_missing_record_is_a_format_error_naming_the_file(tmp_path, monkeypatch):
    # the C unpickler's path meets the damage (torch's unpickler is made to fail): the same error
    import zipfile
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save({"a": torch.ones(4), "b": torch.zeros(3)}, good)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if not info.filename.endswith("/data/1"):
                zout.writestr(info.filename, zin.read(info.filename))

    def no_torch_unpickler(*a, **k):
        raise AssertionError("torch's unpickler ran for a plain state dict")
    monkeypatch.setattr(ts, "_load", no_torch_unpickler)
    with ZipSource(str(bad)) as src:
        with pytest.raises(fastckpt.FormatError, match=r"bad\.pt.*refers to record 'data/1', which is missing"):
            src.tree()
