# Set-up and checks. `make test` and `make demo` work on a fresh clone: they create
# .venv, install the pinned CPU torch first (a looser pin would pull a multi-GB CUDA
# build), then the project with every extra (scripts/install-venv: uv, pip as fallback),
# every package at the version of requirements/lock.txt (what the suite last passed with),
# and the partner frameworks the tests import (requirements/partners.txt, without their
# CUDA dependencies; what their modules need on a CPU: requirements/partner-deps.txt).
SHELL := bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.routeplay-installed
TORCH_PIN := torch==2.13.0
# Empty LOCK: the newest releases (`make test-latest`).
LOCK         ?= requirements/lock.txt
PARTNERS     := requirements/partners.txt
PARTNER_DEPS := requirements/partner-deps.txt
LATEST_VENV  ?= .venv-latest
# pytest workers (pytest-xdist). Whole files go to one worker (--dist loadfile), so a
# module's Ray job and fixtures are shared as before; most of a Ray test's wall time
# is waiting on other processes, so two workers use two cores well. Files go out in
# collection order (--no-loadscope-reorder; xdist would sort them by test count), which
# tests/conftest.py starts with the longest modules so none runs alone at the end.
PYTEST_WORKERS ?= 2
# Python writes its bytecode cache (__pycache__, in .venv and here) in everything make
# runs: a machine that sets PYTHONDONTWRITEBYTECODE (this one does) would otherwise make
# every process compile torch and transformers from source again, and every Ray actor is
# a process (6-8 s of CPU each: 40% of the test suite's time). `test` compiles the venv
# modules the suite imports once per install (a stamp), on every core, before the tests,
# so the parallel test workers find them compiled: without it, each test worker and Ray
# process compiled what it imported first, and pytest took 5 min 32 s against 4 min 23 s
# compiled. scripts/warm-bytecode compiles the 6,951 modules that
# requirements/warm-modules.txt lists (what `make test` imported; `scripts/warm-bytecode
# --record` after a `make test` rewrites it): 20 s, against 42-49 s for the 12,800 that
# it compiled before (the venv's packages less their tests, Ray's libraries routeplay
# does not use, pip and the transformers families nothing names).
# The stamp: checking 17,000 compiled modules again on every core took 10.7 s of
# process hand-offs, 1.5 s on one.
unexport PYTHONDONTWRITEBYTECODE
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
BYTECODE := $(VENV)/.routeplay-bytecode

.PHONY: setup test test-long test-latest lock lint typecheck pytest coverage demo bench clean

setup: $(STAMP)

