"""Comparing states: nested dicts, lists and tuples of tensors and plain values.

One comparison serves every test; its keywords say how strict a test is, each the rule one of the
suites already had:

- ``bitwise``: tensors equal byte for byte (NaN equals the same NaN, -0.0 differs from 0.0), not by
  ``torch.equal``'s value comparison.
- ``ordered``: a dict's keys in the same order, not just the same keys.
- ``dtypes`` (default True): tensors of the same dtype and shape; False: ``torch.equal`` alone, which
  compares values across dtypes.
- ``exact_types``: plain values of the same type (``1`` differs from ``1.0`` and ``True``).
- ``sequence_types`` (default True): a list differs from a tuple; False: lengths and items only.
"""
from typing import Optional

import torch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def difference(a, b, path="state", *, bitwise=False, ordered=False, dtypes=True, exact_types=False,
               sequence_types=True, exact=False) -> Optional[str]:
    """Where and how `b` differs from `a` (the first difference found), or None when they are the same.
    `exact`: as an unpickler would have to build it: the same types of tensors and dicts (a Parameter
    is not a tensor, an OrderedDict not a dict), strides, storage offsets, requires_grad, and an
    OrderedDict's ``_metadata`` (a state dict's)."""
    kw = dict(bitwise=bitwise, ordered=ordered, dtypes=dtypes, exact_types=exact_types, sequence_types=sequence_types,
              exact=exact)
    if exact and isinstance(a, (torch.Tensor, dict)) and type(a) is not type(b):
        return f"{path}: {type(b).__name__}, not {type(a).__name__}"
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return f"{path}: {type(b).__name__}, not a tensor"
        if dtypes and (a.dtype != b.dtype or a.shape != b.shape):
            return f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if exact and (a.stride(), a.storage_offset(), a.requires_grad) != (b.stride(), b.storage_offset(), b.requires_grad):
            return (f"{path}: stride, offset, requires_grad {(a.stride(), a.storage_offset(), a.requires_grad)} != "
                    f"{(b.stride(), b.storage_offset(), b.requires_grad)}")
        if not (torch.equal(_bytes(a), _bytes(b)) if bitwise else torch.equal(a, b)):
            return f"{path}: values differ"
        return None
    if isinstance(a, dict):
        if not isinstance(b, dict):
            return f"{path}: {type(b).__name__}, not a dict"
        if (list(a) != list(b)) if ordered else (a.keys() != b.keys()):
            return f"{path}: keys {list(a)} != {list(b)}"
        if exact and getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            return f"{path}: _metadata {getattr(a, '_metadata', None)} != {getattr(b, '_metadata', None)}"
        for k in a:
            d = difference(a[k], b[k], f"{path}.{k}", **kw)
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if sequence_types and type(a) is not type(b):
            return f"{path}: {type(a).__name__} != {type(b).__name__}"
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = difference(x, y, f"{path}[{i}]", **kw)
            if d:
                return d
        return None
    if exact_types and type(a) is not type(b):
        return f"{path}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})"
    if not (a == b):
        return f"{path}: {a!r} != {b!r}"
    return None


def assert_same(a, b, path="state", **how) -> None:
    """Raise AssertionError naming the first difference of `b` from `a` (keywords: see the module)."""
    d = difference(a, b, path, **how)
    if d is not None:
        raise AssertionError(d)


def same_state(a, b, **how) -> bool:
    """Whether `a` and `b` are the same (keywords: see the module): dtypes, shapes and values of tensors."""
    return difference(a, b, **how) is None


def page_aligned(t: torch.Tensor, phase: int = 0) -> torch.Tensor:
    """A copy of `t` (contiguous) in memory of its own that starts `phase` bytes past a page boundary:
    0 as torch allocates tensors of 2 MiB and more under THP_MEM_ALLOC_ENABLE=1, 64 as its default
    allocator usually does (which a malloc'd tensor may also miss, landing on a page by chance)."""
    from fastckpt import _C
    n = t.numel() * t.element_size()
    out = _C.empty_aligned(max(n, 1), 4096, phase)[:n].view(t.dtype).view(t.shape)
    out.copy_(t)
    assert out.untyped_storage().data_ptr() % 4096 == phase
    return out


def align_module(m: torch.nn.Module, min_bytes: int = 0) -> torch.nn.Module:
    """Move every parameter of `m` (of at least `min_bytes`) into page-aligned memory, in place."""
    with torch.no_grad():
        for p in m.parameters():
            if p.numel() * p.element_size() >= min_bytes:
                p.data = page_aligned(p.data)
    return m
