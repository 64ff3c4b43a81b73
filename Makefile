# Two commands: `make lab` opens the course, `make test` runs every test. Both create or update
# .venv first (it is rebuilt only when pyproject.toml changes).

# The first interpreter that is Python 3.11 or newer.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; done)
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.msglab-installed

.PHONY: lab test bench venv clean

$(STAMP): pyproject.toml
	@if [ -z "$(PYTHON)" ]; then echo "msglab needs Python 3.11 or newer; found: $$(python3 --version 2>&1)"; exit 2; fi
	@[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $@

venv: $(STAMP)

lab: venv
	$(BIN)/msglab lab

# Static checks first (seconds), then every test and notebook against real servers.
test: venv
	$(BIN)/ruff check msglab tests scripts
	$(BIN)/ruff format --check msglab tests scripts
	$(BIN)/mypy
	$(BIN)/python -m pytest

bench: venv
	$(BIN)/python scripts/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
