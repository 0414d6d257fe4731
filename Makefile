# Two commands from a fresh clone: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU machine gets the CPU wheel; with torch already in the venv (a GPU build), nothing is
# reinstalled. Override e.g. `make setup TORCH="torch==2.13.0 --index-url ..."`.
TORCH ?= torch==2.13.0
DEMO_RECIPE ?= recipes/smollm2-135m/demo.yaml

.PHONY: setup demo test test-fast lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e ".[dev]"
	touch $@

# fetch the target, regenerate data, distil a drafter, score every checkpoint, then score
# the training-free prompt-lookup baseline on the same held-out prompts for comparison
demo: setup
	$(BIN)/specdec train --config $(DEMO_RECIPE)
	$(BIN)/specdec score --config $(DEMO_RECIPE) --drafter prompt_lookup \
		--out runs/smollm2-135m-demo/prompt_lookup/score.json --force

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
