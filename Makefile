# shoal: one entry point for setup, code generation, the example and the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-stamp

.PHONY: setup proto run test test-fast clean mutate docs

# Installs every Python and Debian package the project and its tests need.
setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt scripts/setup-system.sh
	bash scripts/setup-system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# Regenerates proto/*_pb2*.py from proto/shoal.proto.
proto: setup
	$(PY) scripts/gen_proto.py

# Trains the digits example on a local cluster (chief, 2 ps, 2 workers).
run: setup
	$(VENV)/bin/shoal local --ps 2 --workers 2 --mode sync --run-dir runs --summary runs/summary.json examples/digits.py

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -m 'not system'

# Builds the documentation site into build/site (strict: a broken link, a missing page or an undocumented
# public name fails it; no network needed). Open build/site/index.html, or serve it: $(VENV)/bin/mkdocs serve
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Mutation testing of the invariant-carrying modules (scripts/mutate.py; hours for all of them on 2 cores).
# Not part of test. MODULES="ps/ledger.py chief/tasks.py" picks some; MUTATE_ARGS="--resume" goes on.
mutate: setup
	$(PY) scripts/mutate.py $(MUTATE_ARGS) $(MODULES)

clean:
	rm -rf $(VENV) build *.egg-info runs .pytest_cache
