# InferScale developer entry points. `make demo` and `make test` set everything up first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test fidelity locomo clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	PY=$(PY) VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

demo: setup
	$(BIN)/inferscale demo

test: setup
	$(BIN)/python -m pytest -q --durations=10 tests

fidelity: setup
	$(BIN)/python benchmarks/fidelity.py --quick

locomo: setup
	$(BIN)/python benchmarks/locomo.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
