#!/usr/bin/env bash
# Optional: torchtitan for fastckpt.integrations.torchtitan's test. Installed with --no-deps and
# the few packages its checkpointer and optimizer containers import, so that pip never replaces the pinned
# torch. A full resolve of torchtitan 0.3.0 would downgrade huggingface_hub (2.4 -> 1.33, below what
# transformers 5.24 needs) and fsspec (for datasets<4.8) and pull wandb/tensorboard/datasets: not installed,
# so `pip check` lists them as torchtitan's missing requirements (the checkpoint path does not import them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CONSTRAINT="$(dirname "$(dirname "$PY")")/torch-constraint.txt"
"$PY" -m pip install -q -c "$CONSTRAINT" --no-deps torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 \
  typeguard==4.6.1 spmd_types==0.2.3
"$PY" -c "import torch, torchtitan.components.checkpointer; print('[torchtitan] installed; torch is still', torch.__version__)"
