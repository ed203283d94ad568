# Two entry points, both safe on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --constraint constraints.txt
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml setup.py constraints.txt clipopt/_native.c
	$(PIP) -e '.[test,dev,integrations]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

lint: $(STAMP)
	$(BIN)/ruff check clipopt tests examples benchmarks setup.py
	$(BIN)/ruff format --check clipopt tests examples benchmarks setup.py

typecheck: $(STAMP)
	$(BIN)/mypy clipopt

pytest: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build clipopt/*.so

# On a CUDA machine: every CUDA test, the host-sync tests and the CUDA benchmark, in
# under 8 minutes, writing to $(OUT) if set (else benchmarks/results/). Installs nothing:
# it uses .venv/bin/python or python3, whichever has a torch that sees the GPU.
.PHONY: gpu-check
gpu-check:
	bash benchmarks/gpu_check.sh
