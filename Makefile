# kvxfer: `make demo` and `make test` each create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow test-sglang sglang-venv lint bench venv clean

venv:
	@bash scripts/bootstrap.sh

demo: venv
	$(BIN)/kvxfer demo

test: venv
	@bash scripts/test.sh

test-slow: venv
	KVXFER_TEST_MARKS=slow bash scripts/test.sh

# SGLang prefill -> decode through kvxfer (adapters/sglang): builds .venv-sglang (~7 GB, once), then
# runs the end-to-end test with SGLang's own mini load balancer (docs/engines.md, "SGLang").
sglang-venv:
	@bash scripts/bootstrap_sglang.sh

test-sglang: sglang-venv
	.venv-sglang/bin/python -m pytest -q -p no:cacheprovider -m sglang tests/sglang

lint: venv
	$(BIN)/lint-imports

bench: venv
	$(BIN)/kvxfer bench --preset llama-3-8b --device cpu

clean:
	rm -rf $(VENV) .venv-sglang .pytest_cache .hypothesis