# A new lock or partner list re-makes the stamp, so an existing venv takes it up.
$(STAMP): pyproject.toml $(LOCK) $(PARTNERS) $(PARTNER_DEPS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	scripts/install-venv $(if $(LOCK),--lock $(LOCK)) --with $(PARTNER_DEPS) \
	  --no-deps $(PARTNERS) $(VENV) '$(TORCH_PIN)' '.[all,dev]'
	$(BIN)/python -c "import routeplay, torch, ray; assert torch.__version__.startswith('2.13.0')"
	@touch $@

$(BYTECODE): $(STAMP) requirements/warm-modules.txt
	$(BIN)/python scripts/warm-bytecode
	@touch $@

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

# `make test` is the suite a newcomer runs first, under 6 minutes on a fresh clone of 2
# cores; the long end-to-end runs (pytest's `long` marker: the default demo as `make demo`
# runs it, the four-node cluster's tests and the bench's smoke run on it, the soak and the
# cancellation storms, the verl and XTuner flows across processes, two demos on one
# cluster, the two-step demo of three of the four engine wires, a group's worker calls
# through the demo's services, Megatron's 1F1B step reading every layer: more than half
# of the suite's test time here) are `make test-long`, which CI runs after it (.ci/run).
pytest: $(STAMP)
	$(BIN)/pytest $(XDIST) -m "not long" tests

test-long: $(STAMP)
	$(BIN)/python -c "import routeplay.pipeline.demo"
	$(BIN)/pytest $(XDIST) -m long tests

# Line and branch coverage of src/ (what a change to the suite must not lower), Ray's
# worker processes included: coverage starts in them (pyproject's [tool.coverage.run]),
# tests/coverage_startup/sitecustomize.py saves their data while they run and before Ray
# stops them, and a raylet that stops a worker waits up to 3 s (not 0.1 s) for it to exit.
coverage: $(STAMP)
	PYTHONPATH=$(CURDIR)/tests/coverage_startup RAY_kill_worker_timeout_milliseconds=3000 \
	$(BIN)/pytest $(XDIST) --cov=src/routeplay --cov-branch \
	  --cov-report=term:skip-covered --cov-report=json:build/coverage.json tests

# The bytecode warm-up runs alone (on every core); then the demo's import check (7.5 s
# cold) runs beside the tests, its report after theirs, and either failing fails the
# target. mypy is CI's (`.ci/run`: `make typecheck`, after `make test`) and the commit
# check's, not the newcomer's: cold it is 45 s of CPU, and a fresh clone's `make test` is
# CPU-bound on 2 cores (the tests, their Ray processes and collection in each worker).
test: lint
	@mkdir -p build; status=0; \
	$(MAKE) --no-print-directory $(BYTECODE) || status=$$?; \
	$(BIN)/python -c "import routeplay.pipeline.demo" > build/demo-import.log 2>&1 & demo=$$!; \
	$(MAKE) --no-print-directory pytest || status=$$?; \
	wait $$demo || { cat build/demo-import.log; status=1; }; \
	exit $$status

# The suite on the newest releases of everything (no lock; torch stays TORCH_PIN, the
# partners their pins), in a venv of its own made anew each run: what users installing
# today get, before they do. Not in CI. After it passes, `make lock VENV=$(LATEST_VENV)`
# adopts those versions.
test-latest:
	rm -rf $(LATEST_VENV)
	$(MAKE) --no-print-directory test typecheck test-long VENV=$(LATEST_VENV) LOCK=

# Rewrites requirements/lock.txt from $(VENV) (after a green `make test`): every installed
# package but routeplay itself, torch (TORCH_PIN), pip and the partners. Then, after a
# `make test` on the new lock, `$(BIN)/python scripts/warm-bytecode --record` brings the
# warm-up's list (requirements/warm-modules.txt) up to the new versions.
lock:
	@test -x $(BIN)/python || { echo "no $(VENV): run make test first" >&2; exit 1; }
	@partners=$$(sed -n 's/^\([A-Za-z0-9._-]*\)==.*/\1/p' $(PARTNERS) | paste -sd'|'); \
	freeze=$$($(BIN)/python -m pip freeze --all --exclude-editable --disable-pip-version-check); \
	locked=$$(grep -viE "^(torch|pip|routeplay|$$partners)( |=|@|$$)" <<< "$$freeze"); \
	if grep -v '==' <<< "$$locked"; then echo "not from an index: cannot be locked" >&2; exit 1; fi; \
	locked=$$(awk -F'==' '{n = tolower($$1); gsub(/[._]+/, "-", n); print n "==" $$2}' \
	  <<< "$$locked" | LC_ALL=C sort -t= -k1,1); \
	where=$$($(BIN)/python -c 'import platform as p; print("Python", p.python_version(), p.system(), p.machine())'); \
	{ echo "# What the suite last passed with ($$where), written by 'make lock'"; \
	  echo "# from its venv. scripts/install-venv uses it as constraints, for uv and for pip."; \
	  echo "# Not here: routeplay, torch (the Makefile's TORCH_PIN, CPU build), pip (the"; \
	  echo "# venv's own) and the partners ($(PARTNERS), installed with --no-deps)."; \
	  echo "$$locked"; } > $(LOCK).tmp
	@if cmp -s $(LOCK).tmp $(LOCK); then rm $(LOCK).tmp; echo "$(LOCK): unchanged"; \
	else mv $(LOCK).tmp $(LOCK); echo "$(LOCK): $$(grep -vc '^#' $(LOCK)) packages, rewritten"; \
	  git diff --stat -- $(LOCK) || true; fi

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
	rm -rf $(VENV) $(LATEST_VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis .coverage .coverage.*
