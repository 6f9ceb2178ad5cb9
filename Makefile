# Two commands for a fresh machine: `make serve` (install what serving needs + start the OpenAI-compatible
# server on the embedded tiny model) and `make test` (install with the test and assistant extras + run the
# test suite).
# Both create .venv themselves; every install is pinned by constraints.txt.
# `make demo` runs text/image/video/audio generation offline and exits. `make lint` checks style.
# `make test-latest` (not part of CI) runs the oracle tests against the newest torch, torchvision,
# transformers, tokenizers and xgrammar in .venv-latest and says which release drifted.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS := constraints.txt
# --no-build-isolation: the build backend is the pinned setuptools installed below, not the index's newest.
PIP := $(BIN)/python -m pip install -q -c $(CONSTRAINTS)
SERVE_STAMP := $(VENV)/.g4serve-serve
TEST_STAMP := $(VENV)/.g4serve-test
DIST_STAMP := $(VENV)/.g4serve-distributed
LINT_STAMP := $(VENV)/.g4serve-lint

.PHONY: install serve demo test test-distributed test-fuzz test-latest check-no-extras lint clean

HOST ?= 127.0.0.1
PORT ?= 8000

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools

$(SERVE_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP) --no-build-isolation -e .
	touch $@

$(TEST_STAMP): $(SERVE_STAMP)
	$(PIP) --no-build-isolation -e ".[test,assistant]"
	touch $@

$(DIST_STAMP): $(TEST_STAMP)
	$(PIP) --no-build-isolation -e ".[test,assistant,distributed]"
	touch $@

$(LINT_STAMP): $(CONSTRAINTS) | $(BIN)/python
	$(PIP) ruff
	touch $@

install: $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/g4serve serve --host $(HOST) --port $(PORT)

demo: $(SERVE_STAMP)
	$(BIN)/python -m g4serve.demo

# The suite runs on TEST_WORKERS processes (pytest-xdist; default: the CPUs, at most 4), each with one
# OpenMP/BLAS thread: most tests are Python-bound on the tiny model, so one process left a core idle, and
# processes of two threads each oversubscribed two cores (slower than one process). On CI's two cores: 457
# against 755-810 s. TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 4 ] && n=4; echo $$n)

test: $(TEST_STAMP)
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) \
		--durations=20

# Tests marked `distributed` (tensor parallel over gloo in several processes, Ray Serve replicas on a local
# cluster), left out of `make test` for their start-up time; CI runs both.
test-distributed: $(DIST_STAMP)
	$(BIN)/python -m pytest -q -m distributed --durations=10

# The fuzz and soak suite at full size (random hypothesis examples, 10 min of schemathesis, 300 streams + 100
# cancels); `make test` runs a short, derandomized version of it.
test-fuzz: $(TEST_STAMP)
	G4SERVE_FUZZ=full $(BIN)/python -m pytest -q tests/fuzz

test-latest:
	$(PYTHON) .ci/test_latest.py

# A plain `pip install .` (no extras) in .venv-noextras serves text, image, video and audio.
check-no-extras:
	$(PYTHON) .ci/check_no_extras.py

lint: $(LINT_STAMP)
	$(BIN)/ruff check src tests bench .ci
	$(BIN)/ruff format --check src tests bench .ci

clean:
	rm -rf $(VENV) .venv-latest .venv-noextras .pytest_cache
