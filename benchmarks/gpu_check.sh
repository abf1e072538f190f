#!/usr/bin/env bash
# One script for a machine with an NVIDIA GPU, under one time limit
# (LIMIT seconds, default 540): builds fastckpt's extension if needed (no
# network needed when torch, pybind11 and pytest are installed), runs the real
# CUDA tests (tests/python/staging/test_staging_cuda.py and every test named cuda;
# they skip on a CPU-only machine) and the simulated-device tests, then a
# device-to-disk save and disk-to-device load benchmark with host RSS
# (benchmarks/bench_gpu.py). Usage: bash benchmarks/gpu_check.sh [DIR]
# (DIR: where to write). Logs go to $OUT (default /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-$(pwd)}
OUT=${OUT:-/tmp}
LIMIT=${LIMIT:-540}
SIZE=${SIZE:-4G}
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || { echo "gpu_check: no NVIDIA GPU here"; exit 77; }

PY=${PY:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: the Python at '$PY' has no CUDA torch"; exit 1
fi
if ! $PY -c "import fastckpt._C" 2>/dev/null; then
  $PY -c "import pybind11" 2>/dev/null || timeout 120 $PY -m pip install -q pybind11 2>&1 | tail -1
  timeout "$(left)" $PY setup.py -q build_ext --inplace 2>&1 | tail -5 || exit 1
fi
$PY -c "import pytest" 2>/dev/null || timeout 120 $PY -m pip install -q pytest hypothesis 2>&1 | tail -1
echo "== build done after $(( $(date +%s) - t0 )) s"

rc=0
timeout "$(( $(left) * 2 / 3 ))" $PY -m pytest -q -rs -x -p no:cacheprovider \
  tests/python/staging/test_staging_cuda.py tests/python/staging/test_staging_sim.py 2>&1 | tee "$OUT/gpu_pytest.log" | tail -30
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout "$(( $(left) / 2 ))" $PY -m pytest -q -rs -p no:cacheprovider tests/python -k "cuda or CUDA or Cuda" \
  --ignore=tests/python/staging/test_staging_cuda.py 2>&1 | tee -a "$OUT/gpu_pytest.log" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== CUDA tests done after $(( $(date +%s) - t0 )) s (rc=$rc)"

# Collective load onto the GPU (fastckpt.load(path, group=pg, map_location="cuda:0")): NCCL device
# collectives at world size 1 (NCCL refuses two ranks on one GPU) and gloo staged through host memory
# at world size 2, each against a plain load (STATS: peak host RSS per rank), with the simulated-device
# tests of the same file. What only this machine checks: real NCCL broadcasts into CUDA storages,
# their stream order, page-locked ring buffers and the copy streams.
timeout "$(( $(left) / 3 ))" $PY -m pytest -q -rs -s -p no:cacheprovider tests/python/collective/test_collective_load_device.py \
  2>&1 | tee "$OUT/gpu_collective_load.log" | grep -E "STATS|passed|failed|skipped|Error" | tail -12
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== collective load checks done after $(( $(date +%s) - t0 )) s (rc=$rc)"

timeout "$(( $(left) - 5 ))" $PY benchmarks/bench_gpu.py --dir "$DIR" --size "$SIZE" --reps 1 2>&1 | tee "$OUT/gpu_bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== gpu_check finished after $(( $(date +%s) - t0 )) s (rc=$rc)"
exit $rc
