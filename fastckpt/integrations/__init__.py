"""Glue between fastckpt and the frameworks that checkpoint for their users.

Each submodule imports its framework on import, and only its own: importing
one whose framework is not installed raises ImportError naming the pip
package to install (``pip install "fastckpt-io[lightning]"`` installs it at a
version tested with fastckpt). Nothing here is imported by ``import fastckpt``.

* :mod:`fastckpt.integrations.lightning`: ``FastCheckpointIO`` and
  ``AsyncFastCheckpointIO`` (Lightning ``Trainer(plugins=[...])`` / ``Fabric(plugins=[...])``).
* :mod:`fastckpt.integrations.accelerate`: ``use_fastckpt(accelerator)``.
* :mod:`fastckpt.integrations.transformers`: ``FastTrainerMixin`` / ``FastTrainer``.
* :mod:`fastckpt.integrations.deepspeed`: ``FastCheckpointEngine``.
* :mod:`fastckpt.integrations.torchtitan`: ``FastCheckpointManager`` (torchtitan's
  ``CheckpointManager`` with its DCP folders written and read by FastWriter / FastReader).

See docs/INTEGRATIONS.md.
"""

__all__ = ["lightning", "accelerate", "transformers", "deepspeed", "torchtitan"]
