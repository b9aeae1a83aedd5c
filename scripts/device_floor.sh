#!/usr/bin/env bash
# One-H200 floors for issue 15's GPU goals, all in one call: what any Python-launched request
# costs against a plain copy (benchmarks/gpu_floor.py), the IPC read's host cost step by step
# (benchmarks/ipc_launch.py), the claim against a socket round trip on this host
# (benchmarks/claim_latency.py) and the small-request sweep.
#   bash scripts/device_floor.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u; nproc
echo "### gpu_floor"; timeout 60 python3 benchmarks/gpu_floor.py --json "$OUT/floor-1.json"
echo "### ipc_launch"; timeout 120 python3 benchmarks/ipc_launch.py --tokens 512,2048,8192 --json "$OUT/ipc-launch.json" 2>&1 | grep -v "NIXL INFO"
echo "### claim_latency"; timeout 90 python3 benchmarks/claim_latency.py --requests 100 --json "$OUT/claim.json" 2>&1 | grep -v "NIXL INFO"
echo "### sweep"; timeout 180 python3 -m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 5 --warmup 2 --rounds 3 --producer-gpu 0 --consumer-gpu 0 --scenario same --ids fragmented --tokens 512,2048,8192 --methods peer-copy,kvxfer-ipc,kvxfer-agent --json "$OUT/sweep.json" 2>"$OUT/sweep.err" | grep -E "^ *[0-9]+ |tokens|verified"
echo "### gpu_floor again"; timeout 60 python3 benchmarks/gpu_floor.py --json "$OUT/floor-2.json"
date -u
