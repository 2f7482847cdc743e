"""Layered, validated configuration."""

from .data import DataConfig
from .extra import EvalConfig, GenerationConfig
from .finetune import FinetuneConfig  # noqa: F401  importing it registers the finetune layer
from .hardware import HardwareConfig
from .model import ModelConfig
from .resolve import Config, load_config, register_layer, save_resolved, show
from .train import TrainConfig

__all__ = [
    "Config",
    "DataConfig",
    "EvalConfig",
    "GenerationConfig",
    "HardwareConfig",
    "ModelConfig",
    "TrainConfig",
    "load_config",
    "register_layer",
    "save_resolved",
    "show",
]
