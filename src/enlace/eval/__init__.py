"""Evaluation of trained models: validation metrics and sampled continuations."""
