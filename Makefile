# Quick start: `make train` runs the default job, `make test` runs the test suite.
# Both set up .venv first (scripts/setup.sh, idempotent).
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup train test test-slow

setup:
	@ANABRANCH_VENV=$(VENV) bash scripts/setup.sh

train: setup
	$(VENV)/bin/anabranch train $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-slow: setup
	$(VENV)/bin/python -m pytest -m slow $(PYTEST_ARGS)
