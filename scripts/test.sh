#!/usr/bin/env bash
# The project's whole check: import-layer contracts, then the test suite (unit, real NIXL/ZMQ, real vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
echo "== import-linter (layer contracts)"
"$BIN/lint-imports"
echo "== pytest"
# 'slow' (real vLLM with TP=2 prefill, 10-15 min on 2 cores) runs with `make test-slow`.
# 'sglang' (real SGLang servers, their own venv) runs with `make test-sglang`.
marks="not slow and not sglang"
if ! "$BIN/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # The GPU group needs CUDA hardware; on a GPU host it runs with: pytest -m gpu tests/gpu
  echo "   (no CUDA GPU here: the GPU test group, marked 'gpu', is not selected)"
  marks="$marks and not gpu"
fi
exec "$BIN/python" -m pytest -q -p no:cacheprovider --durations=25 -m "${KVXFER_TEST_MARKS:-$marks}" "$@"
