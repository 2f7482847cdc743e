"""User-facing errors: the CLI prints them as one line and exits with status 2, without a traceback."""


class EnlaceError(Exception):
    """An error caused by the user's input (config, data, files), not by a bug."""

    exit_code = 2


class ConfigError(EnlaceError):
    """A config value is invalid. Names the file and the dotted field path."""

    def __init__(self, source: str, field: str, message: str):
        self.source, self.field, self.message = source, field, message
        super().__init__(f"{source}: {field}: {message}")


class DataError(EnlaceError):
    """Input data is missing, empty, corrupted or does not match what was expected."""


class CheckpointError(EnlaceError):
    """A checkpoint is incomplete, corrupted, or does not belong to this run."""


class HardwareError(EnlaceError):
    """The selected hardware profile does not match the device this process runs on."""


class ModelError(EnlaceError):
    """A model path cannot be opened: missing, or none of the kinds ENLACE loads (enlace.load)."""


class UnsupportedModelError(EnlaceError):
    """The checkpoint uses a feature our Llama does not implement; loading it would give wrong logits."""


class WeightsError(EnlaceError):
    """A checkpoint's tensors do not match the model its config describes."""


class GGUFExportError(EnlaceError):
    """The model or its tokenizer cannot be written as GGUF."""
