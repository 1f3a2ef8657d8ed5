# Set-up and checks. `make test` and `make demo` work on a fresh clone: they create
# .venv, install the pinned CPU torch first (a looser pin would pull a multi-GB CUDA
# build), then the project with every extra (scripts/install-venv: uv, pip as fallback).
SHELL := bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.routeplay-installed
TORCH_PIN := torch==2.13.0
# pytest workers (pytest-xdist). Whole files go to one worker (--dist loadfile), so a
# module's Ray job and fixtures are shared as before; most of a Ray test's wall time
# is waiting on other processes, so two workers use two cores well. Files go out in
# collection order (--no-loadscope-reorder; xdist would sort them by test count), which
# tests/conftest.py starts with the longest modules so none runs alone at the end.
PYTEST_WORKERS ?= 2
# Python writes its bytecode cache (__pycache__, in .venv and here) in everything make
# runs: a machine that sets PYTHONDONTWRITEBYTECODE (this one does) would otherwise make
# every process compile torch and transformers from source again, and every Ray actor is
# a process (6-8 s of CPU each: 40% of the test suite's time). `test` imports the heavy
# parts once, beside mypy, so the parallel test workers find them compiled.
unexport PYTHONDONTWRITEBYTECODE
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: setup test lint typecheck pytest coverage demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	scripts/install-venv $(VENV) '$(TORCH_PIN)' '.[all,dev]'
	$(BIN)/python -c "import routeplay, torch, ray; assert torch.__version__.startswith('2.13.0')"
	@touch $@

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest $(XDIST) tests

# Line and branch coverage of src/ (what a change to the suite must not lower), Ray's
# worker processes included: coverage starts in them (pyproject's [tool.coverage.run]),
# tests/coverage_startup/sitecustomize.py saves their data while they run and before Ray
# stops them, and a raylet that stops a worker waits up to 3 s (not 0.1 s) for it to exit.
coverage: $(STAMP)
	PYTHONPATH=$(CURDIR)/tests/coverage_startup RAY_kill_worker_timeout_milliseconds=3000 \
	$(BIN)/pytest $(XDIST) --cov=src/routeplay --cov-branch \
	  --cov-report=term:skip-covered --cov-report=json:build/coverage.json tests

# mypy (one core, about 26 s cold) runs beside the bytecode warm-up and the tests; its
# report follows theirs, and either one failing fails the target.
test: lint
	@mkdir -p build; status=0; \
	$(MAKE) --no-print-directory typecheck > build/mypy.log 2>&1 & typecheck=$$!; \
	$(BIN)/python -c "import routeplay.pipeline.demo" || status=$$?; \
	$(MAKE) --no-print-directory pytest || status=$$?; \
	wait $$typecheck || status=1; \
	cat build/mypy.log; exit $$status

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
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis .coverage .coverage.*
