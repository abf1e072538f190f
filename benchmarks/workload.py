"""The synthetic workload of the benchmarks: a model + AdamW state dict of a chosen size (fixed
seed), and what the benchmarks do with it (walk its tensors, compare a loaded copy with the
original, touch every page of a loaded result)."""

import math
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .harness import GiB, MiB, PAGE, SEED, log


def build_state_dict(total: int, seed: int = SEED) -> Dict[str, Any]:
    """A model + AdamW state dict of about ``total`` bytes of tensors (fixed seed, fully touched)::

        {"model": {name: tensor}, "optimizer": {"state": {i: {"step", "exp_avg", "exp_avg_sq"}},
         "param_groups": [{..., "params": [0..n-1]}]}, "step": int}

    AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype and shape, so the parameters take
    about a third of the bytes: three large ones (64-128 MiB each at 2 GiB, scaled with the size)
    and 24 transformer-like layers of 12 parameters, alternately float32 and bfloat16 (about a
    thousand tensors in all, most of them small).
    """
    scale = total / (2 * GiB)
    g = torch.Generator().manual_seed(seed)
    specs: List[Tuple[str, torch.dtype, Tuple[int, ...]]] = []
    cols = 1024
    big = [("embed_tokens.weight", torch.float32, 128), ("lm_head.weight", torch.bfloat16, 64),
           ("vision_proj.weight", torch.float32, 96)]
    big_bytes = 0
    for name, dt, mib in big:
        elt = torch.empty((), dtype=dt).element_size()
        rows = max(1, int(mib * MiB * scale) // (elt * cols))
        specs.append((name, dt, (rows, cols)))
        big_bytes += 3 * rows * cols * elt
    layers = 24
    per_layer = max(0, total - big_bytes) / 3 / layers  # parameter bytes per layer
    # 12 h^2 elements of matrices per layer, half the layers float32 (4 B), half bfloat16 (2 B)
    h = max(16, int(math.sqrt(per_layer / (12 * 3))) // 16 * 16)
    for i in range(layers):
        dt = torch.float32 if i % 2 == 0 else torch.bfloat16
        p = f"layers.{i}."
        specs += [(p + "attn.qkv.weight", dt, (3 * h, h)), (p + "attn.qkv.bias", dt, (3 * h,)),
                  (p + "attn.out.weight", dt, (h, h)), (p + "attn.out.bias", dt, (h,)),
                  (p + "mlp.fc1.weight", dt, (4 * h, h)), (p + "mlp.fc1.bias", dt, (4 * h,)),
                  (p + "mlp.fc2.weight", dt, (h, 4 * h)), (p + "mlp.fc2.bias", dt, (h,)),
                  (p + "ln1.weight", torch.float32, (h,)), (p + "ln1.bias", torch.float32, (h,)),
                  (p + "ln2.weight", torch.float32, (h,)), (p + "ln2.bias", torch.float32, (h,))]
    specs += [("final_ln.weight", torch.float32, (h,)), ("final_ln.bias", torch.float32, (h,))]

    model: Dict[str, torch.Tensor] = {}
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    for i, (name, dt, shape) in enumerate(specs):
        model[name] = torch.randn(shape, generator=g, dtype=dt)
        avg = torch.randn(shape, generator=g, dtype=dt).mul_(1e-3)
        sq = torch.randn(shape, generator=g, dtype=dt).square_().mul_(1e-6)
        state[i] = {"step": torch.tensor(1000.0), "exp_avg": avg, "exp_avg_sq": sq}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
               "fused": None, "decoupled_weight_decay": True, "params": list(range(len(specs)))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "step": 1000}


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def payload_bytes(obj: Any) -> int:
    return sum(t.nbytes for t in iter_tensors(obj))


def describe_sd(sd: Any) -> Dict[str, Any]:
    ts = list(iter_tensors(sd))
    sizes = sorted((t.nbytes for t in ts), reverse=True)
    by_dtype: Dict[str, int] = {}
    for t in ts:
        k = str(t.dtype).replace("torch.", "")
        by_dtype[k] = by_dtype.get(k, 0) + t.nbytes
    return {"tensors": len(ts), "bytes": sum(sizes), "largest_mib": [round(s / MiB, 1) for s in sizes[:9]],
            "at_least_64mib": sum(1 for s in sizes if s >= 64 * MiB),
            "under_1mib": sum(1 for s in sizes if s < MiB), "bytes_by_dtype": by_dtype}


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


def compare(a: Any, b: Any, path: str = "", out: Optional[List[str]] = None) -> List[str]:
    """Differences between the original ``a`` and the loaded ``b`` (at most 5 reported)."""
    out = [] if out is None else out
    if len(out) >= 5:
        return out
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            out.append(f"{path}: {type(b).__name__} instead of a tensor")
        elif a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{path}: {b.dtype}{list(b.shape)} instead of {a.dtype}{list(a.shape)}")
        elif b.device.type != "cpu":
            out.append(f"{path}: on {b.device}")
        elif not torch.equal(a, b):
            out.append(f"{path}: values differ")
    elif isinstance(a, dict):
        if not isinstance(b, dict):
            out.append(f"{path}: {type(b).__name__} instead of dict")
        elif list(a.keys()) != list(b.keys()):
            ka, kb = set(a), set(b)
            out.append(f"{path}: keys differ (missing {sorted(map(repr, ka - kb))[:3]}, "
                       f"extra {sorted(map(repr, kb - ka))[:3]})" if ka != kb else f"{path}: key order differs")
        else:
            for k in a:
                compare(a[k], b[k], f"{path}.{k}" if path else str(k), out)
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            out.append(f"{path}: {type(b).__name__}[{len(b) if hasattr(b, '__len__') else '?'}] instead of "
                       f"{type(a).__name__}[{len(a)}]")
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                compare(x, y, f"{path}.{i}", out)
    elif type(a) is not type(b) or a != b:
        out.append(f"{path}: {b!r} instead of {a!r}")
    return out


def touch_pages(sd: Any) -> int:
    """Read one byte of every 4 KiB page of every tensor (makes lazily mapped results resident)."""
    s = 0
    for t in iter_tensors(sd):
        if t.numel():
            b = t.reshape(-1).view(torch.uint8)
            s += int(b[::PAGE].sum()) + int(b[-1])
    return s


def build(size: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """build_state_dict(size), touched, and its description (with build_s), logged."""
    log.info("building the state dict (%.2f GB of tensors, seed %d) ...", size / 1e9, SEED)
    t = time.perf_counter()
    sd = build_state_dict(size)
    touch_pages(sd)
    info = describe_sd(sd)
    info["build_s"] = round(time.perf_counter() - t, 2)
    log.info("  %d tensors, %.3f GB, in %.1f s", info["tensors"], info["bytes"] / 1e9, info["build_s"])
    return sd, info


TINY = {"model": {"w": torch.ones(256, 64)}, "step": 1}
