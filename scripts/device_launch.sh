#!/usr/bin/env bash
# One-H200 run for issue 15 (the IPC read's host cost): the launch step by step with fresh ids
# per request (async ids upload against the old synchronous one), a profile of Agent.read, the
# small-request sweep, and the GPU tests. Tables on stdout, JSON and plots under $OUT.
#   bash scripts/device_launch.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u; nproc
echo "### ipc launch, step by step"; timeout 120 python3 benchmarks/ipc_launch.py --json "$OUT/ipc-launch.json" 2>&1 | tail -5
echo "### read phases, 2048 tokens, profiled"; timeout 90 python3 benchmarks/read_phases.py --device cuda:0 --tokens 2048 --reads 30 --profile --top 45 2>&1 | grep -v "NIXL INFO" | head -70
B="python3 -m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 5 --warmup 2 --rounds 3 --producer-gpu 0 --consumer-gpu 0 --scenario same --ids fragmented --tokens 512,2048,8192 --methods peer-copy,kvxfer-ipc,kvxfer-agent"
echo "### sweep"; timeout 200 $B --json "$OUT/small.json" --plot "$OUT/small.png" 2>"$OUT/small.err" | grep -E "^[0-9]+ |tokens"
echo "### GPU tests"; timeout 170 python3 -m pytest -q -x tests/gpu -p no:cacheprovider 2>&1 | tail -n 3
date -u
