"""Model layer: the shape of the Llama-style decoder."""

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from .base import Strict


class ModelConfig(Strict):
    name: str
    vocab_size: StrictInt = Field(gt=0)
    n_layer: StrictInt = Field(gt=0)
    n_head: StrictInt = Field(gt=0)
    n_kv_head: StrictInt = Field(gt=0)
    d_model: StrictInt = Field(gt=0)
    seq_len: StrictInt = Field(gt=0)
    ffn_mult: StrictFloat = Field(default=8 / 3, gt=0)
    ffn_multiple_of: StrictInt = Field(default=64, gt=0)
    # Imported checkpoints state their FFN width exactly; null derives it from ffn_mult.
    ffn_hidden: StrictInt | None = Field(default=None, gt=0)
    rope_theta: StrictFloat = Field(default=10000.0, gt=0)
    norm_eps: StrictFloat = Field(default=1e-5, gt=0)
    tie_embeddings: StrictBool = True
    qk_norm: StrictBool = False
    z_loss_weight: StrictFloat = Field(default=0.0, ge=0)
    dropout: StrictFloat = Field(default=0.0, ge=0, lt=1)
    init_std: StrictFloat = Field(default=0.02, gt=0)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(self.ffn_mult * self.d_model)
        m = self.ffn_multiple_of
        return m * ((hidden + m - 1) // m)
