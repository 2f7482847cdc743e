"""Data pipeline: fetch sources, extract and clean text, build the corpus, train the tokenizer, shard, load.

Stages (each a small module): `sources` (download/unpack, lock file) -> `extract` (files to text) ->
`clean` (filters, dedup) -> `corpus` (caps, split, manifest; `run_fetch`) -> `tokenize` (`run_tokenize`) ->
`shard` (`run_shard`) -> `loaders` (`ByteLoader`, `ShardLoader`, `make_loader`).
"""
