#!/usr/bin/env bash
# GPU A/B of a step of token reads: base code in .out/base (e.g. `git archive BASE kvxfer benchmarks | tar -x -C .out/base`, carried) against this tree, two interleaved pairs; then this tree's single token reads, the step's timeline and the GPU token tests. Results under $OUT.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
SITE=/tmp/site
nvidia-smi -L | head -1; date -u
B="python3 -m kvxfer.bench.cli --preset llama-3-8b --device gpu --iters 5 --warmup 2 --rounds 1 --producer-gpu 0 --consumer-gpu 0 --scenario same --ids fragmented"
for pair in 1 2; do
  for side in base new; do
    if [ $side = base ]; then root=$PWD/.out/base; else root=$PWD; fi
    echo "### step pair $pair $side"
    (cd $root && PYTHONPATH=$SITE:$root timeout 120 $B --tokens 512 --batch 32 --methods peer-copy,kvxfer-ipc,kvxfer-token --json $OUT/step-$side-$pair.json 2>$OUT/step-$side-$pair.err | grep -v "NIXL INFO" | tail -4)
  done
done
export PYTHONPATH=$SITE:$PWD
echo "### single token reads, new"
timeout 150 $B --tokens 2048,8192 --methods peer-copy,kvxfer-ipc,kvxfer-token --json $OUT/single-new.json 2>$OUT/single-new.err | grep -v "NIXL INFO" | tail -7
echo "### timeline, new"
timeout 100 python3 benchmarks/read_phases.py --device cuda:0 --tokens 512 --batch 32 --hold-tokens --reads 40 2>&1 | grep -v "NIXL INFO" > $OUT/phases-new.txt; head -3 $OUT/phases-new.txt
echo "### GPU token tests, new"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tokens_gpu.py 2>&1 | tail -3
