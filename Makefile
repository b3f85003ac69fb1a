# Two entry points, both from a fresh clone: `make serve` and `make test` (see README).
# Each creates .venv, installs the CPU build of torch first (pinned; an unpinned torch pulls a
# multi-GB CUDA build), then this project with what the command needs.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# setuptools' note on every editable install is advice for package authors, not for someone installing
export PYTHONWARNINGS := ignore:Editable installation
# pip would byte-compile every file of every package it installs (about 35 s of the install here, most
# of it never imported); it installs with --no-compile instead, and Python caches the bytecode of what
# is imported on first import. That needs bytecode writing on, whatever the calling shell says.
export PYTHONDONTWRITEBYTECODE :=
PIP_INSTALL := $(BIN)/pip install -q --no-compile

.PHONY: install install-test serve test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP_INSTALL) -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

serve: install
	$(BIN)/hisparse serve $(ARGS)

test: install-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
