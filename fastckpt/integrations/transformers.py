"""Hugging Face Transformers ``Trainer`` checkpoints through fastckpt.

``class MyTrainer(FastTrainerMixin, Trainer)`` (or :class:`FastTrainer`, that
class ready-made) makes every ``checkpoint-N`` directory the Trainer writes
atomic and durable: the Trainer's own ``_save_checkpoint`` writes it into a
temporary directory beside ``output_dir/checkpoint-N`` (named like the
checkpoint manager's temporaries), every file is fsync'd, the directory is
renamed into place and ``output_dir`` fsync'd; only then are old checkpoints
rotated out (``save_total_limit``). A crash or an error leaves the previous
checkpoints and never a half-written ``checkpoint-N`` (which
``resume_from_checkpoint=True`` would otherwise pick up); the error names
``checkpoint-N``. The stock Trainer writes into ``checkpoint-N`` directly,
without fsync.

Inside, the model weights (``model.safetensors``, and the shards of a large
model) go through :func:`fastckpt.safetensors.save_file`, the optimizer
(``optimizer.pt``) and scheduler (``scheduler.pt``) through
:func:`fastckpt.save`; the rest (config, ``trainer_state.json``,
``rng_state.pth``, ``training_args.bin``, the tokenizer) is the Trainer's own,
made durable by the commit. The files are the formats the Trainer reads:
``resume_from_checkpoint`` works unchanged, with this mixin or without it.

Several processes (data parallel, DDP: ``torchrun`` / ``accelerate launch``):
the save is collective, as the Trainer's is. The main process makes the
temporary directory; the Trainer's own code writes, in every process, into
``checkpoint-N`` inside it: the main process the shared state (weights,
optimizer, scheduler, scaler, trainer state, training args), every process its
own ``rng_state_<process index>.pth`` (fsync'd by that process); after a
barrier the main process fsyncs the rest and renames the directory into place
(one rename), fsyncs ``output_dir`` and rotates; a last barrier. A failure on
any process fails the checkpoint on every process (its own error there, a
RuntimeError naming it elsewhere; ``train()`` raises on every process), the
temporary directory is removed and no ``checkpoint-N`` appears; the waits are
bounded by the process group's timeout (``ddp_timeout``), and on gloo a
process that died is noticed at once. ``output_dir`` must be on a filesystem that every
process sees; with ``save_on_each_node`` the main process alone writes the
shared files there (the Trainer would have every node's first process write
them under the same names). ``resume_from_checkpoint`` is the Trainer's own in
every process.

Scope: no DeepSpeed/FSDP/XLA/SageMaker model parallelism (their checkpoint
files are written by their own engines); there the stock ``_save_checkpoint``
runs and a warning says why. Routing
the weights: transformers' ``modeling_utils.safe_save_file`` (``save_pretrained``'s
writer) and ``safetensors.torch.save_file`` (what the Trainer calls for a model
that is not a ``PreTrainedModel``) are each replaced once by a dispatcher that
calls fastckpt only inside a ``FastTrainerMixin`` save on the same thread
(everything else, in this process too, gets the original function).

Requires ``transformers`` (``pip install "fastckpt-io[transformers]"``).
"""
import contextlib
import functools
import logging
import os
import threading
from typing import Any, Optional

from ._common import atomic_directory, process_ranks, require

require("transformers", "transformers", "transformers")
import transformers.modeling_utils as _mu  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints  # noqa: E402

from .. import safetensors as _st  # noqa: E402
from .. import serialization as _ser  # noqa: E402

__all__ = ["FastTrainerMixin", "FastTrainer"]

log = logging.getLogger("fastckpt")

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
TRAINER_STATE_NAME = "trainer_state.json"

_tls = threading.local()
_install_lock = threading.Lock()


