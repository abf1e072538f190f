"""The checkpointing methods the stall benchmark (benchmarks/bench_training.py) drives, one class each,
and the CPU accounting of their background work.

A :class:`Mode` starts a checkpoint with :meth:`Mode.checkpoint` (the call on the training thread;
returns a :class:`Ckpt` whose staged and durable times are filled in as they happen, from the
futures' callbacks) and waits for one with :meth:`Mode.wait`; ``guard`` is what must wrap
``optimizer.step()`` (torch_checkpointing's ``mgr.lock()``).
"""

import contextlib
import os
import shutil
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Dict, Optional

import torch

import fastckpt
from benchmarks.harness import fsync_dir, fsync_path
from benchmarks.workload import map_tensors

perf = time.perf_counter


# ------------------------------------------------------------------------------------------ CPU accounting

class CpuMeter:
    """The CPU seconds of every thread of this process but the training threads, and of child processes."""

    def __init__(self, training: set):
        import psutil
        self.proc = psutil.Process()
        self.training = training

    @staticmethod
    def threads_now() -> set:
        """This process's threads now: after the first training step and before any checkpoint, the
        training threads (the main thread and torch's intra-op pool)."""
        import psutil
        return {t.id for t in psutil.Process().threads()}

    def _train_cpu(self) -> float:
        return sum(t.user_time + t.system_time for t in self.proc.threads() if t.id in self.training)

    def _children_cpu(self) -> float:
        import psutil
        live = 0.0
        for c in self.proc.children(recursive=True):
            try:
                ct = c.cpu_times()
                live += ct.user + ct.system
            except psutil.Error:
                pass
        import resource
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return live + ru.ru_utime + ru.ru_stime

    def read(self) -> float:
        ct = self.proc.cpu_times()
        return ct.user + ct.system - self._train_cpu() + self._children_cpu()


# ------------------------------------------------------------------------------------------ the modes

class Ckpt:
    """One checkpoint's times (perf_counter seconds) on the training thread's clock."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.call_end = t0
        self.staged: Optional[float] = None
        self.durable: Optional[float] = None
        self.waited = 0.0           # lock waits and the wait before the next checkpoint
        self.done = threading.Event()
        self.future: Any = None

    def mark_durable(self, *_: Any) -> None:
        if self.durable is None:
            self.durable = perf()
        self.done.set()

    def mark_staged(self, *_: Any) -> None:
        if self.staged is None:
            self.staged = perf()


class Mode:
    """A checkpointing method: `checkpoint` starts one (returns its Ckpt), `wait` waits until it is done."""
    guard: Optional[Callable[[], Any]] = None   # what wraps optimizer.step()
    durable_note = ""                            # what "durable" means, where not on disk
    staged_later = False                         # staged after the call returns (a staging future)

    def __init__(self, work: str):
        self.work = work

    def checkpoint(self, i: int, state: Dict[str, Any]) -> Ckpt:
        c = Ckpt(perf())
        self.call(i, state, c)
        c.call_end = perf()
        if c.future is None:  # synchronous: staged and durable on return
            c.staged = c.call_end
            c.mark_durable()
        elif c.staged is None and not self.staged_later:
            c.staged = c.call_end
        return c

    def call(self, i: int, state: Dict[str, Any], c: Ckpt) -> None:
        raise NotImplementedError

    def wait(self, c: Ckpt) -> None:
        if c.future is not None:
            c.future.result()
        c.done.wait()

    def read(self, i: int, like: Dict[str, Any]) -> Any:
        """The state checkpoint `i` holds, read back with the method's own loader (`like`: the state
        saved, for loaders that fill a state of that structure)."""
        return fastckpt.load(os.path.join(self.work, "ckpt.pt"))

    def close(self) -> None:
        pass


class TorchSave(Mode):
    def call(self, i, state, c):
        path = os.path.join(self.work, "ckpt.pt")
        torch.save(state, path)
        fsync_path(path)
        fsync_dir(self.work)

    def read(self, i, like):
        return torch.load(os.path.join(self.work, "ckpt.pt"), weights_only=True)


class FastSave(Mode):
    def call(self, i, state, c):
        fastckpt.save(state, os.path.join(self.work, "ckpt.pt"))


class FastAsync(Mode):
    def call(self, i, state, c):
        c.future = fastckpt.async_save(state, os.path.join(self.work, "ckpt.pt"))
        c.future.add_done_callback(c.mark_durable)

    def close(self):
        fastckpt.wait_for_saves()
        from fastckpt.saver import default_saver
        default_saver().close()  # its staging arena freed; the next mode's saves get a new saver


class FastAsyncBackground(FastAsync):
    """fastckpt.async_save(..., background_staging=True): the call returns after pickling; a staging
    thread copies the state while the loop's next forward and backward run, or (the knob
    async_write_through, by default chosen per save from the last one) the writer sends the
    page-aligned tensors straight from their memory until the fence; the fence
    (fastckpt.wait_staged, which optimizer.step() also waits on by itself) is the guard of
    optimizer.step(), so its wait counts as blocked time; staged = when the copies were complete."""
    staged_later = True
    write_through: Optional[int] = None  # the knob's value for this mode (None: its default)
    caller_copy: Optional[int] = None    # the knob async_caller_copy for this mode (None: its default)

    @staticmethod
    def guard():
        fastckpt.wait_staged()
        return contextlib.nullcontext()

    def call(self, i, state, c):
        knob = {} if self.write_through is None else {"async_write_through": self.write_through}
        if self.caller_copy is not None:
            knob["async_caller_copy"] = self.caller_copy
        with fastckpt.knobs.override(**knob):
            c.future = fastckpt.async_save(state, os.path.join(self.work, "ckpt.pt"), background_staging=True)

        def done(fut):
            if fut.exception() is None:
                c.staged = c.t0 + fut.result().staged_seconds
            c.mark_durable()
        c.future.add_done_callback(done)


class FastAsyncBackgroundCopy(FastAsyncBackground):
    """As FastAsyncBackground, with the knob async_write_through=0: every large tensor copied by the
    staging thread."""
    write_through = 0


class FastAsyncBackgroundSplit(FastAsyncBackground):
    """As FastAsyncBackgroundCopy, with the knob async_caller_copy (bench_training.py --caller-copy,
    whose default this is): the call copies that percent of the large tensors' bytes before it
    returns, the staging thread the rest beside the loop's next forward and backward."""
    write_through = 0
    caller_copy = 40


