# Two entry points, both self-contained on a fresh machine (Python >= 3.10):
#   make demo   set up .venv and run the demo on a tiny locally built model
#   make test   set up .venv, lint, install redis-server if missing, run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# MLX's backend, a prefixcache extra: cpu on Linux (BACKEND=cuda for an NVIDIA GPU);
# on macOS plain mlx brings Metal
BACKEND ?= $(if $(filter Linux,$(shell uname -s)),cpu,)
comma := ,
EXTRAS := dev$(if $(BACKEND),$(comma)$(BACKEND),)

.PHONY: demo test setup lint redis-server

$(BIN)/prefixcache: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

setup: $(BIN)/prefixcache

demo: setup
	$(BIN)/prefixcache demo

# The size rule (one concept per module) lives in tests/test_structure.py.
lint: setup
	$(BIN)/ruff check prefixcache tests tools
	$(BIN)/pytest -q -p no:cacheprovider tests/test_structure.py
	$(BIN)/ruff format --check prefixcache tests tools

# the remote tier's tests start their own redis-server, cluster and TLS server (never a
# system service): redis-server, and redis-cli for `--cluster create` (redis-tools); the
# TLS tests make their CA with the cryptography package (the remote extra)
redis-server:
	@(command -v redis-server && command -v redis-cli) >/dev/null || \
		(apt-get update && apt-get install -y redis-server redis-tools)

test: lint redis-server
	$(BIN)/pytest
