"""Scoring text with a model, shared by the data loaders (validation windows), the trainer (validation) and
the eval stage: `token_bytes` (how many UTF-8 bytes each token stands for, for bits per byte) and `score`
(windows over a token stream, and the loss and bits per byte of a model over them)."""
