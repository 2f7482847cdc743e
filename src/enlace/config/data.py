"""Data layer: where the corpus comes from, how it is cleaned, tokenized and sharded."""

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from .base import Strict

Extractor = Literal[
    "auto", "html", "man", "gettext", "sword", "fortune", "text", "parquet", "jsonl", "mallard"
]


class _SourceBase(Strict):
    name: str
    license: str = "unknown"
    extractor: Extractor = "auto"
    # Glob patterns (inside the unpacked package or archive) of the files to extract; empty means all.
    include: list[str] = []
    exclude: list[str] = []
    # Column holding the text, for parquet and jsonl sources.
    text_column: str = "text"
    # Upper bound on this source's share of the corpus characters (e.g. 0.3 for the 1909 Bible).
    max_fraction: StrictFloat | None = Field(default=None, gt=0, le=1)
    # A sampling weight: 2.0 repeats the source's documents twice in the training split.
    weight: StrictFloat = Field(default=1.0, gt=0)


class DebSource(_SourceBase):
    kind: Literal["deb"]
    package: str
    version: str
    sha256: str | None = None


class UrlSource(_SourceBase):
    kind: Literal["url"]
    url: str
    # File name under data/raw/url/<name>/; null takes the last part of the URL path.
    filename: str | None = None
    sha256: str | None = None
    timeout_s: StrictFloat = Field(default=60.0, gt=0)
    retries: StrictInt = Field(default=3, ge=0)


class HfSource(_SourceBase):
    """Files of a Hugging Face dataset repo, fetched with huggingface_hub (which honours HF_ENDPOINT).

    `revision` is a commit sha or a branch such as `main`; a branch is resolved to its commit on the first
    fetch and the commit, every file's size and sha256 go into the lock file. Later fetches use and verify
    the locked commit.
    """

    kind: Literal["hf"]
    repo: str
    revision: str = "main"
    # Glob patterns of repo paths (e.g. "20231101.es/*.parquet"), matched against the repo's file list.
    files: list[str]
    # Take only the first N matching files (sorted by path): bounds the download.
    max_files: StrictInt | None = Field(default=None, ge=1)
    # Optional pins of your own; without them the lock file records what the first fetch saw.
    sha256: dict[str, str] = {}
    # null: HF_ENDPOINT, else https://huggingface.co.
    endpoint: str | None = None
    timeout_s: StrictFloat = Field(default=60.0, gt=0)
    retries: StrictInt = Field(default=3, ge=0)


class LocalSource(_SourceBase):
    kind: Literal["local"]
    path: str


Source = Annotated[DebSource | UrlSource | HfSource | LocalSource, Field(discriminator="kind")]


class CleaningConfig(Strict):
    min_words_per_line: StrictInt = Field(default=4, ge=0)
    min_letter_fraction: StrictFloat = Field(default=0.6, ge=0, le=1)
    language_filter: StrictBool = True
    # How a line's language is decided: "stopwords" (Spanish vs English function words; fast) or "lingua"
    # (lingua-language-detector among es/en/pt/fr/it/ca; ~28x slower, and also rejects other Romance
    # languages). Measured on a labelled sample: bench/bench_langid.py, README "Language ID".
    language_id: Literal["stopwords", "lingua"] = "stopwords"
    dedup: StrictBool = True  # exact and normalized duplicates (hashes kept, not texts)
    # Near duplicates by MinHash (datatrove's disk-based signature/bucket/cluster/filter stages).
    near_dedup: StrictBool = True
    min_doc_chars: StrictInt = Field(default=200, ge=0)
    # Longer documents are cut at paragraph boundaries: a whole manual as one document would put all of it
    # on one side of the train/val split.
    max_doc_chars: StrictInt = Field(default=20000, gt=0)


class TokenizerConfig(Strict):
    type: Literal["bpe", "unigram"] = "bpe"  # bpe: its tokenizer.json export is exact (see hf.sp_convert)
    vocab_size: StrictInt = Field(default=8192, gt=0)
    character_coverage: StrictFloat = Field(default=0.9995, gt=0, le=1)
    # Sentences longer than this (bytes) are split before training, never silently skipped.
    max_sentence_length: StrictInt = Field(default=4192, gt=0)
    # Sentences (lines) of the training split the tokenizer trains on: enlace draws this seeded sample in
    # corpus order (sentencepiece's own sampling differs between processes); 0 takes every sentence, refused
    # above 64 MiB of training text because sentencepiece holds them all in memory.
    input_sentence_size: StrictInt = Field(default=0, ge=0)
    seed: StrictInt = 0
    user_defined_symbols: list[str] = ["<|im_start|>", "<|im_end|>"]
    split_digits: StrictBool = True
    # Fixed so that training is reproducible: the same input and thread count give the same model.
    num_threads: StrictInt = Field(default=2, ge=1)


class ShardConfig(Strict):
    dtype: Literal["auto", "uint16", "uint32"] = "auto"
    tokens_per_shard: StrictInt = Field(default=1 << 24, gt=0)
    num_workers: StrictInt | None = Field(default=None, ge=1)  # null: all cores


class ExecutorConfig(Strict):
    """Where the data stages run: datatrove's executors, the same pipeline code for each."""

    kind: Literal["local", "slurm", "ray"] = "local"
    # Work split into this many tasks (the outputs do not depend on it); null: one per core.
    tasks: StrictInt | None = Field(default=None, ge=1)
    # Tasks run at once (local); null: min(tasks, cores).
    workers: StrictInt | None = Field(default=None, ge=1)
    logging_dir: str = "data/logs"
    # slurm: passed to datatrove's SlurmPipelineExecutor (partition, time, cpus_per_task, mem_per_cpu_gb...).
    slurm: dict[str, str | StrictInt | StrictFloat] = {}


class DataConfig(Strict):
    name: str
    sources: list[Source]
    val_fraction: StrictFloat = Field(default=0.02, gt=0, lt=1)
    cleaning: CleaningConfig = CleaningConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    shard: ShardConfig = ShardConfig()
    executor: ExecutorConfig = ExecutorConfig()
    # Data budget: training may pass over the training tokens at most this many times.
    max_epochs: StrictFloat = Field(default=4.0, gt=0)
    # Rough corpus size in tokens, for the budget check before the corpus exists (null: unknown).
    estimated_tokens: StrictInt | None = Field(default=None, gt=0)

    @property
    def shard_dtype(self) -> str:
        if self.shard.dtype != "auto":
            return self.shard.dtype
        return "uint16" if self.tokenizer.vocab_size <= 65536 else "uint32"
