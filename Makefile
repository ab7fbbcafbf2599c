# Quick start:  make train   (set up and run the embedded default job)
#               make test    (set up and run the test suite)
#               make test-gpu (on a GPU machine: every gpu- and triton-marked test, recorded in benchmarks/results/gpu_suite/)
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch 2.13 installs from local disk on the development machines; on a GPU
# machine set TORCH='torch>=2.11,<2.15' (or keep the torch you have: make TORCH= ...).
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if [ -n "$(TORCH)" ]; then $(BIN)/pip install -q "$(TORCH)"; fi

$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

.PHONY: setup train test test-all test-gpu lint clean bench
setup: $(VENV)/.installed

# settings for the run: make train ARGS="--train.resume true"
ARGS ?=
train: setup
	$(BIN)/megaseq train $(ARGS)

# the CPU suite over up to 4 worker processes (pytest-xdist; one per core)
test: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -m "not gpu and not slow" -n auto --maxprocesses=4 --durations=15

# everything `test` runs plus the tests marked slow (the rest of the fault-injection suite and the published
# configs' plans), over the same workers
test-all: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -m "not gpu" -n auto --maxprocesses=4 --durations=15

# the whole gpu-marked suite in one pytest run, with the python of $(VENV) where it exists, else $(PYTHON) (a
# GPU machine with megaseq's dependencies installed); writes benchmarks/results/gpu_suite/latest.json
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
test-gpu:
	$(GPU_PYTHON) benchmarks/gpu_suite.py

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) runs

# a benchmark stage (benchmarks/run.sh lists them): make bench STAGE=speed; on a GPU machine, with its CUDA
# torch: make bench STAGE=speed PY=python3
STAGE ?=
bench:
	PY=$(or $(PY),$(BIN)/python) bash benchmarks/run.sh $(STAGE)
