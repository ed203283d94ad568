# Two entry points, both safe on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --no-cache-dir --constraint constraints.txt
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest compat-oldest matrix dist docs bench clean olmo-core-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e '.[test,dev,integrations,docs,examples,plot]'
	touch $(STAMP)

# The demo needs only torch, clipopt, the progress bar and the plot: not the test,
# framework and docs extras `make test` installs.
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e '.[examples,plot]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python examples/quickstart.py

lint: $(STAMP)
	$(BIN)/ruff check clipopt tests examples benchmarks scripts
	$(BIN)/ruff format --check clipopt tests examples benchmarks scripts

typecheck: $(STAMP)
	$(BIN)/mypy clipopt

pytest: $(STAMP)
	$(BIN)/python -m pytest

# The compat subset on the oldest torch clipopt supports, in a venv of its own under
# .cache/ (the pinned torch, the newest, runs the whole suite above); `make matrix` runs
# it on every supported release.
OLDEST_TORCH := 2.6.0
compat-oldest:
	scripts/torch_matrix.sh $(OLDEST_TORCH)

matrix:
	scripts/torch_matrix.sh

# An sdist and a pure-Python wheel (py3-none-any), each installed into a fresh venv and
# checked there.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	scripts/check_dist.sh $(PYTHON) dist $(BIN)/python

# The documentation site, into site/. --strict turns every warning into a failure: a
# broken link or anchor, a page missing from the nav, a ::: reference that does not resolve.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

test: lint typecheck pytest compat-oldest docs dist

# The frameworks page's OLMo-core recipe inside OLMo-core 3.0.0, which needs torch<2.14
# and so cannot join .venv (torch 2.14.1): a venv of its own under .cache/, torch 2.13.0.
OLMO_VENV := .cache/olmo-core
olmo-core-check:
	test -x $(OLMO_VENV)/bin/python || $(PYTHON) -m venv $(OLMO_VENV)
	$(OLMO_VENV)/bin/python -m pip install --quiet --no-cache-dir torch==2.13.0 \
		ai2-olmo-core==3.0.0 numpy==2.4.6
	PYTHONPATH=$(CURDIR) $(OLMO_VENV)/bin/python scripts/olmo_core_recipe.py

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) .cache site quickstart-out .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist

# On a CUDA machine: every CUDA test, the host-sync tests and the CUDA benchmark, in
# under 8 minutes, writing to $(OUT) if set (else benchmarks/results/). Installs nothing:
# it uses .venv/bin/python or python3, whichever has a torch that sees the GPU.
.PHONY: gpu-check
gpu-check:
	bash benchmarks/gpu_check.sh
