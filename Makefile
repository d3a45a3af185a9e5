# Quick start: `make run` (the default experiment) and `make test` (the fast suite).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.servelab-installed

.PHONY: run test test-slow install

$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) run.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)
