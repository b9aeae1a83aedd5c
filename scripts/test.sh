#!/usr/bin/env bash
# The project's whole check: import-layer contracts, then the test suite (unit, real NIXL/ZMQ, real vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
echo "== import-linter (layer contracts)"
"$BIN/lint-imports"
echo "== pytest"
select=()
if ! "$BIN/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # The GPU group needs CUDA hardware; it runs on a GPU host with: pytest -m gpu tests/gpu
  echo "   (no CUDA GPU here: the GPU test group, marked 'gpu', is not selected)"
  select=(-m "not gpu")
fi
exec "$BIN/python" -m pytest -q -p no:cacheprovider "${select[@]}" "$@"
