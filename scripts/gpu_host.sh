#!/usr/bin/env bash
# The GPU host checks, one script (docs/benchmarks.md, "One GPU"). Run from the repository root:
#   bash scripts/gpu_host.sh checks          GPU tests, the GPU example, where one Agent.read's time goes
#   bash scripts/gpu_host.sh sweep           the one-GPU table: single requests, 512/2,048/8,192 tokens (+ plot)
#   bash scripts/gpu_host.sh step [N]        a step of N (default 32) requests x 512 tokens against peer-copy
#   bash scripts/gpu_host.sh ab [pairs]      the sweep, code in .out/base (e.g. `git archive`, carried) against
#                                            this tree, in interleaved pairs (default 2)
#   bash scripts/gpu_host.sh all             checks, sweep, step
# Needs Python 3.12 with torch, cupy and NIXL. Where the host has no package index, carry the wheels
# in .whl/ (nixl-cu13 + nixl 1.5.1, pyzmq, msgspec for Python 3.12): they are installed into
# /tmp/site. Results: JSON and plots under $OUT (default /tmp/kvxfer-out); tables on stdout.
# With one GPU both processes share it; with two, the producer is on GPU 1.
set -uo pipefail
case "${1:-all}" in checks|sweep|step|ab|all) ;; *) echo "usage: bash scripts/gpu_host.sh checks|sweep|step [N]|ab [pairs]|all"; exit 2 ;; esac
OUT=${OUT:-/tmp/kvxfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
fi
WHAT=${1:-all}
date -u; nvidia-smi -L 2>/dev/null; git log -1 --format="commit %h %s" 2>/dev/null | cut -c1-100
P=$(python3 -c "import torch; print(1 if torch.cuda.device_count() > 1 else 0)")
BENCH="python3 -m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 5 --warmup 2 --rounds 3 \
  --producer-gpu $P --consumer-gpu 0 --scenario same --ids fragmented"

checks() {
  timeout 600 python3 -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tail -n 3
  timeout 60 python3 examples/gpu_read.py 2>&1 | grep -v "NIXL INFO" | tail -n 4
  echo "### where one Agent.read's time goes (512 tokens)"
  timeout 90 python3 benchmarks/read_phases.py --device cuda:0 --tokens 512 --reads 30 2>&1 | grep -v "NIXL INFO" | head -n 12
}

sweep() {  # docs/bench/gpu-single.json
  timeout 300 $BENCH --tokens 512,2048,8192 --methods peer-copy,nixl-1desc,nixl-per-block,mooncake-batch,kvxfer-ipc,kvxfer-agent \
    --json "$OUT/gpu-single.json" --plot "$OUT/gpu-single.png" 2>"$OUT/gpu-single.err" | grep -Ev "NIXL INFO"
}

step() {  # docs/bench/gpu-step.json
  timeout 300 $BENCH --tokens 512 --batch "${1:-32}" --methods peer-copy,nixl-per-block,kvxfer-ipc,kvxfer-agent \
    --json "$OUT/gpu-step.json" 2>"$OUT/gpu-step.err" | grep -Ev "NIXL INFO"
}

ab() {
  local site=${PYTHONPATH%%:*}
  [ -d .out/base ] || { echo "ab: put the base code in .out/base (e.g. git archive BASE kvxfer benchmarks | tar -x -C .out/base)"; exit 2; }
  for pair in $(seq 1 "${1:-2}"); do
    for side in base new; do
      if [ $side = base ]; then root=$PWD/.out/base; else root=$PWD; fi
      echo "### pair $pair, $side"
      (cd "$root" && PYTHONPATH=$site:$root timeout 200 $BENCH --tokens 512,2048,8192 --methods peer-copy,kvxfer-ipc,kvxfer-agent \
        --json "$OUT/ab-$side-$pair.json" 2>"$OUT/ab-$side-$pair.err" | grep -Ev "NIXL INFO")
    done
  done
}

case "$WHAT" in
  checks) checks ;;
  sweep) sweep ;;
  step) step "${2:-32}" ;;
  ab) ab "${2:-2}" ;;
  all) checks; sweep; step 32 ;;
  *) echo "usage: bash scripts/gpu_host.sh checks|sweep|step [N]|ab [pairs]|all"; exit 2 ;;
esac
date -u
