#!/usr/bin/env bash
# One-H200 sweep of the size-independent paths and the staged pipeline (issue 15's table plus
# the staged rows), two processes on GPU 0; the JSON goes to $OUT.
#   bash scripts/device_staged.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u
timeout 500 python3 -m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 5 --warmup 2 --rounds 3 \
  --producer-gpu 0 --consumer-gpu 0 --scenario same --ids fragmented --tokens 512,2048,8192 \
  --methods peer-copy,kvxfer-ipc,kvxfer-agent,kvxfer-staged,kvxfer-agent-staged \
  --json "$OUT/staged_sweep.json" 2>&1 | grep -v "NIXL INFO" | tail -n 22
date -u
