# Two entry points (README): `make run` sets up and runs the main job, `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SPACE ?= moe_short

.PHONY: setup run test test-slow lint bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,tpu]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/sweeper run spaces/$(SPACE).yaml

# Two workers: the suite is CPU-bound compiles and trainings, CI has 2 cores (TEST_WORKERS=0: one process).
TEST_WORKERS ?= 2
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Real-size checks (the published 70B recipe against MaxText): about 15 minutes each here.
test-slow: setup
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m benchmarks.trainer_throughput

clean:
	rm -rf $(VENV) results/mlflow.db results/optuna.db results/ray results/cache
