# Two commands: `make demo` (a small Qwen3 pretraining run with Trainer(strategy="d9d")) and `make test`.
# Both create .venv on first use. Without an NVIDIA GPU the CPU build of torch is installed where it can be had.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# The tested range (pyproject.toml's bound). Without a GPU: the CPU build of a tested version, a local version
# that PyPI does not host, so it comes from the configured index (a local wheel cache) or PyTorch's CPU index.
TORCH_RANGE := torch>=2.11,<2.14
TORCH_CPU_SPEC := torch==2.13.0+cpu
TORCH_SPEC ?= $(if $(HAS_GPU),$(TORCH_RANGE),$(TORCH_CPU_SPEC))
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# Last resort without a GPU (a machine that reaches only PyPI, or a Python without that wheel): PyPI's torch.
TORCH_PYPI_SPECS ?= torch==2.13.0 $(TORCH_RANGE)
LITGPT_SPEC := litgpt==0.5.13
DEMO_ARGS ?=
PYTEST_ARGS ?=
# One pytest worker per core, a test file per worker at a time (a file's grouped launch runs once, in one
# worker; tests/conftest.py keeps the files that share one launch together): the suite is CPU-bound and one
# worker leaves a third of two cores idle between its launches.
PYTEST_WORKERS ?= auto

.PHONY: demo test lint venv install-torch clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: installing lightning into an empty environment would pull a multi-GB CUDA torch.
	$(MAKE) --no-print-directory install-torch
	$(PY) -c "import torch; print('torch', torch.__version__, 'CUDA build' if torch.version.cuda else 'CPU build')"
	$(PIP) install -q -e ".[test]"
	# litgpt (a test dependency: its GPT under Fabric(strategy="d9d")) pins huggingface-hub<1.4, which the
	# transformers releases we test (>= 5.25 needs hub >= 2.4) refuse; its model code needs neither, so it
	# comes without its dependencies (psutil, which it imports, is in the test extra).
	$(PIP) install -q --no-deps "$(LITGPT_SPEC)"
	touch $@

# The first of these that installs wins: TORCH_SPEC from the configured index; without a GPU, then from
# TORCH_CPU_INDEX; then each of TORCH_PYPI_SPECS from the configured index, saying what was installed and why.
install-torch:
	@if $(PIP) install -q "$(TORCH_SPEC)"; then echo "torch: installed $(TORCH_SPEC)"; exit 0; fi; \
	if [ -n "$(HAS_GPU)" ]; then \
		echo "torch: ERROR: could not install $(TORCH_SPEC) (see pip's message above)." >&2; exit 1; \
	fi; \
	echo "torch: $(TORCH_SPEC) is not on the configured index; trying PyTorch's CPU index $(TORCH_CPU_INDEX)"; \
	if $(PIP) install -q --retries 1 --timeout 20 --index-url $(TORCH_CPU_INDEX) "$(TORCH_SPEC)"; then \
		echo "torch: installed $(TORCH_SPEC) from $(TORCH_CPU_INDEX)"; exit 0; \
	fi; \
	for spec in $(foreach spec,$(TORCH_PYPI_SPECS),'$(spec)'); do \
		echo "torch: trying $$spec from the configured index (PyPI)"; \
		if $(PIP) install -q "$$spec"; then \
			echo "torch: NOTE: installed $$spec instead of $(TORCH_SPEC), which neither the configured index" \
				"nor $(TORCH_CPU_INDEX) had for this Python (or that index is unreachable). On Linux, PyPI's" \
				"torch is the CUDA build: a multi-GB download, which also runs on CPU."; \
			exit 0; \
		fi; \
	done; \
	echo "torch: ERROR: could not install torch: tried $(TORCH_SPEC) (configured index, then" \
		"$(TORCH_CPU_INDEX)), then $(TORCH_PYPI_SPECS) (configured index). Install a torch in $(TORCH_RANGE)" \
		"into $(VENV) yourself ($(PIP) install ...), then run make again." >&2; \
	exit 1

demo: venv
	$(PY) examples/pretrain_qwen3.py $(DEMO_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) lightning_logs checkpoints .pytest_cache .mypy_cache .ruff_cache
