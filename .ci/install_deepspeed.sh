#!/usr/bin/env bash
# Optional peer for `make bench-full`: DeepSpeed's FastPersist writer. Installed
# without its dependencies so that pip never replaces the pinned torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libaio-dev >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null
fi
"$PY" -m pip install -q -c .venv/torch-constraint.txt --no-deps deepspeed==0.19.8
"$PY" -m pip install -q -c .venv/torch-constraint.txt einops hjson msgpack psutil py-cpuinfo pydantic tqdm
"$PY" -c "import torch; print('[deepspeed] installed; torch is still', torch.__version__)"
