# The two commands of the quick start: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TYPED := router policies sim bench session_router_cli.py

.PHONY: test lint typecheck unit demo install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check $(TYPED) tests

typecheck: $(STAMP)
	$(BIN)/mypy $(TYPED)

unit: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test: lint typecheck unit

demo: $(STAMP)
	$(BIN)/session-router demo

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache .pytest_cache
