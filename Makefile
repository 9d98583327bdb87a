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

serve: setup
	@$(PY) -m tools.serve

clean-venv:
	rm -rf $(VENV)
