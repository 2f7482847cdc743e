# ENLACE: two commands set everything up on a fresh machine.
#   make run   install into .venv, then run the default DVC stages on the offline defaults
#   make test  install into .venv, then run the test suite (every tier: what CI runs)
#   make test-fast  the same without the heavy tiers (llama.cpp, browser, Docker, DVC runs, slow)
#   make docs  the documentation site, built offline into site/ (mkdocs --strict)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export DVC_NO_ANALYTICS := 1
export PYTHONUNBUFFERED := 1
# dvc.yaml calls `enlace`: the venv comes first on PATH.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: run test test-fast test-native lint bench bench-es assistant assistant-table finetune serve llama-cpp llama-cpp-native gpu-check system-deps browser-deps docker-cpu docker-2060 docker-5090 docker-test docker-pin docker-lock clean

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

# The chat page's browser test drives Debian's chromium (Playwright's own browser download is not used); the
# test's `chromium` fixture (tests/conftest.py) calls this target when chromium is missing.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || (command -v apt-get >/dev/null && \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null))) || \
	  (echo "error: chromium is missing and could not be installed (apt-get install chromium); the chat page's browser test needs it" >&2; exit 1)

# The default run's stages and what they depend on. The assistant `make serve` answers with afterwards is Gemma 3
# aligned in context (configs/assistant/gemma3-preamble.yaml) plus the LoRA the `assistant` stage trains in that
# preamble's format (about 4 min on 2 Zen 4 cores; docs/assistant.md: on the judge's test questions it answered
# more on topic than the preamble alone and kept its facts). The SmolLM2 LoRA stages (finetune, finetune-eval)
# are `make finetune`'s: judged on the same questions, that assistant answered fewer on topic.
# On the fp32 CPU kind `make run` leaves the assistant stage out (configs/hardware/cpu-auto.yaml, run_skips):
# `enlace hardware run-stages` says so and prints the rest.
RUN_STAGES := eval export bench-es import-gemma3 assistant
run: $(STAMP) system-deps
	stages=$$($(BIN)/enlace hardware run-stages $(RUN_STAGES)) && $(BIN)/dvc repro $$stages
	$(BIN)/enlace report

# SmolLM2-135M-Instruct + LoRA on the instruction set (runs/finetune/adapter), and its held-out loss and answers.
finetune: $(STAMP)
	$(BIN)/dvc repro finetune-eval

