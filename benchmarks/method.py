"""What ``benchmarks/bench_save_load.py`` measures: the ``Method`` interface (one way of saving, and
maybe loading, a state dict, run inside the benchmark's forked children) and the safetensors encoding of
the nested state dict that every safetensors writer and reader of the benchmark shares. The methods
themselves are in bench_save_load.py (fastckpt, torch, DCP, safetensors, DeepSpeed) and
``benchmarks/peers.py`` (the other libraries users pick).
"""

import json
import os
from typing import Any, Callable, Dict, List, Tuple

import torch

from benchmarks.harness import remove


# safetensors: flat tensors + the rest of the structure as JSON in the header's metadata.
# (The synthetic state dict shares no storage between tensors; safetensors refuses shared ones.)

def st_flatten(sd: Any) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    flat: Dict[str, torch.Tensor] = {}

    def enc(o, name):
        if isinstance(o, torch.Tensor):
            flat[name] = o
            return {"t": name}
        if isinstance(o, dict):
            return {"d": [[k, enc(v, f"{name}.{k}" if name else str(k))] for k, v in o.items()]}
        if isinstance(o, (list, tuple)):
            return {"l" if isinstance(o, list) else "u": [enc(v, f"{name}.{i}") for i, v in enumerate(o)]}
        if o is None or isinstance(o, (bool, int, float, str)):
            return {"v": o}
        raise TypeError(f"safetensors peer: cannot encode {type(o).__name__} at {name}")

    skeleton = enc(sd, "")
    return flat, {"skeleton": json.dumps(skeleton, separators=(",", ":"))}


def st_unflatten(flat: Dict[str, torch.Tensor], meta: Dict[str, str]) -> Any:
    def dec(o):
        if "t" in o:
            return flat[o["t"]]
        if "d" in o:
            return {k: dec(v) for k, v in o["d"]}
        if "l" in o:
            return [dec(v) for v in o["l"]]
        if "u" in o:
            return tuple(dec(v) for v in o["u"])
        return o["v"]

    return dec(json.loads(meta["skeleton"]))


class Method:
    """One way of saving (and maybe loading) a state dict. Runs inside forked children."""

    key = ""
    label = ""
    load_label = ""
    has_load = True
    lazy_result = False   # the load returns memory-mapped tensors (made resident by touch_pages)
    dir_output = False    # the checkpoint is a directory

    def warmup(self, workdir: str) -> None:
        """Untimed: what a long-lived process does once (engines, pinned buffers), with a tiny save."""
        p = os.path.join(workdir, f"warmup-{os.getpid()}")
        tiny = {"model": {"w": torch.ones(1024, 64)}, "step": 1}
        try:
            self.save(tiny, p)
            if self.has_load:
                self.load(p, self.prepare_load(tiny))
        finally:
            remove(p)

    def prime(self, sd, workdir: str) -> None:
        """Untimed, after warmup(): what a trainer's earlier checkpoints of this same state left behind."""

    def save_once(self, sd, workdir: str) -> None:
        """A prime() for methods whose steady state a first save of this state makes (snapshot arenas,
        staging caches, writer processes): one untimed save of it, then its file is removed."""
        p = os.path.join(workdir, f"prime-{os.getpid()}.bin")
        try:
            self.save(sd, p)
        finally:
            remove(p)

    def load_variants(self) -> List[Tuple[str, str, Callable[[str, Any], Any]]]:
        """(key, label, load) of every load measured after this method's save, each in a fresh child from a
        cold page cache: the method's own load (its row pairs with the save), then the variants that read
        the same file another way (rows of their own)."""
        return [(self.key, self.load_label, self.load)] if self.has_load else []

    def save(self, sd, path: str) -> Any:
        raise NotImplementedError

    def prepare_load(self, sd) -> Any:
        return None

    def load(self, path: str, prep: Any) -> Any:
        raise NotImplementedError

    def read_back(self, path: str, sd) -> Any:
        """Untimed read back, to verify a save that has no load row."""
        return self.load(path, self.prepare_load(sd))

    def info(self) -> Dict[str, Any]:
        """What the report shows about the method (its settings); a "notes" list goes into the report's notes."""
        return {}

    def close(self) -> None:
        """Untimed, after the operation was measured: give back what warmup() started (helper processes)."""
