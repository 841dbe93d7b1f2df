# RACoN: `make run` starts everything, `make test` runs the suite. Both install what is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.racon-installed

.PHONY: run test install lint bench clean-venv

$(PY):
	"$$(scripts/find-python.sh)" -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip wheel setuptools

$(STAMP): pyproject.toml scripts/install-llama.sh scripts/build-llama.sh | $(PY)
	scripts/install-llama.sh $(VENV)
	$(VENV)/bin/pip install -q -e '.[controller,agent,cli,test]'
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(PY) -m racon.launcher

test: install
	scripts/install-chromium.sh
	$(PY) -m pytest $(PYTEST_ARGS)

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