def _dispatcher(original):
    """A stand-in for a safetensors ``save_file`` that calls fastckpt's only inside a
    ``FastTrainerMixin`` save on this thread, and ``original`` everywhere else."""
    @functools.wraps(original)  # the same name, docstring and signature
    def save_file(tensors, filename, metadata=None):
        if getattr(_tls, "active", False):
            return _st.save_file(tensors, filename, metadata=metadata)
        return original(tensors, filename, metadata=metadata)
    save_file.original = original
    save_file._fastckpt = True
    return save_file


def _install_dispatcher() -> None:
    """Installs the dispatcher (once) where the Trainer's weights are written: transformers'
    ``modeling_utils.safe_save_file`` (``save_pretrained``: PreTrainedModel weights and their
    shards) and ``safetensors.torch.save_file`` (which ``Trainer._save`` calls for a model that is
    not a PreTrainedModel)."""
    import safetensors.torch as _stock
    with _install_lock:
        for mod, name in ((_mu, "safe_save_file"), (_stock, "save_file")):
            if not getattr(getattr(mod, name), "_fastckpt", False):
                setattr(mod, name, _dispatcher(getattr(mod, name)))


@contextlib.contextmanager
def _fast_weights():
    _install_dispatcher()
    before = getattr(_tls, "active", False)
    _tls.active = True
    try:
        yield
    finally:
        _tls.active = before


class FastTrainerMixin:
    """Mix into a ``transformers.Trainer`` (first in the bases) to write its
    checkpoints through fastckpt, atomically and durably (see the module)."""

    _fastckpt_staging: Optional[str] = None

    def _fastckpt_unsupported(self) -> Optional[str]:
        for flag in ("is_deepspeed_enabled", "is_fsdp_enabled", "is_fsdp_xla_v1_enabled"):
            if getattr(self, flag, False):
                return flag
        from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
        if is_torch_xla_available():
            return "torch_xla"
        if is_sagemaker_mp_enabled():
            return "sagemaker model parallel"
        return None

    def _get_output_dir(self, trial: Any) -> str:
        if self._fastckpt_staging is not None:
            return self._fastckpt_staging  # the Trainer writes checkpoint-N inside the temporary directory
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        why = self._fastckpt_unsupported()
        if why is not None:
            log.warning("fastckpt: Trainer checkpoint written by transformers itself here (%s)", why)
            return super()._save_checkpoint(model, trial)
        args = self.args
        ranks = process_ranks(args.world_size)
        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)

        def write(tmp: str) -> None:
            self._fastckpt_staging = tmp
            # pushed below, from the final directory; the main process alone writes the shared files into the one
            # directory (with save_on_each_node, the Trainer has the first process of every node write them)
            push, each_node = args.push_to_hub, args.save_on_each_node
            args.push_to_hub = args.save_on_each_node = False
            try:
                with _fast_weights():
                    super(FastTrainerMixin, self)._save_checkpoint(model, trial)
                # The Trainer looked for the best checkpoint in the temporary directory: look where it will be.
                best = self.state.best_global_step
                if best:
                    best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
                    if best == self.state.global_step or os.path.exists(best_dir):
                        self.state.best_model_checkpoint = best_dir
                        if args.should_save:
                            self.state.save_to_json(os.path.join(tmp, name, TRAINER_STATE_NAME))
            finally:
                self._fastckpt_staging = None
                args.push_to_hub, args.save_on_each_node = push, each_node

        def rotate() -> None:  # the main process, once checkpoint-N is committed
            rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

        own = [f"rng_state_{args.process_index}.pth"] if ranks is not None else []
        atomic_directory(final, write, inner=name, ranks=ranks, own=own, after_commit=rotate)
        if args.push_to_hub:
            self._push_from_checkpoint(final)  # the Trainer's: the main process pushes

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._fastckpt_staging is None or self._fastckpt_unsupported() is not None:
            return super()._save_optimizer_and_scheduler(output_dir)
        if not self.args.should_save:  # as the Trainer: the main process writes them
            return None
        _ser.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))
        if self.lr_scheduler is not None:
            _ser.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None


class FastTrainer(FastTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`FastTrainerMixin`."""
