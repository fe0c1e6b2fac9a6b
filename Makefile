# Two entry points (see README): `make demo` and `make test`. Both build .venv from this
# project's own files first, so they work on a fresh machine with only Python 3.11.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tpusim demo --out demo-out

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 tests
	$(BIN)/python -m pytest --nbmake -n 2 notebooks

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_collectives.py

clean:
	rm -rf $(VENV) demo-out
