# vlmesh: the two commands are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch: on our machines pip finds this exact wheel locally. An unpinned
# torch would pull a CUDA build of several GB.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu venv protos lint up help

help:
	@echo "make demo      start the mesh on the demo model, answer one picture, stop"
	@echo "make test      create or refresh .venv and run the CPU test suite"
	@echo "make test-gpu  run the GPU tests (on a CUDA host, with its own python)"
	@echo "make protos    regenerate vlmesh/v1 stubs from protos/"
	@echo "make lint      ruff check and format check"

venv: $(STAMP)

# Rebuilt whenever pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/vlmesh demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

# On the GPU machine: its python already has torch with CUDA; missing wheels are carried.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests/gpu

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
