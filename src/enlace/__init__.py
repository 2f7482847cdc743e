"""ENLACE: a reproducible stack to pretrain a Spanish language model and fine-tune Llama-family models."""

__version__ = "0.1.0"
