#!/usr/bin/env bash
# GPU-host run for kvxfer's GPU path (issue 6): GPU tests, kernel figures and every `kvxfer bench`
# scenario of docs/benchmarks-gpu.md, tables on stdout, JSON under $OUT. Needs two GPUs of one host.
# Carry the wheels (see docs/benchmarks-gpu.md): nixl-cu13 + nixl 1.5.1 for Python 3.12 in .whl/.
#   bash scripts/device_gpu.sh [all|tests|micro|scenarios|sweep|staged]
set -uo pipefail
WHAT=${1:-all}
source "$(dirname "$0")/device_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
want() { [ "$WHAT" = all ] || [ "$WHAT" = "$1" ]; }
B="python3 -m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 5 --warmup 2"
S=peer-copy,nixl-per-block,kvxfer-staged,kvxfer-ipc
b() { local tag=$1; shift; echo "### $*"; timeout 120 $B "$@" --json "$OUT/$tag.json" 2>"$OUT/$tag.err" | grep -E "^[0-9]+ "
      grep -E "ERROR" "$OUT/$tag.err" | cut -c1-400 | head -3; }
want tests && timeout 120 python3 -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tail -n 3
want micro && timeout 90 python3 -m kvxfer.bench.micro --json "$OUT/micro.json" 2>&1 | grep -E "kernel|pass|copy|index_select"
if want scenarios; then
  b same-frag --scenario same --ids fragmented --methods $S,nixl-1desc --piece-mib 0,128
  b same-contig --scenario same --ids contiguous --methods $S
  b tp1-2 --scenario tp1-2 --ids fragmented --methods $S
  b tp2-1 --scenario tp2-1 --ids fragmented --methods $S
  b hnd-nhd --scenario hnd-nhd --ids fragmented --methods peer-copy,kvxfer-staged,kvxfer-ipc
  b write --scenario same --ids fragmented --op write --methods peer-copy,kvxfer-staged
  b cross-layer --scenario cross-layer --ids fragmented --methods $S
fi
want sweep && b sweep --scenario same --ids fragmented --tokens 1024,2048,4096,8192,16384 \
  --methods peer-copy,nixl-1desc,nixl-per-block,kvxfer-staged,kvxfer-ipc --plot "$OUT/sweep.png"
if want staged; then
  b staged --scenario same --ids fragmented --iters 8 --methods peer-copy,kvxfer-staged,kvxfer-ipc,nixl-1desc
  python3 -c "import json,sys; [print(r['method'], r['trace_ms']) for r in json.load(open(sys.argv[1]))['rows'] if 'trace_ms' in r]" "$OUT/staged.json"
fi
