# muoneq — every command creates .venv and installs what is missing on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The registry's default (CUDA-enabled) torch build: the CPU-only wheel cannot load
# torchvision's operators. Override, e.g. TORCH_SPEC="torch torchvision" on a GPU cluster.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install test test-fast lint demo

help: ## list every target
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-22s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) ## create .venv and install the package with its dev extras

test: $(STAMP) ## run the whole test suite (CPU; GPU-only tests skip without a GPU)
	$(PY) -m pytest -q tests

test-fast: $(STAMP) ## the suite without tests marked slow or distributed
	$(PY) -m pytest -q -m "not slow and not distributed" tests

lint: $(STAMP) ## ruff
	$(VENV)/bin/ruff check muoneq tasks tests benchmarks

demo: $(STAMP) ## the main job: a miniature of the paper's ablation, offline on CPU
	$(PY) -m muoneq.demo
