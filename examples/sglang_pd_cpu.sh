#!/usr/bin/env bash
# SGLang prefill -> SGLang decode through kvxfer on one CPU machine, behind SGLang's mini load
# balancer; prints the P/D answer and a plain server's answer, which must be equal.
# Needs .venv-sglang (`make sglang-venv`); the end-to-end test is tests/sglang/test_sglang_pd.py.
#
#   bash examples/sglang_pd_cpu.sh      # MODEL=/path/to/hf/model for your own model
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv-sglang/bin/python}
MODEL=${MODEL:-$ROOT/.venv-sglang/tiny-qwen3}
PLAIN=${PLAIN_PORT:-30000} P=${P_PORT:-30100} D=${D_PORT:-30200} LB=${LB_PORT:-30300} BOOT=${BOOT_PORT:-8998}
export SGLANG_USE_CPU_ENGINE=1 SGLANG_HOST_IP=127.0.0.1 PYTHONPATH=$ROOT/scripts/sglang_cpu
export SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0
COMMON=(--model-path "$MODEL" --device cpu --attention-backend torch_native --skip-tokenizer-init
        --host 127.0.0.1 --mem-fraction-static 0.05 --max-total-tokens 8192 --page-size 16)
WORK=$(mktemp -d); PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill -9 -- -"$pid" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
start() { setsid "$@" > "$WORK/server.${#PIDS[@]}.log" 2>&1 & PIDS+=($!); }
ready() { for _ in $(seq 400); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return; sleep 1; done; exit 1; }
ask() { curl -sf "http://127.0.0.1:$1/generate" -H 'content-type: application/json' -d \
  '{"input_ids":[5,9,17,33,65,129,257,513,7,11,13,19,23,29,31,37,41,43,47,53],
    "sampling_params":{"max_new_tokens":8,"temperature":0,"ignore_eos":true}}' |
  "$PY" -c 'import json,sys; print(json.load(sys.stdin)["output_ids"])'; }

start "$PY" -m sglang.launch_server "${COMMON[@]}" --port "$PLAIN"
ready "$PLAIN"; plain=$(ask "$PLAIN"); kill -9 -- -"${PIDS[0]}"
start "$PY" -m sglang.launch_server "${COMMON[@]}" --port "$P" --disaggregation-mode prefill \
  --disaggregation-transfer-backend kvxfer --disaggregation-bootstrap-port "$BOOT"
start "$PY" -m sglang.launch_server "${COMMON[@]}" --port "$D" --disaggregation-mode decode \
  --disaggregation-transfer-backend kvxfer --disaggregation-decode-retraction-backup cpu_tensor
start "$PY" -m sglang_router.launch_router --pd-disaggregation --mini-lb --prefill "http://127.0.0.1:$P" "$BOOT" \
  --decode "http://127.0.0.1:$D" --host 127.0.0.1 --port "$LB"
ready "$P"; ready "$D"; sleep 2
pd=$(ask "$LB")
echo "plain: $plain"; echo "P/D:   $pd"
[ "$plain" = "$pd" ] && echo equal
