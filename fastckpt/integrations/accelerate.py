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

Scope: a single process whose models are not sharded by FSDP, DeepSpeed,
Megatron-LM or XLA. Elsewhere ``use_fastckpt`` leaves ``save_state`` /
``load_state`` as they are and logs a warning saying why (those paths write
with their own engines; see docs/INTEGRATIONS.md).

Nothing is patched globally: the accelerator instance gets its own
``save_state`` / ``load_state`` (``accelerator.save_state.__wrapped__`` is the
original); :func:`restore` takes them away.

Requires ``accelerate`` (``pip install "fastckpt-io[accelerate]"``).
"""
import functools
import logging
import os
import re
import shutil
from typing import Any, List, Optional

from ._common import atomic_directory, require

require("accelerate", "accelerate", "accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state  # noqa: E402
from accelerate.utils import (  # noqa: E402
    MODEL_NAME, OPTIMIZER_NAME, SAFE_MODEL_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME, WEIGHTS_NAME, DistributedType)
from accelerate.utils.other import TORCH_SAFE_GLOBALS, clean_state_dict_for_safetensors  # noqa: E402

import torch  # noqa: E402

from .. import safetensors as _st  # noqa: E402
from .. import serialization as _ser  # noqa: E402
from ..engine import fsync_dir  # noqa: E402

__all__ = ["use_fastckpt", "restore"]

log = logging.getLogger("fastckpt")

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def _unsupported(acc: Accelerator) -> Optional[str]:
    if acc.num_processes != 1:
        return f"{acc.num_processes} processes (fastckpt's Accelerate integration handles one process)"
    if acc.distributed_type not in _SUPPORTED:
        return f"distributed type {acc.distributed_type} (its models and optimizers are saved by their own engine)"
    return None


def _numbered(name: str, i: int) -> str:
    return name if i == 0 else name.replace(".", f"_{i}.", 1)


def _checkpoint_number(folder: str) -> int:
    # the number Accelerate sorts its automatically named checkpoints by
    return list(map(int, re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)))[0]


def _save_state(acc: Accelerator, original, output_dir: Optional[str] = None, safe_serialization: bool = True,
                **save_model_func_kwargs) -> str:
    why = _unsupported(acc)
    if why is not None:
        log.warning("fastckpt: accelerator.save_state is Accelerate's own here: %s", why)
        return original(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
    cfg = acc.project_configuration
    base = None
    if cfg.automatic_checkpoint_naming:
        base = os.path.join(acc.project_dir, "checkpoints")
        os.makedirs(base, exist_ok=True)
        output_dir = os.path.join(base, f"checkpoint_{cfg.iteration}")
        if os.path.exists(output_dir):  # Accelerate's own refusal
            raise ValueError(f"Checkpoint directory {output_dir} ({cfg.iteration}) already exists. Please manually "
                             "override `self.save_iteration` with what iteration to start with.")
    elif output_dir is None:
        raise ValueError("accelerator.save_state: no output_dir given and automatic checkpoint naming is disabled")
    output_dir = os.path.expanduser(os.fspath(output_dir))

    def write(tmp: str) -> None:
        weights = [acc.get_state_dict(m, unwrap=False) for m in acc._models]
        for hook in acc._save_model_state_pre_hook.values():  # what Accelerate's save_state does, same arguments
            hook(acc._models, weights, tmp)
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
        # samplers, GradScaler, RNG states: Accelerate's own code (small files), made durable by the commit
        save_accelerator_state(tmp, [], [], [], acc._dataloaders, acc.state.process_index, acc.step, acc.scaler,
                               save_on_each_node=cfg.save_on_each_node, safe_serialization=safe_serialization)
        for i, obj in enumerate(acc._custom_objects):
            _ser.save(obj.state_dict(), os.path.join(tmp, f"custom_checkpoint_{i}.pkl"))

    atomic_directory(output_dir, write)
    log.info("fastckpt: accelerator state saved to %s", output_dir)
    if base is not None and cfg.total_limit is not None:  # rotation, once the new checkpoint is committed
        folders = sorted((os.path.join(base, f) for f in os.listdir(base) if not f.startswith(".")),
                         key=_checkpoint_number)
        doomed = folders[:max(0, len(folders) - cfg.total_limit)]
        for folder in doomed:
            shutil.rmtree(folder)
        if doomed:
            fsync_dir(base)
    cfg.iteration += 1
    return output_dir


def _load(path: str, map_location: Any = None, **load_kwargs) -> Any:
    """fastckpt.load as accelerate.utils.load: weights-only by default, numpy's RNG types allowed."""
    load_kwargs.setdefault("weights_only", True)
    with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
        return _ser.load(path, map_location=map_location, **load_kwargs)


def _load_state(acc: Accelerator, original, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
                **load_model_func_kwargs) -> None:
    why = _unsupported(acc)
    if why is not None:
        log.warning("fastckpt: accelerator.load_state is Accelerate's own here: %s", why)
        return original(input_dir, load_kwargs, **load_model_func_kwargs)
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
    elif acc.project_configuration.automatic_checkpoint_naming:
        base = os.path.join(acc.project_dir, "checkpoints")
        folders = [os.path.join(base, f) for f in os.listdir(base) if not f.startswith(".")]  # no temporaries
        if not folders:
            raise FileNotFoundError(f"no checkpoint in {base}")
        input_dir = sorted(folders, key=_checkpoint_number)[-1]
    else:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    log.info("fastckpt: loading accelerator state from %s", input_dir)
    load_kwargs = dict(load_kwargs or {})
    models: List[torch.nn.Module] = list(acc._models)
    for hook in acc._load_model_state_pre_hook.values():
        hook(models, input_dir)
    map_location = load_model_func_kwargs.pop("map_location", None) or "cpu"
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
