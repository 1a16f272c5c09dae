# Two entry points for a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test fuzz bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/batchcraft run treelstm

test: $(STAMP)
	$(BIN)/python -m pytest

fuzz: $(STAMP)
	BATCHCRAFT_FUZZ_PROFILE=long $(BIN)/python -m pytest tests/autobatching/test_fuzz.py -q

bench: $(STAMP)
	$(BIN)/python benchmarks/treelstm.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
