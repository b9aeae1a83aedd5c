# Sourced by the scripts/device_*.sh runs: $OUT for results, and the carried wheels (.whl/: nixl,
# pyzmq, msgspec for Python 3.12; see docs/benchmarks-gpu.md) installed into /tmp/site.
OUT=${OUT:-/tmp/kvxfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
fi
