"""Hugging Face Accelerate checkpoints through fastckpt.

``use_fastckpt(accelerator)`` makes that accelerator's ``save_state`` /
``load_state`` write and read the heavy files through fastckpt, under the
names and in the formats Accelerate uses (so stock ``load_state`` reads what
it writes, and it reads what stock ``save_state`` wrote):

* model weights: ``model.safetensors`` through :mod:`fastckpt.safetensors`
  (``safe_serialization=True``, Accelerate's default) or
  ``pytorch_model.bin`` through :func:`fastckpt.save`;
* optimizers (``optimizer.bin``), schedulers (``scheduler.bin``) and objects
  registered with ``register_for_checkpointing`` (``custom_checkpoint_N.pkl``):
  :func:`fastckpt.save` / :func:`fastckpt.load`;
* the small files (RNG states ``random_states_N.pkl``, samplers, the
  GradScaler) are written and read by Accelerate's own
  ``save_accelerator_state`` / ``load_accelerator_state``, then made durable.

Every ``save_state`` is atomic per checkpoint directory: everything is written
into a temporary sibling directory, every file is fsync'd, the directory is
renamed into place and its parent fsync'd. A crash or an error leaves the
previous directory (or none) and never a half-written one; the error names the
checkpoint directory. With ``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=N)`` the oldest checkpoints are removed only *after* the new one is
committed (Accelerate removes them first).

Several processes (data parallel: ``torchrun`` / ``accelerate launch``, gloo
or NCCL): ``save_state`` and ``load_state`` are collective, as they are for
Accelerate's own distributed types. The main process makes the temporary
directory and writes the shared state (weights, optimizers, schedulers,
samplers, GradScaler, registered objects); every process writes its own RNG
states (``random_states_<process index>.pkl``, as Accelerate does) into the
same directory and fsyncs them; after a barrier the main process fsyncs the
rest, renames the directory into place (one rename), fsyncs the parent and
rotates old checkpoints; a last barrier. A failure on any process fails the
save on every process (its own error there, a RuntimeError naming it
elsewhere), the temporary directory is removed and no directory appears
under the final name; the waits are bounded by the process group's timeout
(``InitProcessGroupKwargs(timeout=...)``), and on gloo a process that died is
noticed at once. ``load_state`` reads on every process (the main process picks the
automatically named checkpoint for all) and fails on every process if it
fails on one. The checkpoint directory must be on a filesystem that every
process sees (a process that does not see the main process's temporary
directory fails the save, saying so); with ``save_on_each_node`` the main
process alone writes the shared files there. Stock Accelerate has every
process write the GradScaler and stateful-dataloader files under one name
(the last writer wins); here the main process writes them.

Scope: no process, or data-parallel processes, whose models are not sharded
by FSDP, DeepSpeed, Megatron-LM or XLA. With those, ``use_fastckpt`` leaves
``save_state`` / ``load_state`` as they are and logs a warning saying why:
their models and optimizers are written by their own engines (DeepSpeed's
checkpoint engine, torch.distributed.checkpoint inside Accelerate's FSDP
helpers, Megatron's or XLA's savers) into layouts of their own, which this
module does not write (see docs/INTEGRATIONS.md).

Nothing is patched globally: the accelerator instance gets its own
``save_state`` / ``load_state`` (``accelerator.save_state.__wrapped__`` is the
original); :func:`restore` takes them away.

Requires ``accelerate`` (``pip install "fastckpt-io[accelerate]"``).
"""
from collections.abc import Mapping
import errno
import functools
import logging
import os
import pathlib
import re
import shutil
from typing import Any, List, Optional

from ._common import agree, atomic_directory, process_ranks, require

