# Two entry points for a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-busy fuzz bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	@echo "batchcraft: installing into $(VENV) (pinned CPU PyTorch, test and benchmark extras; about 1.5 min, once)"
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/batchcraft run treelstm

test: $(STAMP)
	$(BIN)/python -m pytest

# The tests next to a CPU hog: one busy loop per usable core, killed (by pid) when the tests end,
# however they end. BUSY_TESTS picks the tests (default: the parallelism and CLI tests, whose
# processes and budgets a busy machine stresses most); `make test-busy BUSY_TESTS=tests` runs all.
BUSY_TESTS ?= tests/parallel tests/cli
test-busy: $(STAMP)
	@hogs=""; \
	trap 'kill $$hogs 2>/dev/null; wait $$hogs 2>/dev/null' EXIT INT TERM HUP; \
	for i in $$(seq $$($(BIN)/python -c "import os; print(len(os.sched_getaffinity(0)))")); do \
		sh -c 'while :; do :; done' & hogs="$$hogs $$!"; \
	done; \
	echo "test-busy: CPU hog pids$$hogs"; \
	$(BIN)/python -m pytest $(BUSY_TESTS)

fuzz: $(STAMP)
	BATCHCRAFT_FUZZ_PROFILE=long $(BIN)/python -m pytest tests/autobatching/test_fuzz.py -q

bench: $(STAMP)
	$(BIN)/python benchmarks/treelstm.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
