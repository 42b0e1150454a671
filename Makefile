# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
# Both create/refresh .venv from the project's own files (torch pinned to the CPU build).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: venv train test test-unit lint bench clean down

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: venv
	$(BIN)/rollart train $(ARGS)

test: venv
	$(BIN)/python -m pytest -q tests

test-unit: venv
	$(BIN)/python -m pytest -q tests/unit

lint: venv
	$(BIN)/ruff check .

bench: venv
	$(BIN)/python benchmarks/learn_frozenlake.py

down:
	-test -x $(BIN)/rollart && $(BIN)/rollart down
	-test -f .rollart/prefect.pid && kill -- -$$(cat .rollart/prefect.pid); rm -f .rollart/prefect.pid

clean: down
	rm -rf $(VENV) .rollart artifacts
