# RACoN: `make run` starts everything, `make test` runs the suite. Both install what is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.racon-installed

.PHONY: run test test-load install lint bench clean-venv

$(PY):
	"$$(scripts/find-python.sh)" -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip wheel setuptools

# The llama.cpp build is keyed by the platform (CPU features and GPU backends, e.g. ...-cpu-rpc-vulkan:
# scripts/platform-key.sh): a machine that gains a backend (make test installs Vulkan first) gets
# that build installed into the venv on the next make.
LLAMA_KEY := $(shell scripts/platform-key.sh 2>/dev/null)
LLAMA_STAMP := $(VENV)/.racon-llama-$(LLAMA_KEY)

$(LLAMA_STAMP): scripts/install-llama.sh scripts/build-llama.sh scripts/platform-key.sh | $(PY)
	scripts/install-llama.sh $(VENV)
	@rm -f $(VENV)/.racon-llama-* && touch $(LLAMA_STAMP)

$(STAMP): pyproject.toml $(LLAMA_STAMP) | $(PY)
	$(VENV)/bin/pip install -q -e '.[controller,agent,cli,test,desktop]'
	@touch $(STAMP)

# RACON_ENGINES=llamacpp,vllm: also the vLLM engine venv and SmolLM2's safetensors directory (cached).
install: $(STAMP)
	@case ",$${RACON_ENGINES:-}," in *,vllm,*) scripts/install-vllm.sh >/dev/null ;; esac

run: install
	$(PY) -m racon.launcher

# The Vulkan packages come before the build (a sub-make, so the platform key is read after them):
# this machine kind then makes one cpu+rpc+vulkan llama.cpp build for the whole suite.
test:
	scripts/install-vulkan.sh
	$(MAKE) install
	scripts/install-chromium.sh
	scripts/install-desktop.sh
	scripts/install-vllm.sh  # the vLLM engine venv and the SmolLM2 safetensors directory (cached)
	$(PY) -m pytest $(PYTEST_ARGS)

# The timing-sensitive tests (e2e, cluster, TUI, reliability) with one core kept busy by a
# bounded burner; prints the burner's CPU share. Run on its own, not in CI.
test-load: install
	scripts/install-chromium.sh
	$(PY) scripts/test-load.py -- $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: install
	$(PY) bench/scheduler.py
	$(PY) bench/heartbeats.py
	$(PY) bench/gateway.py

clean-venv:
	rm -rf $(VENV)
