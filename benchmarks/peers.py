"""The peers users would pick, as ``Method``s of ``benchmarks/bench_save_load.py``'s per-size table.

* torch-checkpointing (Meta's ``torch_checkpointing``): ``CheckpointManager`` with a synchronous saver
  and with its asynchronous one (the state staged into shared memory by a thread, written by a spawned
  writer process), ``file_write_max_threads`` 4 (one file per top-level item: model, optimizer, step),
  the stock commit (a temporary directory renamed onto the final path); its load is
  ``CheckpointManager.load`` with its defaults (``use_mmap=True``; pages touched inside the timing).
  Its ``LocalFileSystemStorageConfig(use_direct_io=True)`` default is tried once per run on the
  benchmark's directory (``probe_direct_io``); where it fails (torch.save's unaligned writes to an
  O_DIRECT file: ext4, XFS), the error goes into the report's notes and the rows run with
  ``use_direct_io=False``. It never fsyncs (no fsync/fdatasync anywhere in the package): the bench adds
  ``harness.fsync_tree`` (every file, every directory, the checkpoint directory and its parent) inside
  the timing, marked "+fsync" in the labels.
* ``torch.distributed.checkpoint.async_save`` with the stock ``FileSystemWriter(sync_files=True)``
  (plus fsync of the checkpoint directory and its parent, as the dcp.save rows): the thread executor,
  the process executor (a daemon process, in a single-rank gloo group), and the thread executor with a
  ``DefaultStager`` kept across saves (its staging copy cached; ``use_pinned_memory=True`` is ignored by
  torch without CUDA, said in a note).
* safetensors readers of the file the safetensors row wrote (``safetensors.save_file``), each in a fresh
  child from a cold cache in the same repetition: ``fastckpt.safetensors.load_file``, fastsafetensors
  (``fastsafe_open(nogds=True)``, its CPU path) and runai-model-streamer (``SafetensorsStreamer``), the
  nesting rebuilt from the header's metadata as for ``safetensors.load_file``.

Helper processes (the torch-checkpointing writer process, DCP's checkpoint daemon, their resource
trackers) are counted in CPU-s/GB: ``harness.timed`` takes ``harness.cpu_tree()`` (this process and
every descendant, live or reaped) around the operation; their own peak RSS (VmHWM, a separate process
that also maps the shared staging memory) is kept beside the row's in the records (helpers_peak_rss).
A peer that is not installed is skipped with the reason (the report's not-run list).
"""

import importlib
import importlib.metadata
import os
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from benchmarks.harness import free_port, fsync_dir, fsync_tree, remove, run_in_child
from benchmarks.method import Method, st_unflatten
from benchmarks.workload import map_tensors

KEYS = ("tc", "tc_async", "dcp_async")
TC_WRITE_THREADS = 4
DISTRIBUTIONS = ("torch-checkpointing", "fastsafetensors", "runai-model-streamer", "zipnn")
TC_INSTALL = "`.venv/bin/pip install -c .venv/torch-constraint.txt -r requirements-dev.txt`"


