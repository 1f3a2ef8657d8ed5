# Set-up and checks. `make test` and `make demo` work on a fresh clone: they create
# .venv, install the pinned CPU torch first (a looser pin would pull a multi-GB CUDA
# build), then the project with every extra.
SHELL := bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
# This machine's pip config names local wheel folders that may not exist; hide that noise
# (pip's own exit status still counts, through pipefail).
QUIET := { grep -v "is ignored: it is neither" || true; }
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.routeplay-installed
TORCH_PIN := torch==2.13.0
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup test lint typecheck pytest demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH_PIN) 2>&1 | $(QUIET)
	$(PIP) install -e '.[all,dev]' 2>&1 | $(QUIET)
	$(BIN)/python -c "import routeplay, torch, ray; assert torch.__version__.startswith('2.13.0')"
	@touch $@

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest tests

test: lint typecheck pytest

# The end-to-end RL demo on a local Ray instance (the R3 recipe, under two minutes on 2 CPUs);
# the report, its JSON and the PNG land in build/demo/. ARGS passes flags, e.g.
# ARGS="--trainer-dtype bf16" or ARGS="--recipe smoke".
demo: $(STAMP)
	$(BIN)/routeplay demo --json build/demo/report.json --plot build/demo/timeline.png $(ARGS)

bench: $(STAMP)
	$(BIN)/routeplay bench $(ARGS)
	$(BIN)/python benchmarks/codec_throughput.py
	$(BIN)/python benchmarks/put_options.py
	$(BIN)/python benchmarks/transfer_paths.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
