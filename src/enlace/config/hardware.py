"""Hardware layer: where the run happens and in which precision."""

from typing import Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, model_validator

from .base import Strict


class HardwareConfig(Strict):
    name: str
    device: Literal["cpu", "cuda"]
    # "auto" (CPU only) resolves when the config is read: bf16 where the CPU runs it natively (avx512_bf16
    # or AMX), else fp32. The resolved value is what the config, its hash and every checkpoint record.
    dtype: Literal["fp32", "fp16", "bf16", "auto"] = "fp32"
    # fp16 has too little range for gradients: it needs a loss scaler.
    loss_scaler: StrictBool = False
    # The lowest compute capability the profile's kernels and dtype need, e.g. [7, 5] for Turing.
    min_compute_capability: tuple[StrictInt, StrictInt] | None = None
    # Device memory the profile plans for (GiB); the memory preflight checks configs against it.
    memory_gib: StrictFloat = Field(default=16.0, gt=0)
    # Attention backend for scaled_dot_product_attention; "auto" lets PyTorch choose, and on CPU runs
    # sequences up to 512 tokens as plain matmuls, faster there (enlace.model.CPU_MATMUL_ATTENTION_MAX_LEN).
    sdpa_backend: Literal["auto", "math", "efficient", "flash", "cudnn"] = "auto"
    compile: StrictBool = False
    # Threads for intra-op parallelism on CPU; null keeps PyTorch's default (all cores).
    num_threads: StrictInt | None = Field(default=None, ge=1)
    # Deterministic algorithms (bit-exact reruns); costs some speed on GPU.
    deterministic: StrictBool = True

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("dtype") == "auto":
            if data.get("device") != "cpu":
                raise ValueError("dtype: auto is for device cpu; a GPU profile names its dtype")
            from ..runtime import resolve_cpu_dtype  # detection lives beside the device checks

            data = {**data, "dtype": resolve_cpu_dtype()}
        return data
