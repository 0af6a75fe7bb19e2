# Quick start: `make demo` runs the multi-agent example; `make test` runs the test suite.
# Both set up .venv first (torch, the package, the default model).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean
setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/kvcmas demo

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
