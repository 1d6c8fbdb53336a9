# InferScale developer entry points. `make demo` and `make test` set everything up first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# third-party clients the tests run against the server (mem0ai), in an environment of their own
CLIENTS := .venv-clients/.installed

.PHONY: setup clients demo test fidelity locomo eval-model clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	PY=$(PY) VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

clients: $(CLIENTS)

$(CLIENTS): scripts/setup_client_tests.sh
	PY=$(PY) CLIENT_VENV=.venv-clients bash scripts/setup_client_tests.sh
	touch $(CLIENTS)

demo: setup
	$(BIN)/inferscale demo

test:  # the two environments install side by side
	$(MAKE) -j2 setup clients
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=10 tests

fidelity: setup
	$(BIN)/python benchmarks/fidelity.py --quick

locomo: setup
	$(BIN)/python benchmarks/locomo.py --quick

eval-model: setup  # Qwen2.5-Coder-1.5B-Instruct: then --model qwen2.5-coder-1.5b anywhere a model is taken
	$(BIN)/inferscale models add qwen2.5-coder-1.5b

clean:
	rm -rf $(VENV) .venv-clients build *.egg-info
