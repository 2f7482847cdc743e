"""Train layer: optimisation, schedule, batch geometry, checkpoints and logging."""

from pydantic import Field, StrictBool, StrictFloat, StrictInt, model_validator

from ..choices import DecayShape, OnIdentityChange, TrainLoader
from .base import Strict


class OptimizerConfig(Strict):
    """AdamW."""

    lr: StrictFloat = Field(default=3e-4, gt=0)
    betas: tuple[StrictFloat, StrictFloat] = (0.9, 0.95)
    eps: StrictFloat = Field(default=1e-8, gt=0)
    weight_decay: StrictFloat = Field(default=0.1, ge=0)
    # Embeddings are looked up, not multiplied: decaying them mostly shrinks rare tokens.
    decay_embeddings: StrictBool = False
    grad_clip: StrictFloat = Field(default=1.0, ge=0)  # 0 disables clipping


class ScheduleConfig(Strict):
    """Warmup-stable-decay: linear warmup, a flat plateau, then a decay to final_lr_frac * lr."""

    warmup_steps: StrictInt = Field(default=100, ge=0)
    # null: the decay takes every step after the warmup (no plateau), whatever max_steps is.
    decay_steps: StrictInt | None = Field(default=200, ge=0)
    decay_shape: DecayShape = "1-sqrt"
    final_lr_frac: StrictFloat = Field(default=0.0, ge=0, le=1)


class CheckpointConfig(Strict):
    every: StrictInt = Field(default=100, gt=0)
    keep_last: StrictInt = Field(default=2, ge=1)
    # On a corrupted latest checkpoint: stop with an error (false) or resume from the previous one (true).
    fallback_on_corrupt: StrictBool = False
    # A rerun under a different run identity (changed params, data or code) starts fresh: "move" keeps the
    # old run under <run dir>/previous/<identity>/, "delete" removes it.
    on_identity_change: OnIdentityChange = "move"


class TrainConfig(Strict):
    name: str
    seed: StrictInt = 1337
    # "bytes": the smoke stage reads raw UTF-8 bytes (vocab 256); "shards": token shards from `enlace shard`.
    loader: TrainLoader = "shards"
    max_steps: StrictInt = Field(gt=0)
    micro_batch_size: StrictInt = Field(gt=0)
    grad_accum_steps: StrictInt = Field(default=1, gt=0)
    global_batch_size: StrictInt = Field(gt=0)
    # Data-parallel processes the batch geometry is planned for (torchrun's WORLD_SIZE must match).
    world_size: StrictInt = Field(default=1, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log_every: StrictInt = Field(default=10, gt=0)
    eval_every: StrictInt = Field(default=0, ge=0)  # 0: only at the end
    eval_batches: StrictInt = Field(default=8, gt=0)
    # Non-finite losses or gradients tolerated in a row before the run stops.
    max_nonfinite_in_row: StrictInt = Field(default=5, gt=0)

    @model_validator(mode="after")
    def _check_geometry(self) -> "TrainConfig":
        got = self.micro_batch_size * self.grad_accum_steps * self.world_size
        if got != self.global_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) x grad_accum_steps ({self.grad_accum_steps}) "
                f"x world_size ({self.world_size}) = {got}, but global_batch_size is {self.global_batch_size}"
            )
        return self
