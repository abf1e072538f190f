"""fastckpt.load_into in one process: bitwise restores from every format it reads, into the
tensors that are there (their memory kept), the checks made before any byte is read, and damaged
files found. DTensor targets: test_load_into_dtensor.py."""
import os

import pytest
import torch

import fastckpt
from fastckpt import safetensors as st
from fastckpt.errors import StateMismatchError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _trained(steps=3, lr=1e-2):
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    for i in range(steps):
        torch.manual_seed(100 + i)
        m(torch.randn(8, 16)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _mixed():
    g = torch.Generator().manual_seed(1)
    return {"f32": torch.randn(64, 33, generator=g), "bf16": torch.randn(128, 40, generator=g).to(torch.bfloat16),
            "i64": torch.randint(-2**62, 2**62, (1000,), generator=g, dtype=torch.int64),
            "scalar": torch.tensor(3.5), "big": torch.randn(256, 1024, generator=g)}


def _zeros_like(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _bitwise(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dim() else a,
                                                                     b.view(torch.uint8) if b.dim() else b)


@pytest.mark.parametrize("writer", ["torch.save", "fastckpt.save"])
def test_a_model_and_adam_resume_bitwise_into_their_own_memory(tmp_path, writer):
    m, opt = _trained()
    p = tmp_path / "ckpt.pt"
    saved = {"model": m.state_dict(), "optim": opt.state_dict(), "epoch": 7}
    (torch.save if writer == "torch.save" else fastckpt.save)(saved, p)
    m2, opt2 = _trained(steps=1, lr=0.5)  # other values, optimizer state allocated
    state = {"model": m2.state_dict(), "optim": opt2.state_dict(), "epoch": 0}
    ptrs = [t.data_ptr() for t in m2.parameters()] + \
           [t.data_ptr() for s in opt2.state.values() for t in s.values()]
    res = fastckpt.load_into(state, p)
    assert tuple(res) == ([], []) and res.missing_keys == [] and res.unexpected_keys == []
    # the tensors were filled in place: the model's and the optimizer's own memory
    assert ptrs == [t.data_ptr() for t in m2.parameters()] + \
                   [t.data_ptr() for s in opt2.state.values() for t in s.values()]
    for k, v in m.state_dict().items():
        assert _bitwise(m2.state_dict()[k], v), k
    for p1, p2 in zip(m.parameters(), m2.parameters()):
        for k, v in opt.state[p1].items():
            assert _bitwise(opt2.state[p2][k], v), k
    assert state["epoch"] == 7 and state["optim"]["param_groups"][0]["lr"] == 1e-2
    opt2.load_state_dict(state["optim"])  # the non-tensor leaves resume the optimizer
    assert opt2.param_groups[0]["lr"] == 1e-2
    torch.manual_seed(9)
    x = torch.randn(8, 16)
    for mm, oo in ((m, opt), (m2, opt2)):
        mm(x).pow(2).sum().backward()
        oo.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert _bitwise(a.detach(), b.detach())


@pytest.mark.parametrize("fmt", ["fastckpt", "torch", "torch-legacy", "safetensors", "sharded-dir", "sharded-index",
                                 "dcp"])
def test_every_format_restores_bf16_fp32_int64_bitwise(tmp_path, fmt):
    full = _mixed()
    if fmt == "fastckpt":
        p = tmp_path / "c.pt"
        fastckpt.save(full, p)
    elif fmt == "torch":
        p = tmp_path / "c.pt"
        torch.save(full, p)
    elif fmt == "torch-legacy":  # read whole (weights-only), then copied in
        p = tmp_path / "c.pt"
        torch.save(full, p, _use_new_zipfile_serialization=False)
    elif fmt == "safetensors":
        p = tmp_path / "c.safetensors"
        st.save_file(full, p)
    elif fmt.startswith("sharded"):
        st.save_sharded(full, tmp_path / "hf", max_shard_size=300 << 10)
        assert len([n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]) > 1
        p = tmp_path / "hf" / ("model.safetensors.index.json" if fmt == "sharded-index" else "")
    else:
        import torch.distributed.checkpoint as dcp
        from fastckpt.dcp import FastWriter
        p = tmp_path / "dcp"
        dcp.save(full, storage_writer=FastWriter(p))
    target = _zeros_like(full)
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    assert fastckpt.load_into(target, str(p)) == ([], [])
    for k, v in full.items():
        assert _bitwise(target[k], v), k
        assert target[k].data_ptr() == ptrs[k], k


def test_tied_weights_stay_tied(tmp_path):
    def tied():
        m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 8), "out": torch.nn.Linear(8, 50, bias=False)})
        m["out"].weight = m["emb"].weight
        return m
    torch.manual_seed(3)
    a = tied()
    fastckpt.save(a.state_dict(), tmp_path / "t.pt")
    torch.manual_seed(4)
    b = tied()
    assert fastckpt.load_into(b.state_dict(), tmp_path / "t.pt") == ([], [])
    assert b["out"].weight is b["emb"].weight
    assert _bitwise(b["emb"].weight.detach(), a["emb"].weight.detach())


