# Two commands for a fresh machine: `make serve` (install + start the OpenAI-compatible server on the
# embedded tiny model) and `make test` (install + run the test suite). Both create .venv themselves.
# `make demo` runs text/image/video/audio generation offline and exits.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.g4serve-installed
# torch/torchvision pinned to the builds CI and the dev machines cache locally.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

.PHONY: install serve demo test lint clean

HOST ?= 127.0.0.1
PORT ?= 8000

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PINS)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/g4serve serve --host $(HOST) --port $(PORT)

demo: $(STAMP)
	$(BIN)/python -m g4serve.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) .pytest_cache