class FastAsyncBackgroundThrough(FastAsyncBackground):
    """As FastAsyncBackground, with the knob async_write_through=1: the page-aligned tensors are written
    straight from their memory while the loop's forward and backward run, and the fence (the next
    optimizer step) copies only what is not written by then."""
    write_through = 1


class MemorySnapshot(Mode):
    durable_note = "committed in host memory"

    def __init__(self, work):
        super().__init__(work)
        self.mem = tempfile.mkdtemp(prefix="fastckpt-bench-stall-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                    else None)
        try:
            self.mgr = fastckpt.CheckpointManager(os.path.join(work, "mgr"), keep_last=1,
                                                  memory=fastckpt.MemoryTier(keep=2, replicas=0, directory=self.mem))
        except BaseException:
            shutil.rmtree(self.mem, ignore_errors=True)
            raise
        self.last_step: Optional[int] = None
        self.persist_s: Optional[float] = None

    def call(self, i, state, c):
        self.mgr.snapshot(i, state)
        self.last_step = i
        c.future = None
        tier = self.mgr._memory  # the bound tier: its background commit is what "durable" waits for here
        c.staged = perf()

        def watch():
            tier.wait()
            c.mark_durable()
        threading.Thread(target=watch, name="bench-memory-watch", daemon=True).start()

    def checkpoint(self, i, state):
        c = Ckpt(perf())
        self.call(i, state, c)
        c.call_end = c.staged
        return c

    def read(self, i, like):
        got = self.mgr.load_latest()  # from the memory tier: its newest committed snapshot
        if got is None or got.step != i:
            raise RuntimeError(f"the memory tier restored step {got and got.step}, not the snapshot of step {i}")
        return got.state

    def persist(self, state) -> None:
        """Once per run, after the timed loop: the newest snapshot written to disk from memory."""
        t0 = perf()
        self.mgr.save(self.last_step, state)
        self.persist_s = perf() - t0

    def close(self):
        try:
            self.mgr.close()
        finally:
            shutil.rmtree(self.mem, ignore_errors=True)


class DcpAsync(Mode):
    def __init__(self, work):
        super().__init__(work)
        import torch.distributed.checkpoint as dcp
        self.dcp = dcp
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def call(self, i, state, c):
        w = self.dcp.FileSystemWriter(os.path.join(self.work, f"dcp_{i:08d}"), sync_files=True)
        got = self.dcp.async_save(state, storage_writer=w, no_dist=True)
        if hasattr(got, "staging_completion"):  # AsyncSaveResponse: staging may end after the return
            self.staged_later = True
            got.staging_completion.add_done_callback(c.mark_staged)
            got = got.upload_completion
        c.future = got
        got.add_done_callback(c.mark_durable)

    def read(self, i, like):
        into = map_tensors(like, torch.zeros_like)  # filled in place by dcp.load: zeros until then
        self.dcp.load(into, storage_reader=self.dcp.FileSystemReader(os.path.join(self.work, f"dcp_{i:08d}")),
                      no_dist=True)
        return into


class TorchCheckpointing(Mode):
    durable_note = "written, not fsynced"
    staged_later = True

    def __init__(self, work):
        super().__init__(work)
        from torch_checkpointing import CheckpointManager as TcManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        cfg = TcManager.Config.with_async_save()
        # its default use_direct_io=True writes unaligned tails with O_DIRECT: EINVAL on ext4
        cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
        self.mgr = TcManager(cfg)
        self.guard = self.mgr.lock

    def call(self, i, state, c):
        c.future = self.mgr.save(os.path.join(self.work, f"tc_{i:08d}"), state)
        self.mgr._staging_future.add_done_callback(c.mark_staged)  # its staging future (save returns the write's)
        c.future.add_done_callback(c.mark_durable)

    def read(self, i, like):
        into = map_tensors(like, torch.zeros_like)  # its load fills the items of `into`: zeros until then
        got = self.mgr.load(os.path.join(self.work, f"tc_{i:08d}"), into=into)
        return {k: got[k] for k in like}

    def close(self):
        self.mgr.close()


MODE_CLASSES = {"torch.save": TorchSave, "fastckpt.save": FastSave, "fastckpt.async_save": FastAsync,
                "fastckpt.async_save(background)": FastAsyncBackground,
                "fastckpt.async_save(background-copy)": FastAsyncBackgroundCopy,
                "fastckpt.async_save(background-through)": FastAsyncBackgroundThrough,
                "fastckpt.async_save(background-split)": FastAsyncBackgroundSplit,
                "memory.snapshot": MemorySnapshot, "dcp.async_save": DcpAsync,
                "torch_checkpointing": TorchCheckpointing}
