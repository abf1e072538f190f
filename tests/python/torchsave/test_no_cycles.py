"""A loaded state is freed as soon as the caller drops it: no reference cycle made by the loader
(a class per call whose methods close over the reader and the storages was one) keeps its tensors,
storages or the records' bytes alive until Python's cyclic collector next runs, which for a large
state can be never in a loop that allocates little. With the collector off, every load path's
result is dropped and nothing of it is left for the collector to find."""
import gc

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastckpt
import fastckpt.safetensors as fst
from fastckpt.dcp import FastReader, FastWriter

KEPT = ("Tensor", "Parameter", "TypedStorage", "UntypedStorage", "Records", "Reader", "Archive", "Entry")


@pytest.fixture
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(64, 32, generator=g) for i in range(5)}
    sd["view"] = sd["w0"][2:]  # a storage shared by two tensors
    sd["opt"] = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    paths = {"fastckpt": tmp_path / "c.pt", "torch": tmp_path / "t.pt", "st": tmp_path / "s.safetensors",
             "dcp": tmp_path / "dcp"}
    fastckpt.save(sd, paths["fastckpt"])
    torch.save(sd, paths["torch"])
    fst.save_file({k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}, paths["st"])
    dcp.save({k: v for k, v in sd.items() if k != "view"}, storage_writer=FastWriter(paths["dcp"]))
    return sd, paths


def _dcp_load(sd, path):
    tgt = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items() if k != "view"}
    dcp.load(tgt, storage_reader=FastReader(path))
    return tgt


LOADS = {
    "load": lambda sd, p: fastckpt.load(p["fastckpt"]),
    "load weights_only=False": lambda sd, p: fastckpt.load(p["fastckpt"], weights_only=False),
    "load verify=False": lambda sd, p: fastckpt.load(p["fastckpt"], verify=False),
    "load mmap": lambda sd, p: fastckpt.load(p["fastckpt"], mmap=True),
    "load meta": lambda sd, p: fastckpt.load(p["fastckpt"], map_location="meta"),
    "load of torch.save's file": lambda sd, p: fastckpt.load(p["torch"]),
    "safetensors.load_file": lambda sd, p: fst.load_file(p["st"]),
    "load_into": lambda sd, p: fastckpt.load_into({k: torch.zeros_like(v) for k, v in sd.items()
                                                   if isinstance(v, torch.Tensor)}, p["fastckpt"], strict=False),
    "dcp.load with FastReader": lambda sd, p: _dcp_load(sd, p["dcp"]),
}


@pytest.mark.parametrize("name", list(LOADS))
def test_a_dropped_result_leaves_nothing_for_the_collector(files, name):
    sd, paths = files
    LOADS[name](sd, paths)  # first use: the engine, caches, lazily imported modules
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.garbage.clear()
        LOADS[name](sd, paths)  # dropped at once
        gc.collect()
        kept = [type(o).__name__ for o in gc.garbage if type(o).__name__ in KEPT]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
    assert kept == [], f"{name}: {len(kept)} objects held by reference cycles: {sorted(set(kept))}"