require("accelerate", "accelerate", "accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state  # noqa: E402
from accelerate.utils import (  # noqa: E402
    MODEL_NAME, OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_MODEL_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME, WEIGHTS_NAME,
    DistributedType)
from accelerate.utils.other import TORCH_SAFE_GLOBALS, clean_state_dict_for_safetensors  # noqa: E402

import torch  # noqa: E402

from .. import safetensors as _st  # noqa: E402
from .. import serialization as _ser  # noqa: E402
from ..manager.ranks import failure_types  # noqa: E402
from .._core.engine import fsync_dir  # noqa: E402

__all__ = ["use_fastckpt", "restore"]

log = logging.getLogger("fastckpt")

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


_WHY = {
    "DEEPSPEED": "DeepSpeed writes the model and optimizer with its own checkpoint engine, in its own layout (to route "
                 "those files through fastckpt: fastckpt.integrations.deepspeed.FastCheckpointEngine)",
    "FSDP": "FSDP's model and optimizer are written by Accelerate's save_fsdp_model / save_fsdp_optimizer "
            "(torch.distributed.checkpoint with its own FileSystemWriter for sharded state dicts)",
    "MEGATRON_LM": "Megatron-LM writes the model, optimizer and scheduler with its own checkpointing",
    "XLA": "XLA writes through xm.save",
}


def _unsupported(acc: Accelerator) -> Optional[str]:
    if acc.distributed_type in _SUPPORTED:
        return None
    kind = getattr(acc.distributed_type, "name", str(acc.distributed_type))
    return f"distributed type {kind}: " + _WHY.get(kind, "its models and optimizers are saved by their own engine")


def _numbered(name: str, i: int) -> str:
    return name if i == 0 else name.replace(".", f"_{i}.", 1)


def _checkpoint_number(folder: str) -> int:
    # the number Accelerate sorts its automatically named checkpoints by
    return list(map(int, re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)))[0]


def _save_state(acc: Accelerator, original, output_dir: Optional[str] = None, safe_serialization: bool = True,
                **save_model_func_kwargs) -> Any:
    why = _unsupported(acc)
    if why is not None:
        log.warning("fastckpt: accelerator.save_state is Accelerate's own here: %s", why)
        return original(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
    ranks = process_ranks(acc.num_processes)
    main = acc.is_main_process
    cfg = acc.project_configuration
    base = None
    if cfg.automatic_checkpoint_naming:
        base = os.path.join(acc.project_dir, "checkpoints")
        output_dir = os.path.join(base, f"checkpoint_{cfg.iteration}")
        err = None
        try:
            if main:
                os.makedirs(base, exist_ok=True)
                if os.path.exists(output_dir):  # Accelerate's own refusal
                    raise ValueError(f"Checkpoint directory {output_dir} ({cfg.iteration}) already exists. Please "
                                     "manually override `self.save_iteration` with what iteration to start with.")
        except failure_types() as e:  # noqa: BLE001
            if ranks is None:
                raise
            err = e
        if ranks is not None:
            agree(ranks, err, output_dir, "checking its name")
    elif output_dir is None:  # Accelerate's own type (its os.makedirs(None) raises TypeError)
        raise TypeError("accelerator.save_state: output_dir is None and automatic checkpoint naming is disabled "
                        "(give a directory, or ProjectConfiguration(automatic_checkpoint_naming=True))")
    given = pathlib.Path(output_dir)  # what Accelerate returns (a Path, unexpanded)
    output_dir = os.path.expanduser(os.fspath(output_dir))
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):  # Accelerate's os.makedirs error
        raise FileExistsError(errno.EEXIST, "accelerator.save_state: output_dir exists and is not a directory "
                              "(nothing was changed)", output_dir)

    def write(tmp: str) -> None:
        weights = [acc.get_state_dict(m, unwrap=False) for m in acc._models]
        for hook in acc._save_model_state_pre_hook.values():  # what Accelerate's save_state does, same arguments
            hook(acc._models, weights, tmp)
        if main:  # the shared state: the main process's
            for i, state in enumerate(weights):
                if safe_serialization:
                    _st.save_file(clean_state_dict_for_safetensors(state),
                                  os.path.join(tmp, _numbered(SAFE_WEIGHTS_NAME, i)), metadata={"format": "pt"})
                else:
                    _ser.save(state, os.path.join(tmp, _numbered(WEIGHTS_NAME, i)))
            for i, opt in enumerate(acc._optimizers):
                _ser.save(opt.state_dict(), os.path.join(tmp, _numbered(f"{OPTIMIZER_NAME}.bin", i)))
            for i, sched in enumerate(acc._schedulers):
                _ser.save(sched.state_dict(), os.path.join(tmp, _numbered(f"{SCHEDULER_NAME}.bin", i)))
            for i, obj in enumerate(acc._custom_objects):
                _ser.save(obj.state_dict(), os.path.join(tmp, f"custom_checkpoint_{i}.pkl"))
        # Accelerate's own code for the small files: samplers, GradScaler (main process only: one writer per name)
        # and this process's RNG states (every process); made durable by the commit
        save_accelerator_state(tmp, [], [], [], acc._dataloaders if main else [], acc.state.process_index, acc.step,
                               acc.scaler if main else None, save_on_each_node=False,
                               safe_serialization=safe_serialization)

    def rotate() -> None:  # once the new checkpoint is committed (Accelerate removes old ones first)
        if base is None or cfg.total_limit is None:
            return
        folders = sorted((os.path.join(base, f) for f in os.listdir(base) if not f.startswith(".")),
                         key=_checkpoint_number)
        doomed = folders[:max(0, len(folders) - cfg.total_limit)]
        for folder in doomed:
            shutil.rmtree(folder)
        if doomed:
            fsync_dir(base)

    atomic_directory(output_dir, write, ranks=ranks, own=[f"{RNG_STATE_NAME}_{acc.state.process_index}.pkl"],
                     after_commit=rotate)
    log.info("fastckpt: accelerator state saved to %s", output_dir)
    cfg.iteration += 1
    return given


