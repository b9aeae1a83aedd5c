#!/usr/bin/env bash
# One-H200 check of the GPU paths on the current code: the GPU test group in full, then the
# transformers GPU test with its per-prompt figures.
#   bash scripts/device_checks.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u
timeout 300 python3 -m pytest -q tests/gpu -p no:cacheprovider --deselect tests/gpu/test_transformers_gpu.py 2>&1 | tail -n 3
timeout 150 python3 -m pytest -q -s tests/gpu/test_transformers_gpu.py -p no:cacheprovider 2>&1 | grep -E "tokens:|passed|failed|Error" | tail -n 8
timeout 60 python3 examples/gpu_read.py 2>&1 | grep -v "NIXL INFO" | tail -n 4
date -u
