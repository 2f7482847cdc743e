"""Pretraining: the loop, its optimizer and schedule, checkpoints, and the smoke/pretrain stages."""
