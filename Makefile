# The two commands of the quick start: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TYPED := router policies sim bench experiments session_router_cli.py

.PHONY: test lint typecheck unit e2e slow faults suite plugin-test demo install native clean \
	real-engines test-real

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

install: $(STAMP)

PLUGIN_STAMP := $(VENV)/.plugin-installed

$(PLUGIN_STAMP): $(STAMP) examples/policy-plugin/pyproject.toml
	$(BIN)/python -m pip install -q -e './examples/policy-plugin[test]'
	touch $(PLUGIN_STAMP)

# the router's hot path compiled with mypyc (router/native.py), rebuilt when its sources change;
# without a C compiler the router runs its Python sources, the same only slower
native: $(STAMP)
	$(BIN)/session-router native build --if-stale || echo "native hot path not built"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check $(TYPED) tests examples

typecheck: $(STAMP)
	$(BIN)/mypy $(TYPED)
	MYPYPATH=examples/policy-plugin $(BIN)/mypy examples/policy-plugin/example_policy

# the suites by marker (tests/conftest.py says which test is which): unit runs in under a
# minute; suite runs all of them
unit: native
	$(BIN)/python -m pytest -q -m unit $(PYTEST_ARGS)

e2e: native
	$(BIN)/python -m pytest -q -m e2e $(PYTEST_ARGS)

slow: native
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# the fault scenarios (real processes), with their table
faults: native
	$(BIN)/python -m pytest -q -s -m faults $(PYTEST_ARGS)

suite: native
	$(BIN)/python -m pytest -q -m "not real_engine" $(PYTEST_ARGS)

# real vLLM engines (CPU build) with NIXL, in their own virtualenv, and a tiny model built here
# without any hub (bench/vllm/install.py); quick when already done
VLLM_VENV := .venv-vllm
real-engines: $(STAMP)
	$(BIN)/python -m bench.vllm.install --venv $(VLLM_VENV)

# the router in front of real vLLM engines (tests/real_engine); native tracebacks: on CPython
# 3.11.7 pytest's own failure report of these tests dies in ast.parse ("AST constructor
# recursion depth mismatch")
test-real: real-engines native
	SESSION_ROUTER_VLLM_VENV=$(VLLM_VENV) $(BIN)/python -m pytest -q -s -m real_engine --timeout 900 \
		--tb=native -p no:hypothesispytest \
		tests/real_engine $(PYTEST_ARGS)

# the example policy plugin, installed (its entry point) and tested with policies.testing
plugin-test: $(PLUGIN_STAMP)
	$(BIN)/python -m pytest -q examples/policy-plugin/tests

test: lint typecheck suite plugin-test

demo: $(STAMP)
	$(BIN)/session-router demo

clean:
	rm -rf $(VENV) .native *.egg-info .mypy_cache .ruff_cache .pytest_cache
