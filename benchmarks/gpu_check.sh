#!/usr/bin/env bash
# One script for a machine with an NVIDIA GPU: builds fastckpt, runs the
# CUDA tests (which skip on a CPU-only machine), then a 4 GiB
# device-to-disk save and disk-to-device load benchmark. Meant to finish in
# under 8 minutes. Usage: bash benchmarks/gpu_check.sh [DIR]   (DIR: where to write)
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-$(pwd)}
OUT=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || { echo "gpu_check: no NVIDIA GPU here"; exit 77; }

# torch with CUDA: use the machine's if it has one, else install the pinned version.
PY=${PY:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: the Python at '$PY' has no CUDA torch"; exit 1
fi
$PY -m pip install -q pybind11 ninja pytest numpy hypothesis 2>&1 | tail -1
$PY -m pip install -q --no-build-isolation --no-deps -e . || exit 1
echo "== build done after $(( $(date +%s) - t0 )) s"

$PY -m pytest -q -rs tests/python -k "cuda or CUDA or Cuda" 2>&1 | tee "$OUT/gpu_pytest.log" | tail -30
echo "== CUDA tests done after $(( $(date +%s) - t0 )) s"

$PY benchmarks/bench_gpu.py --dir "$DIR" --size 4G 2>&1 | tee "$OUT/gpu_bench.log"
echo "== gpu_check finished after $(( $(date +%s) - t0 )) s"
