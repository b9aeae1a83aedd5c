#!/usr/bin/env bash
# The project's whole check: import-layer contracts, then the test suite (unit, real NIXL/ZMQ, real vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
echo "== import-linter (layer contracts)"
"$BIN/lint-imports"
echo "== pytest"
exec "$BIN/python" -m pytest -q -p no:cacheprovider "$@"
