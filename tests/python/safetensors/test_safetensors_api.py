"""fastckpt.safetensors follows the installed safetensors.torch's signatures:
every function it mirrors takes the same parameters (names, kinds, defaults),
so code written for safetensors runs unchanged, and a new safetensors release
that adds a keyword fails here first."""
import inspect

import pytest
import torch

import fastckpt.safetensors as fst

st = pytest.importorskip("safetensors.torch")
from safetensors import SafetensorError  # noqa: E402

MIRRORED = ("save_file", "load_file", "save_model", "load_model")


@pytest.mark.parametrize("name", MIRRORED)
def test_signature_matches_the_installed_safetensors(name):
    ours = inspect.signature(getattr(fst, name)).parameters
    theirs = inspect.signature(getattr(st, name)).parameters
    assert list(ours) == list(theirs), (name, list(ours), list(theirs))
    for p in theirs.values():
        q = ours[p.name]
        assert q.kind == p.kind, (name, p.name, q.kind, p.kind)
        assert q.default == p.default, (name, p.name, q.default, p.default)


def test_backend_is_accepted_and_checked_as_safetensors_checks_it(tmp_path):
    path = tmp_path / "m.safetensors"
    model = torch.nn.Linear(4, 3)
    st.save_model(model, str(path))
    for backend in fst.BACKENDS:
        got = fst.load_file(path, backend=backend)
        assert torch.equal(got["weight"], model.weight.detach()), backend
        other = torch.nn.Linear(4, 3)
        assert fst.load_model(other, path, backend=backend) == (set(), [])
        assert torch.equal(other.weight, model.weight)
    for bad, exc in (("foo", SafetensorError), ("MMAP", SafetensorError), (None, TypeError), (1, TypeError)):
        with pytest.raises(exc):
            st.load_file(str(path), backend=bad)
        with pytest.raises(exc):
            fst.load_file(path, backend=bad)
        with pytest.raises(exc):
            fst.load_model(torch.nn.Linear(4, 3), path, backend=bad)
