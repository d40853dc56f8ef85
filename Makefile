# Set-up and the two main jobs. Everything is installed into .venv by these rules.
#   make demo   set up, build, run the main job (python -m lpsim.demo $(DEMO_ARGS))
#   make test   set up, lint, build, run the tests
#   make lint   ruff (lint and format check) and clang-format check; make format applies them
#   make bench  set up, build, run the quantisation benchmark
#   make gpu-check  on a GPU machine: build the CUDA kernels for its GPU, run the GPU tests and the
#               GPU benchmarks, write out/gpu-check/report.md (tools/gpu_check.py). It runs under
#               GPU_PYTHON (default python3, the machine's own torch) and installs nothing; without
#               a GPU it reports the GPU parts skipped.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEPS := $(VENV)/.deps-installed
BUILT := $(VENV)/.lpsim-built
SOURCES := setup.py pyproject.toml $(shell find csrc -type f 2>/dev/null)

CXX_SOURCES := $(shell find csrc tests/cpp -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)

.PHONY: demo test bench build clean lint format gpu-check

demo: $(BUILT)
	$(PY) -m lpsim.demo $(DEMO_ARGS)

test: lint $(BUILT)
	$(PY) -m pytest -q

lint: $(DEPS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)

format: $(DEPS)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

bench: $(BUILT)
	$(PY) benchmarks/bench_quantize.py

build: $(BUILT)

GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): requirements.txt | $(PY)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet -r requirements.txt
	touch $@

# The extension is compiled ahead of time; `import lpsim` never compiles.
$(BUILT): $(DEPS) $(SOURCES)
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf build lpsim/_C*.so *.egg-info $(BUILT)
