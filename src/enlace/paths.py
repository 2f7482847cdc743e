"""Where each stage reads and writes, relative to the repository root. DVC tracks these folders."""

from pathlib import Path

DATA = Path("data")
RAW = DATA / "raw"  # downloaded packages and files, verified by checksum
CORPUS = DATA / "corpus"  # clean documents: train.jsonl, val.jsonl, manifest.json
TOKENIZER = DATA / "tokenizer"  # tokenizer.model, tokenizer.vocab, report.json
SHARDS = DATA / "shards"  # train-*.bin, val-*.bin, manifest.json
MODELS = Path("models")  # imported base models (Hugging Face folders)
RUNS = Path("runs")  # checkpoints, metrics and plots of each stage
SMOLLM2_DIR = (
    MODELS / "smollm2-135m-instruct"
)  # the offline default base model, built by `enlace import-gguf`
GEMMA3_DIR = (
    MODELS / "gemma3-270m"
)  # Gemma 3 270M (multilingual base), built by `enlace import-gguf --base gemma3-270m`
PYPI_CACHE = RAW / "pypi"  # wheels fetched from PyPI (checksummed)
BENCH_ES = (
    Path("assets") / "bench_es"
)  # the project's Spanish benchmark: items (JSONL) and lm-eval task YAMLs
# The assistant `enlace serve` answers with by default once its base is imported: Gemma 3 270M aligned in
# context (docs/assistant.md: it beats the fine-tunes on the judge's fact questions).
DEFAULT_ASSISTANT = Path("configs/assistant/gemma3-preamble.yaml")
# The LoRA the `assistant` stage (`make run`, `make assistant`) trains in that spec's own format
# (configs/finetune/gemma3-preamble-mid.yaml): once it exists, and was trained with the spec's present text,
# `enlace serve` answers with the spec plus it.
DEFAULT_ASSISTANT_ADAPTER = RUNS / "assistant-preamble-mid" / "adapter"