def test_non_contiguous_targets_and_strided_views_in_the_file(tmp_path):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(300, 200, generator=g)
    full = {"t": base.t(), "part": base[10:20], "w": torch.randn(64, 128, generator=g)}
    torch.save(full, tmp_path / "v.pt")  # "t" and "part" are views of one storage
    holder = torch.zeros(128, 2 * 64)
    target = {"t": torch.zeros(300, 200).t(), "part": torch.zeros(10, 200), "w": holder[:, ::2].t()}
    assert not target["w"].is_contiguous()
    ptr = target["w"].data_ptr()
    assert fastckpt.load_into(target, tmp_path / "v.pt") == ([], [])
    for k, v in full.items():
        assert torch.equal(target[k], v), k
    assert target["w"].data_ptr() == ptr and torch.count_nonzero(holder[:, 1::2]) == 0


def test_strict_lists_missing_and_unexpected_keys_and_non_strict_returns_them(tmp_path):
    full = {"a": torch.ones(3), "b": torch.ones(4), "extra": torch.ones(2)}
    p = tmp_path / "k.pt"
    fastckpt.save(full, p)
    target = {"a": torch.zeros(3), "b": torch.zeros(4), "gone": torch.zeros(5)}
    with pytest.raises(StateMismatchError) as e:
        fastckpt.load_into(target, p)
    msg = str(e.value)
    assert str(p) in msg and '"gone"' in msg and '"extra"' in msg and "Missing key(s)" in msg
    assert "Unexpected key(s)" in msg
    assert e.value.missing_keys == ["gone"] and e.value.unexpected_keys == ["extra"]
    assert all(torch.count_nonzero(t) == 0 for t in target.values())  # nothing was read
    res = fastckpt.load_into(target, p, strict=False)
    assert res.missing_keys == ["gone"] and res.unexpected_keys == ["extra"]
    assert torch.equal(target["a"], full["a"]) and torch.equal(target["b"], full["b"])
    assert torch.count_nonzero(target["gone"]) == 0


@pytest.mark.parametrize("bad", ["shape", "dtype", "kind"])
def test_shape_and_dtype_mismatches_raise_before_any_tensor_changed(tmp_path, bad):
    full = {"a": torch.ones(1000), "b": torch.ones(3, 4), "c": torch.ones(7)}
    p = tmp_path / "m.pt"
    fastckpt.save(full, p)
    target = {"a": torch.zeros(1000), "b": torch.zeros(3, 4), "c": torch.zeros(7)}
    if bad == "shape":
        target["b"] = torch.zeros(4, 3)
    elif bad == "dtype":
        target["b"] = torch.zeros(3, 4, dtype=torch.float64)
    else:
        target["b"] = 5
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in target.items()}
    with pytest.raises(StateMismatchError, match=f"{dict(shape='size').get(bad, bad)} mismatch for b") as e:
        fastckpt.load_into(target, p, strict=False)
    assert str(p) in str(e.value)
    for k, v in before.items():
        assert (torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v), k


def test_a_missing_path_is_file_not_found_naming_it(tmp_path):
    p = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError) as e:
        fastckpt.load_into({"a": torch.zeros(1)}, p)
    assert e.value.filename == str(p) and str(p) in str(e.value)
    with pytest.raises(TypeError):
        fastckpt.load_into([torch.zeros(1)], p)


