# Two commands for a newcomer: `make demo` and `make test`. Both build .venv themselves.
# DS_BUILD_OPS=0: DeepSpeed (dev extra) installs without compiling its ops; the tests run it on CPU.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: venv test lint demo bench gpu-check clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check hf_memwatch tests examples benchmarks

# Two pytest workers, one per core; a test file stays on one worker (its module fixtures run once), files
# handed out heaviest first (tests/conftest.py SLOWEST_FIRST; --no-loadscope-reorder keeps that order).
test: lint
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=15 --doctest-modules hf_memwatch tests

demo: venv
	rm -rf demo-output
	$(PY) examples/train_glue.py --auto --budget 420MiB --output-dir demo-output

bench: venv
	$(PY) benchmarks/overhead.py --out benchmarks/results/overhead.md
	$(PY) benchmarks/fixed_cost.py --out benchmarks/results/fixed_cost.md
	$(PY) benchmarks/estimate_cost.py --out benchmarks/results/estimate_cost.md
	$(PY) benchmarks/accuracy.py
	$(PY) benchmarks/peft_accuracy.py
	$(PY) benchmarks/trl_accuracy.py
	$(PY) benchmarks/autotune.py
	$(PY) benchmarks/lengths.py --out benchmarks/results/lengths.md
	$(PY) benchmarks/eval_accuracy.py
	$(PY) benchmarks/perturbation.py
	$(PY) benchmarks/start_fast.py --out benchmarks/results/start_fast.md
	$(PY) benchmarks/sweep.py --draws 150 --out benchmarks/results/sweep.md

gpu-check: venv
	$(PY) benchmarks/gpu_check.py --out benchmarks/results/gpu

clean:
	rm -rf $(VENV) demo-output
