#!/usr/bin/env bash
# One-H200 check of the lean launch and the per-link IPC tables: the kernel tests, the host
# cost before/after right after torch work (benchmarks/launch_cold.py), then every GPU test.
#   bash scripts/device_lean.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u
timeout 120 python3 -m pytest -q -x tests/gpu/test_kernel_gpu.py 2>&1 | tail -5
timeout 150 python3 benchmarks/launch_cold.py --tokens 512,2048 --reads 40 --json "$OUT/cold.json" 2>&1 | grep "|"
timeout 300 python3 -m pytest -q tests/gpu 2>&1 | tail -6
date -u
