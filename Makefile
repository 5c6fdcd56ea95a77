# Two entry points (README): `make run` sets up and runs the main job, `make test` sets up and runs the tests.
# A Python 3.12 (flax 0.12.12, the release that runs on MaxText's JAX, needs it): pyenv's 3.12.1
# where pyenv has it, else python3.12. A venv of another Python is built again.
PYTHON ?= $(shell PYENV_VERSION=3.12.1 pyenv which python 2>/dev/null || command -v python3.12)
VENV := .venv
BIN := $(VENV)/bin
SPACE ?= moe_short

.PHONY: setup gpu-compile maxtext run test test-slow lint bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -n "$(PYTHON)" || { echo "no Python 3.12: install one (pyenv install 3.12) or pass PYTHON=..."; exit 2; }
	$(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null || \
	  { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,tpu]"
	touch $@

setup: $(VENV)/.installed

# XLA's CUDA compiler, for deviceless H200 compiles (benchmarks.gpu_compile and its test): a
# folder of its own, not the venv, where it would try to start CUDA in every CPU process.
GPU_COMPILE := .gpu-compile
# Its wheels are Linux x86-64 only: elsewhere the folder stays empty and its test is skipped.
$(GPU_COMPILE)/.installed: constraints.txt $(VENV)/.installed
	mkdir -p $(GPU_COMPILE)
	if [ "$$(uname -sm)" = "Linux x86_64" ]; then \
	  $(BIN)/pip install --quiet --no-deps --upgrade --target $(GPU_COMPILE) -c constraints.txt jax-cuda12-plugin jax-cuda12-pjrt; \
	else echo "no CUDA compiler wheels for $$(uname -sm): deviceless GPU compiles skipped"; fi
	touch $@

gpu-compile: $(GPU_COMPILE)/.installed

# MaxText 0.2.5, the trial program of `program: maxtext` spaces: its own environment (it needs
# Python >= 3.12 and pins libtpu 0.0.52; never imported by the engine). About 3.5 minutes.
# JAX is pinned to 0.12.0.1, the engine's: MaxText 0.2.5 admits 0.12.1, whose jnp.dot hands
# qwix 0.1.8's dot_general a `reduction_order` it does not take, so every fp8 recipe failed
# to compile (seen 2026-12-07). MAXTEXT_PYTHON: a Python 3.12 (default: the venv's).
MAXTEXT := .maxtext
MAXTEXT_PYTHON ?= $(PYTHON)
$(MAXTEXT)/.installed:
	test -x $(MAXTEXT)/bin/python || $(MAXTEXT_PYTHON) -m venv $(MAXTEXT)
	$(MAXTEXT)/bin/pip install --quiet --upgrade pip
	$(MAXTEXT)/bin/pip install --quiet 'maxtext[tpu]==0.2.5' 'jax==0.12.0.1' 'jaxlib==0.12.0.1'
	touch $@

maxtext: $(MAXTEXT)/.installed

run: setup
	$(BIN)/sweeper run spaces/$(SPACE).yaml

# Two workers: the suite is CPU-bound compiles and trainings, CI has 2 cores (TEST_WORKERS=0: one
# process). loadgroup: tests marked with one xdist_group share a worker, so a module fixture
# (a sweep, a Ray cluster, a pair of compiles) is built once, not once per worker.
TEST_WORKERS ?= 2
test: setup gpu-compile
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# What make test leaves out: real-size checks (the published 70B recipe against MaxText, about
# 15 minutes each here) and minute-long variants whose path a default test walks.
test-slow: setup
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

bench: setup
	$(BIN)/python -m benchmarks.trainer_throughput

clean:
	rm -rf $(VENV) $(GPU_COMPILE) results/mlflow.db results/optuna.db results/ray results/cache
