"""`enlace fetch`, `enlace tokenize`, `enlace shard`: the data stages of the pipeline."""

from __future__ import annotations

import argparse

DATA_LAYERS = ("data",)
# shard reads the model and train layers too: the vocab/dtype checks span them.
SHARD_LAYERS = ("hardware", "model", "train", "data")


def _fetch(args: argparse.Namespace) -> int:
    from ..cli import load_cfg
    from .corpus import run_fetch

    run_fetch(load_cfg(args, layers=DATA_LAYERS))
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from ..cli import load_cfg
    from .tokenize import run_tokenize

    run_tokenize(load_cfg(args, layers=DATA_LAYERS))
    return 0


def _shard(args: argparse.Namespace) -> int:
    from ..cli import load_cfg
    from .shard import run_shard

    run_shard(load_cfg(args, layers=SHARD_LAYERS))
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    for name, fn, text in (
        (
            "fetch",
            _fetch,
            "stage 1: download the data config's sources, extract and clean them into data/corpus",
        ),
        ("tokenize", _tokenize, "stage 2: train the sentencepiece tokenizer on the training split"),
        ("shard", _shard, "stage 3: encode the corpus into token shards on all cores"),
    ):
        p = sub.add_parser(name, parents=[common], help=text)
        p.set_defaults(handler=fn)
