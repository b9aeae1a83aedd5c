#!/usr/bin/env bash
# One-H200 A/B of the IPC read path: the code in .out/base (e.g. `git archive HEAD kvxfer
# benchmarks`, carried) against this tree, interleaved pairs of `benchmarks/read_phases.py` and
# the small-request sweep (issue 15). Every transfer is verified by the tools themselves.
#   bash scripts/device_ab.sh [pairs]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u; nproc
SITE=${PYTHONPATH%%:*}
SWEEP="-m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 5 --warmup 2 --rounds 3 --producer-gpu 0 --consumer-gpu 0 --scenario same --ids fragmented --tokens 512,2048,8192 --methods peer-copy,kvxfer-ipc,kvxfer-agent"
for pair in $(seq 1 "${1:-2}"); do
  for side in base new; do
    if [ $side = base ]; then root=$PWD/.out/base; else root=$PWD; fi
    echo "### pair $pair, $side: read_phases 512 tokens"
    (cd "$root" && PYTHONPATH=$SITE:$root timeout 90 python3 benchmarks/read_phases.py --device cuda:0 --tokens 512 --reads 60 2>&1 | grep -v "NIXL INFO" | head -n 12)
    echo "### pair $pair, $side: sweep"
    (cd "$root" && PYTHONPATH=$SITE:$root timeout 150 python3 $SWEEP --json "$OUT/sweep-$side-$pair.json" 2>"$OUT/sweep-$side-$pair.err" | grep -E "^ *[0-9]+ |tokens")
  done
done
date -u