def _load(path: str, map_location: Any = None, **load_kwargs) -> Any:
    """fastckpt.load as accelerate.utils.load: weights-only by default, numpy's RNG types allowed."""
    load_kwargs.setdefault("weights_only", True)
    with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
        return _ser.load(path, map_location=map_location, **load_kwargs)


def _find_input_dir(acc: Accelerator, input_dir: Optional[str]) -> str:
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return input_dir
    if acc.project_configuration.automatic_checkpoint_naming:
        base = os.path.join(acc.project_dir, "checkpoints")
        folders = [os.path.join(base, f) for f in os.listdir(base) if not f.startswith(".")]  # no temporaries
        if not folders:
            raise FileNotFoundError(f"no checkpoint in {base}")
        return sorted(folders, key=_checkpoint_number)[-1]
    raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")


def _check_map_location(map_location: Any) -> None:
    """Accelerate's check of ``load_state(map_location=...)``, with its exception type (TypeError) and
    meaning: None (the CPU), "cpu" or "on_device" (the accelerator's device)."""
    if map_location not in (None, "cpu", "on_device"):
        raise TypeError(f"fastckpt: unsupported optimizer map location {map_location!r} passed to load_state; "
                        "choose one of None, 'cpu' or 'on_device' (as Accelerate's own load_state)")


def _load_state(acc: Accelerator, original, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
                **load_model_func_kwargs) -> None:
    why = _unsupported(acc)
    if why is not None:
        log.warning("fastckpt: accelerator.load_state is Accelerate's own here: %s", why)
        return original(input_dir, load_kwargs, **load_model_func_kwargs)
    _check_map_location(load_model_func_kwargs.get("map_location"))  # on every rank, before any collective
    if load_kwargs is not None and not isinstance(load_kwargs, Mapping):  # Accelerate passes it as **load_kwargs
        raise TypeError(f"load_state: load_kwargs must be a mapping, not {type(load_kwargs).__name__}")
    ranks = process_ranks(acc.num_processes)
    if ranks is None:
        return _load_here(acc, _find_input_dir(acc, input_dir), load_kwargs, load_model_func_kwargs)
    # several processes: the main process picks the directory (the newest, with automatic naming) for all
    shown = os.fspath(input_dir) if input_dir is not None else os.path.join(acc.project_dir, "checkpoints")
    err, found = None, None
    if acc.is_main_process:
        try:
            found = _find_input_dir(acc, input_dir)
        except failure_types() as e:  # noqa: BLE001
            err = e
    found = agree(ranks, err, shown, "finding it", found, action="load")
    err = None
    try:
        _load_here(acc, found, load_kwargs, load_model_func_kwargs)
    except failure_types() as e:  # noqa: BLE001
        err = e
    agree(ranks, err, found, "reading its files", action="load")