# Tiers are pytest markers (pyproject.toml). The heavy ones set themselves up only when one of their tests is
# selected: the llama.cpp build (`llamacpp`) and the chromium install (`browser`) are session fixtures in
# tests/conftest.py that fail, never skip, when the set-up cannot be done. --durations lists the slowest tests.
FAST := not slow and not llamacpp and not native and not browser and not docker and not dvc
test: $(STAMP) system-deps
	PYTHONPATH=src $(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q --durations=25 -m "not native"

# The one tier `make test` leaves out: the serving table against llama-server built for this CPU (make bench's
# peer). Its cold build (scripts/llama_cpp_native.py) would add about ten minutes to CI's budget.
test-native: $(STAMP)
	$(BIN)/python -m pytest -q -m native

test-fast: $(STAMP) system-deps
	PYTHONPATH=src $(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q --durations=25 -m "$(FAST)"

# llama.cpp (llama-cpp-python from its pinned PyPI source package, portable AVX2 flags) for the GGUF
# round-trip tests (their `llama_cpp` fixture runs the same script) and the serving benchmark: built once per
# machine into ~/.cache/enlace/llama-cpp, in a venv of its own (never this one). A second call returns at
# once; a changed pin or flag rebuilds.
llama-cpp: $(STAMP)
	$(BIN)/python scripts/llama_cpp_build.py

# llama.cpp built for this CPU (GGML_NATIVE=ON) from the same pinned source: llama-server, llama-bench and
# llama-quantize, the peer of `make bench`'s serving table, into a folder of ~/.cache/enlace/llama-cpp keyed
# by the pin, the flags and the CPU's ISA flags, beside the portable build (never touching it).
llama-cpp-native: $(STAMP)
	$(BIN)/python scripts/llama_cpp_native.py

# The reference pages are generated from the config models and the CLI parser, then the site is built;
# --strict turns a broken link or anchor, or a page missing from mkdocs.yml's nav, into an error.
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python tools/gen_docs.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check src tests bench tools scripts
	$(BIN)/ruff format --check src tests bench tools scripts
	PYTHONPATH=src $(BIN)/lint-imports --no-cache

bench: $(STAMP) llama-cpp llama-cpp-native
	$(BIN)/python -m bench

# The assistant over an OpenAI-compatible API, chat page at http://127.0.0.1:8080/: Gemma 3 in context once
# `make run` (or `make assistant`) imported it, with the `assistant` stage's LoRA once that trained it for the
# spec as it is; else SmolLM2 + LoRA from `make finetune`.
# Other models or options: make serve SERVE_ARGS="--model models/smollm2-135m-instruct --port 8081"
SERVE_ARGS ?=
serve: $(STAMP)
	$(BIN)/enlace serve $(SERVE_ARGS)

# The Spanish assistant: Gemma 3 270M from PyPI aligned in context by the served preamble, plus a LoRA trained in
# that preamble's own format (the `assistant` stage, which `make run` runs too; configs/finetune/gemma3-preamble-mid.yaml),
# then its held-out loss in that format and its answers to the judge's test questions (greedy; about 5 min on 2
# Zen 4 cores). `make serve` answers with both.
assistant: $(STAMP)
	$(BIN)/dvc repro assistant
	$(BIN)/enlace finetune-eval --finetune gemma3-preamble-mid
	$(BIN)/enlace judge --assistant configs/assistant/gemma3-preamble.yaml \
	  --adapter runs/assistant-preamble-mid/adapter --split test --decodings greedy --max-new-tokens 128 \
	  --out runs/assistant-preamble-mid/judge.json

# Every assistant ENLACE makes, trained and judged in one run on this CPU (issue 40's table): SmolLM2 + LoRA (the
# `finetune` stage), Gemma in context (the preamble alone), Gemma + LoRA on the instruction set in Gemma's chat
# turns (gemma3-es), on the in-context Gemma's own answers (`enlace distill`, then gemma3-distill), and in the
# preamble's format (the `assistant` stage; gemma3-preamble-facts adds the short fact answers), and a full
# fine-tune in that format (gemma3-preamble-full: 12 min of training on 2 Zen 3 cores). Greedy, on the judge's 95
# test questions; the table goes to runs/assistant_table/table.md. About 50 min on 2 Zen 4 cores before the full
# fine-tune's row.
TABLE := runs/assistant_table
JUDGE_TEST := --split test --decodings greedy --max-new-tokens 128
PREAMBLE := --assistant configs/assistant/gemma3-preamble.yaml
assistant-table: $(STAMP)
	$(BIN)/dvc repro finetune assistant
	$(BIN)/enlace finetune --finetune gemma3-es
	$(BIN)/enlace distill --out runs/distill
	$(BIN)/enlace finetune --finetune gemma3-distill
	$(BIN)/enlace finetune --finetune gemma3-preamble-facts
	$(BIN)/enlace finetune --finetune gemma3-preamble-full
	$(BIN)/enlace judge --model models/smollm2-135m-instruct --adapter runs/finetune/adapter $(JUDGE_TEST) \
	  --out $(TABLE)/smollm2-lora.json
	$(BIN)/enlace judge $(PREAMBLE) $(JUDGE_TEST) --out $(TABLE)/gemma3-preamble.json
	$(BIN)/enlace judge --model models/gemma3-270m --adapter runs/assistant/adapter $(JUDGE_TEST) \
	  --out $(TABLE)/gemma3-lora-es.json
	$(BIN)/enlace judge --model models/gemma3-270m --adapter runs/assistant-distill/adapter $(JUDGE_TEST) \
	  --out $(TABLE)/gemma3-lora-distill.json
	$(BIN)/enlace judge $(PREAMBLE) --adapter runs/assistant-preamble-mid/adapter $(JUDGE_TEST) \
	  --out $(TABLE)/gemma3-preamble-lora.json
	$(BIN)/enlace judge $(PREAMBLE) --adapter runs/assistant-preamble-facts/adapter $(JUDGE_TEST) \
	  --out $(TABLE)/gemma3-preamble-lora-facts.json
	$(BIN)/enlace judge --assistant runs/assistant-preamble-full/assistant.yaml $(JUDGE_TEST) \
	  --out $(TABLE)/gemma3-preamble-full.json
	$(BIN)/enlace judge --table $(TABLE)/smollm2-lora.json $(TABLE)/gemma3-preamble.json $(TABLE)/gemma3-lora-es.json \
	  $(TABLE)/gemma3-lora-distill.json $(TABLE)/gemma3-preamble-lora.json $(TABLE)/gemma3-preamble-lora-facts.json \
	  $(TABLE)/gemma3-preamble-full.json --out $(TABLE)/table.md

# The bases side by side on the same Spanish texts at fp32: ENLACE's pretrained model, SmolLM2-135M, Gemma 3
# 270M and the assistant (`make assistant`); bits per byte and minimal pairs into runs/bench_bases/table.md.
# Then each assistant at hand answers the judge's test questions (greedy and the serving sampler, two seeds):
# on topic, correct, Spanish, loops, ended, with Wilson intervals, into runs/judge/<assistant>/judge.json.
bench-es: $(STAMP)
	$(BIN)/enlace bench-bases --finetune gemma3-es
	test ! -d models/gemma3-270m || $(BIN)/enlace judge --assistant configs/assistant/gemma3-preamble.yaml
	test ! -d runs/assistant-preamble-mid/adapter || $(BIN)/enlace judge --assistant configs/assistant/gemma3-preamble.yaml \
	  --adapter runs/assistant-preamble-mid/adapter
	test ! -d runs/assistant/adapter || $(BIN)/enlace judge --model models/gemma3-270m --adapter runs/assistant/adapter
	test ! -d runs/finetune/adapter || $(BIN)/enlace judge --model models/smollm2-135m-instruct --adapter runs/finetune/adapter

gpu-check: $(STAMP)
	$(BIN)/python -m enlace.gpu_check --out runs/gpu-check.json

# Variants of the default run at equal wall time, tabled into docs/ablations.md (run it on a quiet machine):
# the data stages first, then `make ablate` or `make ablate ABLATION=configs/ablations/NAME.yaml`.
ABLATION ?= configs/ablations/recipe.yaml
.PHONY: ablate
ablate: $(STAMP) system-deps
	$(BIN)/dvc repro shard
	$(BIN)/enlace ablate $(ABLATION) --docs docs/ablations.md

# Containers: build the target for the GPU generation, then run the pipeline in it with the repo mounted.
# The hardware profile is chosen by params.yaml's config.hardware, the one selector every stage reads
# (DVC tracks it, so stages whose resolved config changes re-run and dvc.lock records the profile): the
# container sets it, then runs `dvc repro`. The edit stays in the work tree, visible in `git diff`.
DOCKER_RUN = docker run --rm -v "$(CURDIR)":/work -w /work --user $$(id -u):$$(id -g) -e HOME=/tmp/home
# Point params.yaml's `config:` block at the card's layers (hardware, model, train, data): every stage reads
# them and dvc.lock records them, so the change shows in `git diff`.
select = sed -i '/^config:/,/^[a-z]/{s/^\(  hardware:\).*/\1 $(1)/;s/^\(  model:\).*/\1 $(2)/;s/^\(  train:\).*/\1 $(3)/;s/^\(  data:\).*/\1 $(4)/}' params.yaml

# BuildKit builds (the default from Docker 23; DOCKER_BUILDKIT=1 turns it on for 20.10-22): the Dockerfile's
# install step uses a bind mount and an optional `--secret id=ca_bundle,src=FILE` (docs/containers.md).
docker-cpu:
	DOCKER_BUILDKIT=1 docker build --target cpu -t enlace:cpu .
	$(DOCKER_RUN) enlace:cpu sh -c "$(call select,cpu,cpu-small,cpu-small,es-debian) && dvc repro"

docker-2060:
	DOCKER_BUILDKIT=1 docker build --target turing -t enlace:turing .
	$(DOCKER_RUN) --gpus all enlace:turing sh -c "$(call select,rtx2060,tiny-50m,tiny-50m-2060,fineweb2-es) && dvc repro"

docker-5090:
	DOCKER_BUILDKIT=1 docker build --target blackwell -t enlace:blackwell .
	$(DOCKER_RUN) --gpus all enlace:blackwell sh -c "$(call select,rtx5090,tiny-50m,tiny-50m-5090,fineweb2-es) && dvc repro"

# Build the cpu image and run ENLACE in it (config check, dvc repro smoke, a pretrain stopped with docker stop
# and resumed in a new container, equal to an uninterrupted one); starts a Docker engine if none answers, and
# builds on a local Debian 12 base where the pinned one cannot be pulled. docs/containers.md says what it checks.
docker-test:
	bash docker/test.sh

# Re-resolve the base image digests (needs Docker and registry access); then update docker/images.lock and the
# Dockerfile's ARG *_BASE defaults to match (tests/test_docker.py fails until they agree).
docker-pin:
	@grep -v '^#' docker/images.lock | while IFS='=' read -r target ref; do \
	  tag=$${ref%@*}; digest=$$(docker buildx imagetools inspect "$$tag" --format '{{json .Manifest}}' | \
	    python3 -c 'import json,sys; print(json.load(sys.stdin)["digest"])'); \
	  echo "$$target=$$tag@$$digest"; done

# Regenerate the lock files with every transitive pin and its sha256 hashes (needs PyPI only). torch is
# resolved too, so its pure-Python dependencies get locked, then torch and its CUDA stack (triton, nvidia-*,
# cuda-*) are dropped from the output: install.sh takes those from the PyTorch index (or a wheel folder),
# pinned by version. One lock per image Python: the cpu image is Debian 12's Python 3.11
# (python:3.11-slim-bookworm, and the local test base), the CUDA images Ubuntu 24.04's 3.12; a lock compiled
# for one does not install on the other. Each lock keeps its header comment.
LOCKS := cpu:3.11 cu126:3.12 cu130:3.12
docker-lock: $(STAMP)
	$(BIN)/python -m pip install -q uv==0.13.8
	set -e; for entry in $(LOCKS); do t=$${entry%:*}; py=$${entry#*:}; \
	  $(BIN)/uv pip compile -q --generate-hashes --python-version $$py --python-platform x86_64-manylinux_2_28 \
	    requirements.txt --no-header --no-emit-package torch -o /tmp/enlace-docker-$$t.lock; \
	  { sed -n '/^#/!q;p' docker/requirements-$$t.lock; \
	    awk '/^#/{skip=0} /^[A-Za-z0-9]/{skip=($$0 ~ /^(torch|triton|nvidia-|cuda-)/)} !skip' /tmp/enlace-docker-$$t.lock; \
	  } > docker/requirements-$$t.lock.new && mv docker/requirements-$$t.lock.new docker/requirements-$$t.lock; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
