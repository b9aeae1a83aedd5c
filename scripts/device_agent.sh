#!/usr/bin/env bash
# GPU-host run of the Agent's GPU paths (issue 6): GPU tests, the example, and `kvxfer bench`
# timing the public Agent.read per path. Works on a one-GPU host (both processes on GPU 0).
#   bash scripts/device_agent.sh [all|checks|bench]   (wheels in .whl/, see docs/benchmarks-gpu.md)
#   checks: GPU tests, the example, read_phases.py, claim_latency.py; bench: `kvxfer bench` rows
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u; nvidia-smi -L
P=$(python3 -c "import torch; print(1 if torch.cuda.device_count() > 1 else 0)")
WHAT=${1:-all}
if [ "$WHAT" != bench ]; then
timeout 240 python3 -m pytest -q -rs tests/gpu tests/integration/test_staged_nixl.py tests/integration/test_old_peer_nixl.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -n 25
timeout 60 python3 examples/gpu_read.py 2>&1 | grep -v "NIXL INFO" | tail -n 8
echo "### benchmarks/read_phases.py (ipc, 1 GiB)"; timeout 120 python3 benchmarks/read_phases.py --device cuda:0 --reads 30 2>&1 | grep -v "NIXL INFO" | tee "$OUT/phases.txt" | head -n 40
echo "### benchmarks/claim_latency.py"; timeout 90 python3 benchmarks/claim_latency.py 2>&1 | grep -v "NIXL INFO" | tail -n 6
fi
[ "$WHAT" = checks ] && exit 0
B="python3 -m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 4 --warmup 2 --rounds 3 --producer-gpu $P --consumer-gpu 0"
b() { local tag=$1; shift; echo "### $*"; timeout 110 $B "$@" --json "$OUT/$tag.json" 2>"$OUT/$tag.err" | grep -E "^[0-9]+ "; grep -h "kvxfer-agent:" "$OUT/$tag.err" | cut -c24-
      grep -E "ERROR|Error" "$OUT/$tag.err" | cut -c1-300 | head -3; }
b same-auto --scenario same --ids fragmented --methods peer-copy,kvxfer-ipc,kvxfer-agent --gpu-path auto
b contig-auto --scenario same --ids contiguous --methods peer-copy,kvxfer-ipc,kvxfer-agent --gpu-path auto
b tp12-auto --scenario tp1-2 --ids fragmented --methods peer-copy,kvxfer-ipc,kvxfer-agent --gpu-path auto
b hnd-auto --scenario hnd-nhd --ids fragmented --methods peer-copy,kvxfer-ipc,kvxfer-agent --gpu-path auto
b tp21-auto --scenario tp2-1 --ids fragmented --methods peer-copy,kvxfer-ipc,kvxfer-agent --gpu-path auto
