# Set-up contract: `make setup` (idempotent), `make test` (set-up + whole suite), `make serve`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test serve clean-venv

setup: $(STAMP)
	@$(PY) -m tools.fetch_model

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) with $$($(PYTHON) --version)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing pinned dependencies (MindSpore is ~800 MB; the first run takes a few minutes)"
	@$(PY) -m pip install --upgrade --progress-bar off -q pip
	@$(PY) -m pip install --progress-bar off -e '.[dev]'
	@touch $(STAMP)

test: setup
	@$(PY) -m pytest

# The HTTP front end (start_server.py) is not built yet: for now this serves the agents only.
serve: setup
	@echo "==> starting the agents (Ctrl-C or SIGTERM stops them); the HTTP server is not built yet"
	@$(PY) start_agent.py

clean-venv:
	rm -rf $(VENV)
