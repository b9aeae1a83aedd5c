#!/usr/bin/env bash
# One-H200 run for issue 15 (small requests): the size sweep with the express lane and with
# claims on ZMQ (KVXFER_EXPRESS_PORT=off), the claim round trip against a plain socket, where one
# read's time goes, and the GPU tests. Tables on stdout, JSON and plots under $OUT.
#   bash scripts/device_small.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u; nproc
B="python3 -m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 5 --warmup 2 --rounds 3 --producer-gpu 0 --consumer-gpu 0 --scenario same --ids fragmented --tokens 512,2048,8192 --methods peer-copy,kvxfer-ipc,kvxfer-agent"
echo "### express (default)"; timeout 200 $B --json "$OUT/small-express.json" --plot "$OUT/small-express.png" 2>"$OUT/small-express.err" | grep -E "^[0-9]+ |tokens"
echo "### claims on ZMQ (KVXFER_EXPRESS_PORT=off)"; KVXFER_EXPRESS_PORT=off timeout 200 $B --json "$OUT/small-zmq.json" --plot "$OUT/small-zmq.png" 2>"$OUT/small-zmq.err" | grep -E "^[0-9]+ |tokens"
echo "### claim latency"; timeout 90 python3 benchmarks/claim_latency.py --requests 100 --json "$OUT/claim.json" 2>&1 | grep -v "NIXL INFO" | tail -8
echo "### read phases, 512 tokens"; timeout 90 python3 benchmarks/read_phases.py --device cuda:0 --tokens 512 --reads 30 2>&1 | grep -v "NIXL INFO" | head -9
echo "### GPU tests"; timeout 150 python3 -m pytest -q -x tests/gpu -p no:cacheprovider 2>&1 | tail -n 3
date -u
