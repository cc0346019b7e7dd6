# Two commands for a fresh machine with Python 3.10+:  `make demo`  and  `make test`.
# TORCH_SPEC picks the torch build; the default is the CPU wheel this project is developed against.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo compose test test-fast lint format install bench proto clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m swarm demo

# The Docker Compose demo swarm (deploy/docker-compose.yml): build, run, print the loss and whether the replicas
# agree, take it all down. COMPOSE_FLAGS=--offline builds without Docker Hub, through this host's pip setup; as root
# where no Docker engine runs, one is installed and started for the run (deploy/README.md).
COMPOSE_FLAGS ?=
compose: $(STAMP)
	$(PY) -m deploy.compose $(COMPOSE_FLAGS)

test: $(STAMP)
	$(PY) -m pytest -q

# The unit and integration tiers (no multi-process swarm, no namespaces; see tests/conftest.py): 7-10 minutes on 2 cores.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "unit or integration"

# What CI checks before the tests: the tree is formatted and passes the linter (configuration in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

proto: $(STAMP)
	$(PY) -m swarm.proto.generate

clean:
	rm -rf $(VENV) build *.egg-info
