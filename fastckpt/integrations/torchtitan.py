"""torchtitan checkpoints through fastckpt's DCP storage layer.

:class:`FastCheckpointManager` is torchtitan's ``CheckpointManager``
(``torchtitan.components.checkpointer``) with its two DCP calls routed through
:class:`fastckpt.FastWriter` / :class:`fastckpt.FastReader`: every ``step-N``
folder is written by fastckpt's engine (O_DIRECT where the filesystem allows
it, every file fdatasync'd, ``.metadata`` written last and the folder
fsync'd) and read back with each tensor record's CRC-32 checked. The folders
are ordinary DCP checkpoints: torchtitan's stock manager (and ``dcp.load``
with its ``FileSystemReader``) reads them, and this manager reads folders the
stock one wrote. Everything else (when to save, ``keep_latest_k`` purging,
which step to load, model-only last steps, ``exclude_from_loading``) is
torchtitan's own.

torchtitan's loader only considers ``step-N`` folders that hold a
``.metadata`` file, and FastWriter writes that file last, after every data
file is durable: a save that crashed leaves a folder without ``.metadata``,
which the next ``load()`` skips.

What stays torchtitan's own (logged at debug level): the Hugging Face
safetensors export of a last step (``last_save_in_hf``) and loads from
Hugging Face weights (``initial_load_in_hf``), which use DCP's
HuggingFaceStorageWriter/Reader; and ``async_mode="async_with_pinned_mem"``,
whose writes happen in a separate process that torchtitan sets up with the
stock writer.

Use it where torchtitan's trainer builds its checkpointer, e.g. in a job
config: ``checkpoint=FastCheckpointManager.Config(enable=True, folder=...)``,
or directly as ``FastCheckpointManager(config, dataloader=..., model_parts=...,
optimizers=..., lr_schedulers=..., states=..., sd_adapter=...)``.

Requires ``torchtitan`` (``pip install "fastckpt-io[torchtitan]"``; tested with
torchtitan 0.3.0, see docs/INTEGRATIONS.md for how it is installed beside torch 2.13).
"""
import logging
from dataclasses import dataclass
from typing import Any, Optional

from ._common import require

require("torchtitan", "torchtitan", "torchtitan")
from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402
from torchtitan.components.checkpointer.base import MODEL  # noqa: E402
from torchtitan.components.checkpointer.dcp import AsyncMode  # noqa: E402

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from ..dcp import FastReader, FastWriter  # noqa: E402

__all__ = ["FastCheckpointManager"]

log = logging.getLogger("fastckpt")


class FastCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` writing and reading its DCP folders
    through fastckpt (see the module's documentation)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint configuration, unchanged; it builds a
        :class:`FastCheckpointManager` (torchtitan builds the class that
        declares the ``Config``)."""

    @torch.no_grad()
    def dcp_save(self, state_dict: dict, checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Optional[Any]:
        if to_hf or async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            log.debug("fastckpt: torchtitan writes %s itself (%s)", checkpoint_id,
                      "Hugging Face export" if to_hf else "async_with_pinned_mem")
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = FastWriter(checkpoint_id)
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                 process_group=self.pg)
        else:
            ret = dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            from torchtitan.tools.utils import GarbageCollection
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(self, state_dict: dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            log.debug("fastckpt: torchtitan reads the Hugging Face weights in %s itself", checkpoint_id)
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        # weights-only unpickling of the non-tensor values (torchtitan's train state: ints; its dataloader
        # state: bytes), where the stock FileSystemReader hands them to torch.load(weights_only=False)
        dcp.load(state_dict, storage_reader=FastReader(checkpoint_id), checkpoint_id=checkpoint_id)
        if MODEL in self.states:  # the model's tensors were loaded into a flattened copy: hand them over
            self.states[MODEL].load_state_dict(state_dict)
        return None
