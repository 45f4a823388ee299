# Two entry points for a fresh machine: `make run` (the embedded main job) and `make test`.
# Each sets up what it needs: a virtualenv with the pinned CPU torch, the project, the compiled
# kernels, and (for tests) the Debian servers the integration tests start on 127.0.0.1.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.prunewatch-installed
ROUNDS ?=
RUN_ARGS ?= $(if $(ROUNDS),--rounds $(ROUNDS),)
PYTEST_ARGS ?=
# Test processes (pytest-xdist). Much of the suite waits on the servers and subprocesses it starts (PostgreSQL,
# Prometheus, `prunewatch serve`, pip installs), so two workers overlap those waits even on two cores: about
# 16 minutes instead of 21 here. Tests take free ports and temporary folders, so workers never share a server.
PYTEST_WORKERS ?= 2
DEBIAN_PACKAGES := postgresql prometheus prometheus-alertmanager prometheus-pushgateway chromium chromium-driver poppler-utils
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The kernel's tests on the instruction sets this host can also run (`make test` runs only its own): torch's
# ATEN_CPU_CAPABILITY picks the build (prunewatch/engine/sparse/kernel.py), each in a folder of its own.
ISA_TESTS := tests/engine/test_fp32_dense.py tests/engine/test_int8_dense.py tests/engine/test_int4_dense.py \
	tests/engine/test_integer_dense.py tests/engine/test_ragged_attention.py tests/engine/test_sparse_kernel.py \
	tests/engine/test_threshold_mask.py

.PHONY: setup system-deps run test test-isa lint kernels clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all,test]"
	touch $@

kernels: setup
	@if [ -f prunewatch/engine/sparse/build.py ]; then $(BIN)/python -m prunewatch.engine.sparse.build; fi

system-deps:
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

run: kernels
	$(BIN)/prunewatch run $(RUN_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: system-deps kernels lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-isa: setup
	@for isa in avx2 default; do \
	  echo "kernel tests, ATEN_CPU_CAPABILITY=$$isa"; \
	  ATEN_CPU_CAPABILITY=$$isa $(BIN)/python -m prunewatch.engine.sparse.build || exit 1; \
	  ATEN_CPU_CAPABILITY=$$isa $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS) $(ISA_TESTS) || exit 1; \
	done
	PRUNEWATCH_TEST_ISAS=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS) tests/engine/test_kernel_isas.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