@pytest.mark.parametrize("fmt", ["fastckpt", "torch", "safetensors"])
def test_a_truncated_file_is_a_format_error_naming_it(tmp_path, fmt):
    full = {"w": torch.randn(256, 256)}
    p = tmp_path / ("c.safetensors" if fmt == "safetensors" else "c.pt")
    {"fastckpt": fastckpt.save, "torch": torch.save, "safetensors": st.save_file}[fmt](full, p)
    size = os.path.getsize(p)
    os.truncate(p, size // 2)
    target = {"w": torch.zeros(256, 256)}
    with pytest.raises(fastckpt.FormatError, match=str(p)):
        fastckpt.load_into(target, p)
    assert torch.count_nonzero(target["w"]) == 0


@pytest.mark.parametrize("writer", ["torch.save", "fastckpt.save"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_a_flipped_byte_in_a_record_is_found_by_its_crc(tmp_path, writer, contiguous):
    w = torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256)
    p = tmp_path / "c.pt"
    (torch.save if writer == "torch.save" else fastckpt.save)({"w": w}, p)
    data = bytearray(p.read_bytes())
    at = data.find(w.numpy().tobytes()[4096:4160])
    assert at > 0
    data[at + 3] ^= 0x40
    p.write_bytes(bytes(data))
    target = {"w": torch.zeros(256, 256) if contiguous else torch.zeros(256, 256).t()}
    with pytest.raises(fastckpt.FormatError, match="checksum mismatch") as e:
        fastckpt.load_into(target, p)
    assert str(p) in str(e.value) and "data/0" in str(e.value) and "w" in str(e.value)


def test_a_dcp_directory_is_checked_against_its_metadata_before_loading(tmp_path):
    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastWriter
    full = {"a": torch.randn(8, 4), "b": torch.arange(5), "extra": torch.ones(2)}
    dcp.save(full, storage_writer=FastWriter(tmp_path / "d"))
    target = {"a": torch.zeros(8, 4), "b": torch.zeros(5, dtype=torch.int64), "gone": torch.zeros(1)}
    with pytest.raises(StateMismatchError) as e:
        fastckpt.load_into(target, tmp_path / "d")
    assert e.value.missing_keys == ["gone"] and e.value.unexpected_keys == ["extra"]
    assert torch.count_nonzero(target["a"]) == 0
    with pytest.raises(StateMismatchError, match="size mismatch for a"):
        fastckpt.load_into({"a": torch.zeros(4, 8)}, tmp_path / "d", strict=False)
    res = fastckpt.load_into(target, tmp_path / "d", strict=False)
    assert res.missing_keys == ["gone"] and res.unexpected_keys == ["extra"]
    assert torch.equal(target["a"], full["a"]) and torch.equal(target["b"], full["b"])


@pytest.mark.parametrize("attack", ["os.system", "builtins.exec"])
def test_a_hostile_pickle_runs_nothing(tmp_path, attack):
    import pickle
    import hostile_pickles as H
    marker = tmp_path / "pwned"
    p = tmp_path / "evil.pt"
    p.write_bytes(H.record(H.code_attacks(str(marker))[attack]))
    target = {"w": torch.zeros(3)}
    with pytest.raises((pickle.UnpicklingError, fastckpt.FormatError)) as e:
        fastckpt.load_into(target, p)
    assert str(p) in str(e.value)
    assert not marker.exists() and torch.count_nonzero(target["w"]) == 0


def test_no_fresh_memory_for_the_state(tmp_path):
    """A warm load_into of a 64 MiB state grows the process's peak memory by far less than the
    state (fastckpt.load, which returns a new copy, by all of it: the check can fail)."""
    import hostile_pickles as H
    if not H.rss_oracle_available():
        pytest.skip("the RSS high-water mark cannot be reset here (/proc/self/clear_refs)")
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(16)}
    p = tmp_path / "big.pt"
    fastckpt.save(state, p)
    target = _zeros_like(state)
    fastckpt.load_into(target, p)  # the engine's staging buffers backed once, as in a trainer's later loads
    res, grown = H.peak_growth(fastckpt.load_into, target, p, traced=False)
    assert tuple(res) == ([], []), res
    loaded, grown_load = H.peak_growth(fastckpt.load, p, traced=False)
    assert not isinstance(loaded, Exception), loaded
    del loaded
    assert grown < 16 << 20, f"load_into grew the peak by {grown >> 20} MiB for a 64 MiB state"
    assert grown_load > 48 << 20, f"fastckpt.load grew it by {grown_load >> 20} MiB only"
    assert all(torch.equal(target[k], v) for k, v in state.items())
