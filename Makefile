# Two commands for a newcomer: `make demo` and `make test`. Both build .venv themselves.
# DS_BUILD_OPS=0: DeepSpeed (dev extra) installs without compiling its ops; the tests run it on CPU.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: venv test test-stack2 test-minimal lint demo screenshots bench gpu-check clean

# `make test` installs the dev extras (2.4 GB: DeepSpeed, TRL, Playwright, ...); `make demo` only what the
# demo needs (the `demo` extra: the example's data and metrics, and matplotlib for the picture).
define make_venv
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e ".[$(1)]"
	touch $@
endef

$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(call make_venv,dev)

$(DEMO_STAMP): setup.cfg pyproject.toml constraints.txt
	$(call make_venv,demo)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check hf_memwatch tests examples benchmarks

# Two pytest workers, one per core; a test file stays on one worker (its module fixtures run once), files
# handed out heaviest first (tests/conftest.py SLOWEST_FIRST; --no-loadscope-reorder keeps that order).
test: lint
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=15 --doctest-modules hf_memwatch tests

# The second CI stack (docs/compat.md): transformers 4.57 with its accelerate, trl, peft (constraints-stack2.txt),
# in a venv over .venv (its .pth adds .venv's site-packages, .pth files included, after its own: torch and the
# rest come from there). The core subset: MemWatch's numerics and classes, estimate vs the profiler, the auto
# mode, the CLI, the probes' contracts (about 3 minutes on 2 cores); not part of `make test`.
STACK2 := .venv-stack2
STACK2_STAMP := $(STACK2)/.installed
STACK2_TESTS := tests/test_compat.py tests/test_compat_probes.py tests/test_memwatch.py tests/test_cli_estimate.py \
	"tests/test_estimate.py::test_more_architecture_families_match_profiler_truth[albert-bf16-gemm-workspace]" \
	"tests/test_estimate.py::test_more_architecture_families_match_profiler_truth[deberta_v2-nonzero]" \
	"tests/test_estimate.py::test_more_architecture_families_match_profiler_truth[gemma2-checkpointing]" \
	"tests/test_estimate.py::test_peak_matches_profiler_truth_of_a_real_trainer_run[gpt2-fp32-adamw]" \
	"tests/test_estimate.py::test_peak_matches_profiler_truth_of_a_real_trainer_run[llama-bf16-checkpointing]" \
	tests/test_estimate.py::test_config_and_built_model_give_the_same_estimate \
	tests/test_estimate.py::test_forward_backward_only_of_a_trainer_is_its_step_without_optimizer_states \
	tests/test_auto.py::test_over_budget_run_fits_and_equals_the_hand_configured_plan tests/test_expert_loop.py

$(STACK2_STAMP): $(STAMP) constraints-stack2.txt
	rm -rf $(STACK2)
	$(PYTHON) -m venv $(STACK2)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(STACK2)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_pinned_venv.pth"
	$(STACK2)/bin/python -m pip install -q --no-deps -r constraints-stack2.txt
	touch $(STACK2_STAMP)

test-stack2: $(STACK2_STAMP)
	$(STACK2)/bin/python -c "import transformers, torch; print('stack2: transformers', transformers.__version__, 'torch', torch.__version__)"
	$(STACK2)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=10 $(STACK2_TESTS)

# A venv with only the required dependencies (no extra): every optional feature says what is off in one
# line and writes its fallback (tests/test_extras.py, real absences instead of simulated ones); in .ci/run.
MINIMAL := .venv-minimal
MINIMAL_STAMP := $(MINIMAL)/.installed

$(MINIMAL_STAMP): setup.cfg pyproject.toml constraints.txt
	rm -rf $(MINIMAL)
	$(PYTHON) -m venv $(MINIMAL)
	$(MINIMAL)/bin/python -m pip install -q --upgrade pip
	$(MINIMAL)/bin/python -m pip install -q -c constraints.txt torch==2.13.0
	$(MINIMAL)/bin/python -m pip install -q -c constraints.txt -e . pytest
	touch $(MINIMAL_STAMP)

test-minimal: $(MINIMAL_STAMP)
	$(MINIMAL)/bin/python -c "import importlib.util as u; extras = [m for m in ('matplotlib', 'plotly', 'peft', \
		'bitsandbytes', 'trl', 'deepspeed', 'datasets') if u.find_spec(m)]; assert not extras, extras"
	$(MINIMAL)/bin/python -m pytest -q -p no:cacheprovider tests/test_extras.py tests/test_figures.py

# The console is kept (demo-output/console.txt) and its transcript written to docs/demo-transcript.txt, the
# README's "make demo" block (tests/test_example.py keeps the two equal).
demo: SHELL := /bin/bash
demo: $(DEMO_STAMP)
	rm -rf demo-output && mkdir -p demo-output
	set -o pipefail; $(PY) examples/train_glue.py --auto --budget 420MiB --output-dir demo-output 2>&1 \
		| tee demo-output/console.txt
	$(PY) examples/transcript.py demo-output/console.txt docs/demo-transcript.txt

bench: venv
	$(PY) benchmarks/overhead.py --out benchmarks/results/overhead.md
	$(PY) benchmarks/fixed_cost.py --out benchmarks/results/fixed_cost.md
	$(PY) benchmarks/estimate_cost.py --out benchmarks/results/estimate_cost.md
	$(PY) benchmarks/planning_cost.py --out benchmarks/results/planning_cost.md
	$(PY) benchmarks/accuracy.py
	$(PY) benchmarks/peft_accuracy.py
	$(PY) benchmarks/trl_accuracy.py
	$(PY) benchmarks/autotune.py
	$(PY) benchmarks/lengths.py --out benchmarks/results/lengths.md
	$(PY) benchmarks/eval_accuracy.py
	$(PY) benchmarks/perturbation.py
	$(PY) benchmarks/start_fast.py --out benchmarks/results/start_fast.md
	$(PY) benchmarks/cuda_published.py --out benchmarks/results/cuda_published.md
	$(PY) benchmarks/sweep.py --draws 150 --out benchmarks/results/sweep.md
	$(PY) benchmarks/sweep.py --depth-only --draws 150 --out benchmarks/results/sweep.md
	$(PY) benchmarks/sweep_ranks.py --draws 48 --out benchmarks/results/sweep.md
	$(PY) benchmarks/sweep_ranks.py --repeat 3 --seeds 2 3 6 10 11 12 14 15 18 22 27 28 35 --out benchmarks/results/sweep.md

# The docs' screenshots (docs/page.png, page-seconds.png, page-compare.png, example-memory.png): the demo's
# run and the same example without --auto (the configuration as given), in headless Chromium (Debian's
# chromium, Playwright from the dev extras); benchmarks/page_build.py measures the page itself.
screenshots: venv
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	test -d demo-output || $(MAKE) demo
	$(PY) examples/train_glue.py --output-dir demo-output-as-given > demo-output-as-given.log 2>&1
	$(PY) examples/screenshots.py demo-output demo-output-as-given docs/

gpu-check: venv
	$(PY) benchmarks/gpu_check.py --out benchmarks/results/gpu

clean:
	rm -rf $(VENV) $(STACK2) $(MINIMAL) demo-output demo-output-as-given demo-output-as-given.log
