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

# The fast suite on one worker per core (at most 4; pytest-xdist), whole files per worker so each
# file's fixtures are built once.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)
