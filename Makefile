# ENLACE: two commands set everything up on a fresh machine.
#   make run   install into .venv, then run the DVC pipeline on the offline defaults
#   make test  install into .venv, then run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export DVC_NO_ANALYTICS := 1
export PYTHONUNBUFFERED := 1
# dvc.yaml calls `enlace`: the venv comes first on PATH.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: run test lint bench gpu-check system-deps docker-cpu docker-2060 docker-5090 clean

# The stamp depends on the pinned requirements: a second `make` reinstalls nothing,
# a changed pin reinstalls exactly once.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Tools the offline corpus needs: apt-get/dpkg-deb (always on Debian) and groff for man pages.
system-deps:
	@command -v groff >/dev/null 2>&1 || (command -v apt-get >/dev/null && \
	  (apt-get install -y -q groff-base >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q groff-base >/dev/null)) || \
	  echo "warning: groff not installed; man pages will be skipped")

run: $(STAMP) system-deps
	$(BIN)/dvc repro
	$(BIN)/enlace report

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

bench: $(STAMP)
	$(BIN)/python -m bench

gpu-check: $(STAMP)
	$(BIN)/python -m enlace.gpu_check --out runs/gpu-check.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
