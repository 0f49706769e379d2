# Two commands: `make demo` (a small Qwen3 pretraining run with Trainer(strategy="d9d")) and `make test`.
# Both create .venv on first use. Without an NVIDIA GPU the CPU build of torch is installed, never a CUDA one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.11,torch==2.13.0+cpu)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: demo test lint venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: installing lightning into an empty environment would pull a multi-GB CUDA torch.
	$(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q --index-url $(TORCH_CPU_INDEX) "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	touch $@

demo: venv
	$(PY) examples/pretrain_qwen3.py $(DEMO_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) lightning_logs checkpoints .pytest_cache .mypy_cache .ruff_cache
