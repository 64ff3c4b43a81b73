# Two commands: `make lab` opens the course, `make test` runs every test. Both create or update
# .venv first: `make lab` installs the runtime alone (what a learner needs), `make test` adds the
# developer extras. A stamp per step: neither reinstalls unless pyproject.toml changed.
#
# Offline (a room without internet): `make wheelhouse` on a connected machine writes var/wheelhouse/;
# copy it to each machine, then `make lab WHEELHOUSE=path/to/wheelhouse` installs from it alone.

# The first interpreter that is Python 3.11 or newer.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; done)
VENV    := .venv
BIN     := $(VENV)/bin
RUNTIME := $(VENV)/.msglab-runtime
DEV     := $(VENV)/.msglab-dev
WHEELHOUSE ?=
# --no-compile: a module is compiled when first imported; compiling every file of every package at
# install time was a third of a fresh `make test`'s setup.
PIP     := $(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile \
	$(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE))
OUT     ?= var/learner-edition
WHEELS  ?= var/wheelhouse

.PHONY: lab test bench venv wheelhouse release clean

define new_venv
	@if [ -z "$(PYTHON)" ]; then echo "msglab needs Python 3.11 or newer; found: $$(python3 --version 2>&1)"; exit 2; fi
	@[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
endef

$(RUNTIME): pyproject.toml
	$(new_venv)
	$(PIP) -e .
	@touch $@

# One install for both (a second resolve costs seconds): on a fresh machine `make test` comes here first.
# uv (pinned) installs it in about 8 s where pip took 30-45 s of a fresh `make test`; pip stays the
# fallback, and the installer wherever pip's own settings must hold: a wheelhouse, a PIP_INDEX_URL
# (uv does not read them), and `make lab` (what a learner runs).
# Then rfc3987-syntax goes (and lark, which only it needs): jsonschema's optional IRI format check, whose
# import builds 38 Earley parsers, 1-2 s of CPU in each of a run's processes that import jsonschema
# (every pytest worker through nbval, every JupyterLab, every nbclient), for a check nothing here uses.
UV := uv==0.13.9
UNUSED := rfc3987-syntax lark
$(DEV): pyproject.toml
	$(new_venv)
	@if [ -z "$(WHEELHOUSE)" ] && [ -z "$$PIP_INDEX_URL" ] && $(PIP) $(UV) >/dev/null 2>&1; then \
		echo "$(BIN)/uv pip install -e '.[dev]'"; $(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev]'; \
	else echo "$(PIP) -e '.[dev]'"; $(PIP) -e '.[dev]'; fi
	$(BIN)/python -m pip uninstall --quiet -y $(UNUSED)
	@touch $(RUNTIME) $@

venv: $(RUNTIME)

lab: $(RUNTIME)
	$(BIN)/msglab lab

# ruff first (a second), then every test and notebook against real servers, with mypy beside them
# (a dozen seconds of one core; its report follows pytest's; both must pass). DEPTH=quick grades
# a share of the known lab files, each on one of its seeds (another share each commit); DEPTH=deep
# all of them on all their seeds.
DEPTH ?= quick
# Bytecode is cached in var/pycache whatever the environment says: with PYTHONDONTWRITEBYTECODE set (and
# pip's --no-compile) each of a run's hundreds of Python processes compiled the same modules again.
test: export PYTHONDONTWRITEBYTECODE =
test: export PYTHONPYCACHEPREFIX = $(CURDIR)/var/pycache
test: $(DEV)
	$(BIN)/ruff check --no-cache msglab tests scripts conftest.py
	$(BIN)/ruff format --no-cache --check msglab tests scripts conftest.py
	@typing=$$(mktemp); $(BIN)/mypy > $$typing 2>&1 & mypy=$$!; \
	MSGLAB_TEST_DEPTH=$(DEPTH) $(BIN)/python -m pytest; tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy: $$(cat $$typing)"; rm -f $$typing; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

bench: $(DEV)
	$(BIN)/python scripts/bench.py

# Every wheel `make lab` needs, plus setuptools and wheel to install the course from them, built for
# this machine's platform and Python. For another room's, name it (wheels only, no builds):
# `make wheelhouse WHEEL_PLATFORM=macosx_11_0_arm64 WHEEL_PYTHON=3.12`.
DEPENDENCIES = $$($(BIN)/python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
wheelhouse: $(RUNTIME)
	@mkdir -p $(WHEELS)
	$(if $(WHEEL_PLATFORM),\
	$(BIN)/python -m pip download --quiet --disable-pip-version-check --dest $(WHEELS) --only-binary=:all: \
		--platform $(WHEEL_PLATFORM) $(if $(WHEEL_PYTHON),--python-version $(WHEEL_PYTHON)) \
		$(DEPENDENCIES) "setuptools>=68" wheel,\
	$(BIN)/python -m pip wheel --quiet --disable-pip-version-check --wheel-dir $(WHEELS) \
		$(DEPENDENCIES) "setuptools>=68" wheel)
	@echo "$(WHEELS): $$(ls $(WHEELS) | wc -l) wheels, $$(du -sh $(WHEELS) | cut -f1); in the room: make lab WHEELHOUSE=$(WHEELS)"

# The learner edition, from the last commit (no solutions/, no code-level hints; every starter graded
# once): `make release OUT=../msglab-learners`; RELEASE_FLAGS="--allow-dirty --code-hints" and the like pass on.
release: $(RUNTIME)
	$(BIN)/msglab release --out $(OUT) --replace $(RELEASE_FLAGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache var/pycache
