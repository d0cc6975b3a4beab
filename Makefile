# Two entry points, both self-contained on a fresh machine (Python >= 3.10):
#   make demo   set up .venv and run the demo on a tiny locally built model
#   make test   set up .venv, lint, install redis-server if missing, run the test suite
# the README's plots, redrawn from the benchmarks' CSVs in docs/data/:
#   make plots
# and one for a benchmark's peer:
#   make vllm-mlx   set up .venv-vllm-mlx (vllm-mlx 0.6.0) for tools/bench_reuse_serve.py
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# MLX's backend, a prefixcache extra: cpu on Linux (BACKEND=cuda for an NVIDIA GPU);
# on macOS plain mlx brings Metal
BACKEND ?= $(if $(filter Linux,$(shell uname -s)),cpu,)
comma := ,
EXTRAS := dev$(if $(BACKEND),$(comma)$(BACKEND),)

.PHONY: demo test setup lint redis-server vllm-mlx plots

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

# docs/reuse_per_arch.png and docs/budget.png from docs/data/*.csv (tools/plots.py says
# which benchmark writes each CSV)
plots: setup
	$(BIN)/python tools/plots.py

# vllm-mlx, a peer of tools/bench_reuse_serve.py, in a venv of its own: it pins
# mlx-lm < 0.32 (ours: 0.32). --no-deps leaves out what serving text does not use
# (gradio, opencv, torchvision, mlx-vlm, mcp, ...); its server's own needs follow it.
# Its console script is installed last, so it marks a finished venv.
VLLM_MLX_VENV := .venv-vllm-mlx
VLLM_MLX_BIN := $(VLLM_MLX_VENV)/bin

$(VLLM_MLX_BIN)/vllm-mlx:
	$(PYTHON) -m venv $(VLLM_MLX_VENV)
	$(VLLM_MLX_BIN)/pip install --quiet --upgrade pip
	$(VLLM_MLX_BIN)/pip install --quiet 'mlx$(if $(BACKEND),[$(BACKEND)],)' 'mlx-lm>=0.31.3,<0.32'
	$(VLLM_MLX_BIN)/pip install --quiet 'fastapi>=0.100.0' 'starlette>=1.0.1' \
		'uvicorn>=0.23.0' 'jsonschema>=4.0.0' 'requests>=2.28.0' python-multipart \
		'prometheus-client>=0.20.0' 'psutil>=5.9.0'
	$(VLLM_MLX_BIN)/pip install --quiet --no-deps 'vllm-mlx==0.6.0'

vllm-mlx: $(VLLM_MLX_BIN)/vllm-mlx
