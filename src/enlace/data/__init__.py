"""Data pipeline: fetch sources, extract and clean text, build the corpus, train the tokenizer, shard, load.

Stages (each a small module): `sources` (download/unpack, lock file) -> `extract` (files to text) ->
`clean` (filters, dedup keys) -> `pipeline_steps` (our datatrove pipeline steps) and `corpus` (`run_fetch`) ->
`tokenize` (`run_tokenize`) -> `shard` (`run_shard`) -> `loaders` (`ByteLoader`, `ShardLoader`,
`make_loader`). `engine` runs pipelines on datatrove's executors; `budget` is the data-budget preflight.
"""
