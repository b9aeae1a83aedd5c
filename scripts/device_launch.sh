#!/usr/bin/env bash
# One-H200 run for issue 15 (the IPC read's host cost) and the GPU checks: the launch step by
# step with fresh ids per request (async ids upload against the old synchronous one), where one
# Agent.read's time goes, the small-request sweep, the GPU tests, and the transformers GPU test's
# per-prompt figures. Tables on stdout, JSON and plots under $OUT.
#   bash scripts/device_launch.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u; nproc
echo "### ipc launch, step by step"; timeout 120 python3 benchmarks/ipc_launch.py --json "$OUT/ipc-launch.json" 2>&1 | tail -4
for t in 512 2048; do
  echo "### read phases, $t tokens"; timeout 90 python3 benchmarks/read_phases.py --device cuda:0 --tokens $t --reads 30 2>&1 | grep -v "NIXL INFO" | head -9
done
B="python3 -m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 5 --warmup 2 --rounds 3 --producer-gpu 0 --consumer-gpu 0 --scenario same --ids fragmented --tokens 512,2048,8192 --methods peer-copy,kvxfer-ipc,kvxfer-agent"
echo "### sweep"; timeout 150 $B --json "$OUT/small.json" --plot "$OUT/small.png" 2>"$OUT/small.err" | grep -E "^[0-9]+ |tokens"
echo "### GPU tests"; timeout 240 python3 -m pytest -q tests/gpu -p no:cacheprovider --deselect tests/gpu/test_transformers_gpu.py 2>&1 | tail -n 3
echo "### transformers GPU test"; timeout 120 python3 -m pytest -q -s tests/gpu/test_transformers_gpu.py -p no:cacheprovider 2>&1 | grep -E "tokens:|passed|failed|Error" | tail -n 8
date -u
