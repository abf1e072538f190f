#!/usr/bin/env bash
# The system packages of the build, the tests and the benchmark (Debian; installed when root).
# Idempotent and quick when they are there. .ci/setup.sh runs it first; `make test` runs it alone
# first too, so that the C++ tests (which need nothing else) build and run while setup.sh installs
# the Python side.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
say() { printf '[setup +%ss] %s\n' "$((SECONDS - START))" "$*"; }

# System packages: liburing (io_uring backend), fio (the disk's own limit in
# the benchmark), a C++ toolchain and cmake/ninja for the C++ tests; fuse3 and
# libfuse3 for the power-loss simulator (tests/powerloss, through mfusepy).
pkgs=(liburing-dev zlib1g-dev fio g++ make cmake ninja-build python3-venv fuse3 libfuse3-dev pkg-config)
# ISA-L: the engine's hardware-accelerated CRC-32 (optional; zlib's without it). ISA-L and libdeflate: the accelerated CRC-32s that `make bench-crc` measures against zlib.
pkgs+=(libisal-dev libdeflate-dev)
if command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then
  missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      say "installing ${missing[*]}"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      say "not root: cannot install ${missing[*]} (without liburing-dev the build has the thread backend only; without fio the benchmark skips the disk limit)"
    fi
  fi
else
  say "no apt-get: make sure liburing-dev, fio, cmake and a C++ compiler are installed"
fi

