# kvxfer: `make demo` and `make test` each create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow lint bench venv clean

venv:
	@bash scripts/bootstrap.sh

demo: venv
	$(BIN)/kvxfer demo

test: venv
	@bash scripts/test.sh

test-slow: venv
	KVXFER_TEST_MARKS=slow bash scripts/test.sh

lint: venv
	$(BIN)/lint-imports

bench: venv
	$(BIN)/kvxfer bench --preset llama-3-8b --device cpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
