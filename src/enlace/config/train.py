"""Train layer: optimisation, schedule, batch geometry, checkpoints and logging."""

from pydantic import Field, StrictBool, StrictFloat, StrictInt, model_validator

from ..choices import (
    DecayShape,
    MuonAdjustLr,
    NewtonSchulzDtype,
    OnIdentityChange,
    OptimizerName,
    TrainLoader,
)
from .base import Strict


class MuonConfig(Strict):
    """Muon (torch.optim.Muon) for the hidden 2-D weights when optimizer.name is "muon".

    Muon orthogonalises each matrix's momentum (Newton-Schulz), so every update has about the same size
    along every direction; that only makes sense for matrices that mix features, so embeddings, the head
    and the norm gains stay on AdamW with the optimizer's own fields.
    """

    # The matrices' peak lr; the WSD schedule scales it like optimizer.lr. Orthogonalised updates have
    # spectral norm about 1 whatever the gradient's scale, so this lr is an absolute step size, far above
    # AdamW's (0.02 is the value Muon's author used).
    lr: StrictFloat = Field(default=0.02, gt=0)
    # EMA factor of the gradient the update orthogonalises; 1 would never take in a new gradient.
    momentum: StrictFloat = Field(default=0.95, ge=0, lt=1)
    nesterov: StrictBool = True  # orthogonalise the look-ahead mix of gradient and momentum
    # Decoupled, per step: w *= 1 - lr * weight_decay with Muon's scheduled lr, so 0.1 here shrinks the
    # matrices ~67x harder per step than AdamW's 0.1 at lr 3e-4. 0 (off) until the ablation table decides.
    weight_decay: StrictFloat = Field(default=0.0, ge=0)
    # Newton-Schulz iterations (each is 3 matmuls per matrix): 5 bring the singular values to about 0.5-1.5,
    # close enough to 1 per Muon's author. More cost time; torch refuses 100 or more.
    ns_steps: StrictInt = Field(default=5, ge=1, le=20)
    # "original": lr * sqrt(max(1, rows/cols)); "match_rms_adamw": lr * 0.2 * sqrt(max(rows, cols)), the
    # update RMS of AdamW, so AdamW's lr and weight decay carry over (then set lr near optimizer.lr).
    adjust_lr: MuonAdjustLr = "original"
    # The Newton-Schulz matmuls' dtype. bf16 is torch.optim.Muon's own (fast where the CPU or GPU has bf16
    # units); fp32 for CPUs without them (the fp32 kind), which would emulate bf16 by converting to fp32.
    ns_dtype: NewtonSchulzDtype = "bf16"


class AdamWConfig(Strict):
    """AdamW's settings: every parameter of a fine-tune's adapters, or of pretraining unless Muon takes the
    hidden matrices."""

    lr: StrictFloat = Field(default=3e-4, gt=0)
    betas: tuple[StrictFloat, StrictFloat] = (0.9, 0.95)
    eps: StrictFloat = Field(default=1e-8, gt=0)
    weight_decay: StrictFloat = Field(default=0.1, ge=0)
    # Embeddings are looked up, not multiplied: decaying them mostly shrinks rare tokens.
    decay_embeddings: StrictBool = False
    grad_clip: StrictFloat = Field(default=1.0, ge=0)  # 0 disables clipping (over all parameters)


class OptimizerConfig(AdamWConfig):
    """Pretraining's optimizer: AdamW's settings and the choice of Muon for the hidden matrices."""

    # "adamw": AdamW for every parameter. "muon": Muon (the `muon` block) for the attention and MLP
    # matrices, AdamW (the fields above) for embeddings, the head and the norms.
    name: OptimizerName = "adamw"
    muon: MuonConfig = MuonConfig()  # read only when name is "muon"


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
