"""Hardware layer: where the run happens and in which precision."""

from typing import Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from .base import Strict


class HardwareConfig(Strict):
    name: str
    device: Literal["cpu", "cuda"]
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    # fp16 has too little range for gradients: it needs a loss scaler.
    loss_scaler: StrictBool = False
    # The lowest compute capability the profile's kernels and dtype need, e.g. [7, 5] for Turing.
    min_compute_capability: tuple[StrictInt, StrictInt] | None = None
    # Device memory the profile plans for (GiB); the memory preflight checks configs against it.
    memory_gib: StrictFloat = Field(default=16.0, gt=0)
    # Attention backend for scaled_dot_product_attention; "auto" lets PyTorch choose.
    sdpa_backend: Literal["auto", "math", "efficient", "flash", "cudnn"] = "auto"
    compile: StrictBool = False
    # Threads for intra-op parallelism on CPU; null keeps PyTorch's default (all cores).
    num_threads: StrictInt | None = Field(default=None, ge=1)
    # Deterministic algorithms (bit-exact reruns); costs some speed on GPU.
    deterministic: StrictBool = True