def _load_here(acc: Accelerator, input_dir: str, load_kwargs: Optional[dict], load_model_func_kwargs: dict) -> None:
    """What ``load_state`` reads in this process from ``input_dir``."""
    log.info("fastckpt: loading accelerator state from %s", input_dir)
    load_kwargs = dict(load_kwargs or {})
    load_model_func_kwargs = dict(load_model_func_kwargs)
    models: List[torch.nn.Module] = list(acc._models)
    for hook in acc._load_model_state_pre_hook.values():
        hook(models, input_dir)
    map_location = load_model_func_kwargs.pop("map_location", None)
    if map_location is None:  # Accelerate's default: the device with several processes on devices, else the CPU
        multi = acc.num_processes > 1 and getattr(acc, "multi_device", False)
        map_location = "on_device" if multi and acc.distributed_type != DistributedType.MULTI_XPU else "cpu"
    if map_location == "on_device":
        map_location = acc.device
    for i, model in enumerate(models):
        st = os.path.join(input_dir, f"{SAFE_MODEL_NAME}{'_%d' % i if i else ''}.safetensors")
        if os.path.exists(st):
            _st.load_model(model, st, device=str(map_location), **load_model_func_kwargs)
        else:
            state = _load(os.path.join(input_dir, f"{MODEL_NAME}{'_%d' % i if i else ''}.bin"), map_location)
            model.load_state_dict(state, **load_model_func_kwargs)
    for i, opt in enumerate(acc._optimizers):
        opt.load_state_dict(_load(os.path.join(input_dir, _numbered(f"{OPTIMIZER_NAME}.bin", i)), map_location,
                                  **load_kwargs))
    for i, sched in enumerate(acc._schedulers):
        sched.load_state_dict(_load(os.path.join(input_dir, _numbered(f"{SCHEDULER_NAME}.bin", i)), **load_kwargs))
    override = load_accelerator_state(input_dir, [], [], [], acc._dataloaders, acc.state.process_index, acc.scaler,
                                      None, load_kwargs)
    if "step" in override:
        acc.step = override["step"]
    custom = [f for f in os.listdir(input_dir) if re.search(r"^custom_checkpoint_\d+\.pkl$", f)]
    if len(custom) != len(acc._custom_objects):
        raise RuntimeError(f"Number of custom checkpoints in folder {input_dir} does not match the number of "
                           f"registered objects: found {len(custom)}, registered {len(acc._custom_objects)}")
    for i, obj in enumerate(acc._custom_objects):
        obj.load_state_dict(_ser.load(os.path.join(input_dir, f"custom_checkpoint_{i}.pkl"), map_location="cpu",
                                      weights_only=False))  # as Accelerate's load_custom_state


def use_fastckpt(accelerator: Accelerator) -> Accelerator:
    """Make ``accelerator.save_state`` / ``load_state`` go through fastckpt
    (see the module's documentation); returns the accelerator. Calling it
    again is harmless."""
    if getattr(accelerator.save_state, "_fastckpt", False):
        return accelerator
    why = _unsupported(accelerator)
    if why is not None:
        log.warning("fastckpt: use_fastckpt leaves save_state/load_state as Accelerate's own: %s", why)
    def bind(impl, original):
        @functools.wraps(original)  # keeps the signature and documentation; __wrapped__ is the original
        def wrapper(*args, **kwargs):
            return impl(accelerator, original, *args, **kwargs)
        wrapper._fastckpt = True
        return wrapper

    accelerator.save_state = bind(_save_state, accelerator.save_state)
    accelerator.load_state = bind(_load_state, accelerator.load_state)
    return accelerator


def restore(accelerator: Accelerator) -> Accelerator:
    """Undo :func:`use_fastckpt` on this accelerator."""
    for name in ("save_state", "load_state"):
        if getattr(getattr(accelerator, name), "_fastckpt", False):
            delattr(accelerator, name)  # the class's method shows through again
    return accelerator