def versions() -> Dict[str, str]:
    """The installed peers' versions, by distribution name."""
    out = {}
    for d in DISTRIBUTIONS:
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _chain(e: BaseException) -> str:
    """An exception and the ones it was raised while handling, in the order they happened."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {str(e).strip()}")
        e = e.__context__
    return "; then ".join(reversed(parts))


# ----------------------------------------------------------------------------- torch-checkpointing

def _tc_manager(async_save: bool, direct_io: bool):
    from torch_checkpointing import (AsyncCheckpointSaverConfig, CheckpointManager, CheckpointWriterConfig,
                                     SyncCheckpointSaverConfig)
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    writer = CheckpointWriterConfig(file_write_max_threads=TC_WRITE_THREADS)
    save = (AsyncCheckpointSaverConfig if async_save else SyncCheckpointSaverConfig)(writer_config=writer)
    return CheckpointManager(CheckpointManager.Config(
        save=save, storage_config=LocalFileSystemStorageConfig(use_direct_io=direct_io)))


def probe_direct_io(parent: str) -> Optional[str]:
    """A tiny torch-checkpointing save with its default use_direct_io=True in parent (in a forked child):
    None if it worked, else the error (the whole chain)."""
    def probe():
        import logging
        logging.getLogger("torch_checkpointing").setLevel(logging.ERROR)
        p = os.path.join(parent, f".tc-direct-io-probe-{os.getpid()}")
        m = _tc_manager(False, True)
        try:
            m.save(p, {"model": {"w": torch.ones(1000, 3)}, "step": 1})
            return {"ok": True}
        except Exception as e:  # noqa: BLE001  (the finding itself)
            return {"ok": False, "why": _chain(e)}
        finally:
            m.close()
            remove(p)
            for n in os.listdir(parent):
                if n.startswith("tmp_.tc-direct-io-probe-"):
                    remove(os.path.join(parent, n))
    out = run_in_child(probe, 1, 300)
    if out.get("ok"):
        return None
    return out.get("why") or out.get("error", "?")


class TorchCheckpointingMethod(Method):
    """torch-checkpointing's CheckpointManager: sync save (+fsync), or async save until its write future is
    done (+fsync); the sync one has the load row (the files are the same)."""

    dir_output = True
    lazy_result = True  # use_mmap=True: torch.load(mmap=True) of every item file

    def __init__(self, async_save: bool, direct_io: bool):
        importlib.import_module("torch_checkpointing")
        self.async_save, self.direct_io = async_save, direct_io
        self.key = "tc_async" if async_save else "tc"
        io = "O_DIRECT" if direct_io else "buffered"
        self.label = (f"torch-checkpointing async ({io}, writer process)+fsync" if async_save
                      else f"torch-checkpointing sync ({io})+fsync")
        self.load_label = "torch-checkpointing load (mmap), pages touched"
        self.has_load = not async_save
        self.manager = None

    def warmup(self, workdir):
        import logging
        logging.getLogger("torch_checkpointing").setLevel(logging.ERROR)  # INFO lines per file otherwise
        self.manager = _tc_manager(self.async_save, self.direct_io)  # the async one spawns its writer process
        super().warmup(workdir)

    def prime(self, sd, workdir):
        if self.async_save:  # a trainer's steady state: the staging buffers of this state exist
            self.save_once(sd, workdir)

    def save(self, sd, path):
        t0 = time.perf_counter()
        fut = self.manager.save(path, sd)
        returned = time.perf_counter() - t0
        if fut is None:  # the sync saver: written when save returns
            fsync_tree(path)
            return None
        with self.manager.lock():  # what a trainer's optimizer.step() waits for: the state captured
            staged = time.perf_counter() - t0
        fut.result()
        fsync_tree(path)
        return {"blocking_s": staged, "returned_s": returned}

    def prepare_load(self, sd):
        return dict.fromkeys(sd)  # the items to read (model, optimizer, step): no templates, its loader allocates

    def load(self, path, prep):
        return dict(self.manager.load(path, into=prep))

    def close(self):
        if self.manager is not None:
            self.manager.close()  # joins the writer process
            self.manager = None

    def info(self):
        return {"use_direct_io": self.direct_io, "file_write_max_threads": TC_WRITE_THREADS,
                "saver": "async" if self.async_save else "sync"}


def torch_checkpointing_methods(parent: str, keys: List[str], skipped: Dict[str, str],
                                notes: List[str]) -> List[Method]:
    """The torch-checkpointing rows of keys ("tc", "tc_async"), or why not in skipped."""
    try:
        importlib.import_module("torch_checkpointing")
        version = importlib.metadata.version("torch_checkpointing")
    except Exception as e:  # noqa: BLE001
        for k in keys:
            skipped[k] = f"torch-checkpointing not importable ({type(e).__name__}: {e}); {TC_INSTALL}"
        return []
    why = probe_direct_io(parent)
    if why is not None:
        notes.append(f"torch-checkpointing {version}: its default LocalFileSystemStorageConfig(use_direct_io=True) "
                     f"fails here (a tiny save): {why}; its rows run with use_direct_io=False")
    notes.append("torch-checkpointing never fsyncs (no fsync in its storage or writer): its rows add fsync of every "
                 "file and directory, the checkpoint directory and its parent inside the timing (+fsync); the async "
                 "row's caller blocked is until the state was captured (manager.lock()), its CPU-s/GB includes the "
                 "writer process (CPU of every descendant process over the save)")
    return [TorchCheckpointingMethod(k == "tc_async", why is None) for k in keys]


# ----------------------------------------------------------------------------- dcp.async_save

class DcpAsyncMethod(Method):
    """dcp.async_save(FileSystemWriter(sync_files=True)) until the upload future is done, then fsync of the
    checkpoint directory and its parent; blocked: until async_save returned (and staging finished)."""

    key = "dcp_async"
    dir_output = True
    has_load = False  # the stock FileSystemWriter's files: see the DCP FileSystemReader row

    def __init__(self, executor: str, stager: bool):
        import torch.distributed.checkpoint as dcp  # noqa: F401

        self.executor, self.stager = executor, stager
        self.label = f"dcp.async_save {executor}" + (" + DefaultStager (cached)" if stager else "")
        self._stager = None

    def warmup(self, workdir):
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self.executor == "process" and not dist.is_initialized():  # its daemon joins the caller's group
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
        if self.stager:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Ignoring pin_memory flag ...": said in the report's notes
                self._stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                            use_async_staging=True, use_non_blocking_copy=False))
        super().warmup(workdir)

    def prime(self, sd, workdir):  # the daemon started, the stager's cache made: a trainer's later checkpoints
        self.save_once(sd, workdir)

    def save(self, sd, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if self.executor == "process" else AsyncCheckpointerType.THREAD
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            res = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                                 async_checkpointer_type=kind, async_stager=self._stager)
            returned = time.perf_counter() - t0
            staging = getattr(res, "staging_completion", None)
            if staging is not None:  # AsyncSaveResponse: the caller may touch the state once staged
                staging.result()
            staged = time.perf_counter() - t0
            getattr(res, "upload_completion", res).result()
        fsync_dir(path)
        fsync_dir(os.path.dirname(path))
        return {"blocking_s": staged, "returned_s": returned}

    def read_back(self, path, sd):
        import torch.distributed.checkpoint as dcp

        prep = map_tensors(sd, torch.zeros_like)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(prep, storage_reader=dcp.FileSystemReader(path))
        return prep

    def close(self):
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self.executor == "process":  # the daemon: terminated and joined (its CPU is then a reaped child's)
            ape = importlib.import_module("torch.distributed.checkpoint._async_process_executor")
            proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
            if proc is not None:
                proc.__del__()

    def info(self):
        return {"executor": self.executor, "stager": "DefaultStager(pinned, async staging), reused"
                if self.stager else "async_save's own (a fresh copy per save)", "sync_files": True}


def dcp_async_methods(skipped: Dict[str, str], notes: List[str]) -> List[Method]:
    try:
        importlib.import_module("torch.distributed.checkpoint.staging")
    except Exception as e:  # noqa: BLE001
        skipped["dcp_async"] = f"torch.distributed.checkpoint unavailable: {type(e).__name__}: {e}"
        return []
    if not torch.cuda.is_available():
        notes.append("dcp.async_save + DefaultStager: StagingOptions(use_pinned_memory=True) is ignored by this "
                     "CPU-only torch (StateDictStager: 'Ignoring pin_memory flag for checkpoint staging as pinning "
                     "memory requires CUDA'), use_non_blocking_copy needs an accelerator (off): the row is its cached "
                     "staging copy, made in a background thread")
    notes.append("dcp.async_save process: the checkpoint daemon process in a single-rank gloo group (it needs one); "
                 "its CPU is counted (every descendant process over the save); the DCP async rows' caller blocked "
                 "is until async_save returned and its staging finished")
    return [DcpAsyncMethod("thread", False), DcpAsyncMethod("process", False), DcpAsyncMethod("thread", True)]


# ----------------------------------------------------------------------------- safetensors readers

def _st_meta(path: str) -> Dict[str, str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:  # the header's metadata: the nesting
        return f.metadata()


def _load_fastckpt_st(path, prep):
    from fastckpt.safetensors import load_file

    return st_unflatten(load_file(path, device="cpu"), _st_meta(path))


def _load_fastsafetensors(path, prep):
    from fastsafetensors import fastsafe_open

    with fastsafe_open(path, framework="pt", device="cpu", nogds=True) as f:  # tensors outlive the context
        flat = {k: f.get_tensor(k) for k in f.keys()}
    return st_unflatten(flat, _st_meta(path))


def _load_runai(path, prep):
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as s:
        s.stream_file(path, device="cpu")  # owned=True: every tensor the caller's
        flat = dict(s.get_tensors())
    return st_unflatten(flat, _st_meta(path))


ST_READERS = (  # (key, label, module to import, load, how to install)
    ("st_fastckpt", "fastckpt.safetensors.load_file", "fastckpt.safetensors", _load_fastckpt_st, "make build"),
    ("fastsafetensors", "fastsafetensors fastsafe_open(nogds=True)", "fastsafetensors", _load_fastsafetensors,
     TC_INSTALL),
    ("runai", "runai-model-streamer SafetensorsStreamer", "runai_model_streamer", _load_runai, TC_INSTALL),
)


def safetensors_readers(skipped: Dict[str, str]) -> List[Tuple[str, str, Callable[[str, Any], Any]]]:
    """The load variants that read the safetensors row's file, for those importable (else why in skipped)."""
    out = []
    for key, label, mod, load, how in ST_READERS:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001
            skipped[key] = f"{mod} not importable ({type(e).__name__}: {e}); {how}"
            continue
        out.append((key, f"{label} (safetensors' file), pages touched", load))
    return out
