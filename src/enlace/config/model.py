"""Model layer: the shape of the Llama-style decoder (and the switches that make it Gemma 3)."""

from typing import Literal

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
    # Gemma 3 switches. Every default is the Llama computation, so existing configs and checkpoints stay as
    # they were; imported Gemma checkpoints set them (hf/arch/gemma3.py reads them from config.json).
    # Gemma 3 270M has 4 heads of 256 on a width of 640: head_dim is stated, not derived. null: d_model/n_head.
    attn_head_dim: StrictInt | None = Field(default=None, gt=0)
    # Gemma's RMSNorm scales by (1 + weight): weights are stored as offsets from 1 (and initialised to 0).
    norm_unit_offset: StrictBool = False
    # Gemma 2/3 "sandwich" norms: besides the norm before attention and before the MLP, another on each
    # one's output before it joins the residual stream.
    sandwich_norm: StrictBool = False
    # The gated MLP's activation: SwiGLU (silu), GeGLU with GELU's tanh approximation (Gemma), or a squared
    # ReLU gate (relu2: down(relu(gate)^2 * up); So et al. 2021's Primer activation in the gated form).
    mlp_act: Literal["silu", "gelu_tanh", "relu2"] = "silu"
    # Gemma multiplies the token embeddings by sqrt(d_model) (the tied output head stays unscaled).
    embed_scale: StrictBool = False
    # Attention logits are scaled by query_pre_attn_scalar**-0.5 (Gemma 3: 256); null: head_dim**-0.5.
    query_pre_attn_scalar: StrictInt | None = Field(default=None, gt=0)
    # Local attention: all layers but every `global_every`-th (1-based) see only the last `sliding_window`
    # positions, their own included (Gemma 3: window 512, every 6th layer global: 5 local to 1 global).
    # null: every layer attends to the whole sequence.
    sliding_window: StrictInt | None = Field(default=None, gt=0)
    global_every: StrictInt = Field(default=1, gt=0)
    # RoPE base of the local layers (Gemma 3: 10k, while the global layers use rope_theta, 1M); null: rope_theta.
    rope_local_theta: StrictFloat | None = Field(default=None, gt=0)
    # Speedrun-style switches (issue 38's ablations; off by default). zero_init_proj: the residual branches'
    # output projections (o_proj, down_proj) start at zero, so each block starts as the identity.
    zero_init_proj: StrictBool = False
    # Logits squashed to cap * tanh(logits / cap) (Gemma 2's final soft-capping); null: none.
    logit_softcap: StrictFloat | None = Field(default=None, gt=0)
    # One embedding table per layer added to that layer's attention values (v = v_proj(x) + table[token]):
    # modded-nanogpt's value embeddings. No Hugging Face or GGUF architecture has them: not exportable.
    value_embeds: StrictBool = False

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim if self.attn_head_dim is not None else self.d_model // self.n_head

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) attends through the sliding window."""
        return self.sliding_window is not None and (layer + 1) % self.global_every != 0

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(self.ffn_mult * self.d_model)
        m = self.ffn_multiple_of
        return m * ((hidden + m - 1) // m)
