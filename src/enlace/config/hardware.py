"""Hardware layer: where the run happens and in which precision."""

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, model_validator

from .base import Strict

# The layers a CPU kind's recipe may change: what decides how long a run takes.
RECIPE_LAYERS = ("model.", "train.", "finetune.")


class CpuKind(Strict):
    """What one CPU kind of a `dtype: auto` profile runs: compiled or eager, and per train layer the values
    that fit that kind's speed (applied at run start; enlace.config.kinds)."""

    compile: StrictBool
    # The name of a train or finetune layer -> {dotted model./train./finetune. key: value}: replaces the
    # layer file's value on this kind where that layer is selected (a value set in params.yaml or with --set
    # still wins). Static and checked like the layers themselves.
    recipes: dict[str, dict[str, Any]] = {}
    # DVC stages `make run` leaves out on this kind (`enlace hardware run-stages`), where they would take it
    # well past its budget; each still runs on its own (`dvc repro STAGE`, its make target).
    run_skips: list[str] = []

    @model_validator(mode="after")
    def _recipe_keys(self) -> "CpuKind":
        for name, recipe in self.recipes.items():
            for key in recipe:
                if not key.startswith(RECIPE_LAYERS) or key.endswith("."):
                    raise ValueError(
                        f"recipes.{name}: key {key!r}: a recipe sets model.KEY, train.KEY or finetune.KEY values only"
                    )
        return self


# The CPU kinds `dtype: auto` tells apart, named by the precision each trains in (enlace.runtime decides).
CPU_KINDS = ("bf16", "fp32")


class HardwareConfig(Strict):
    name: str
    device: Literal["cpu", "cuda"]
    # "auto" (CPU only) stays "auto" in the config and its hash: the run resolves it when it starts
    # (enlace.runtime.resolve_run): bf16 where the CPU runs it natively (avx512_bf16 or AMX), else fp32.
    # The run's config.json, its identity, every checkpoint and metrics.json record the resolved value.
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
    # "auto" (with `kinds`): as the resolved CPU kind says, measured per kind (docs/cpu-kinds.md).
    compile: StrictBool | Literal["auto"] = False
    # Threads for intra-op parallelism on CPU; null keeps PyTorch's default (all cores).
    num_threads: StrictInt | None = Field(default=None, ge=1)
    # Deterministic algorithms (bit-exact reruns); costs some speed on GPU.
    deterministic: StrictBool = True
    # Per CPU kind (bf16: native bf16; fp32: without it), whether to compile and the recipes that fit its
    # speed; both kinds declared. Recipes apply where `dtype: auto` resolves; a dtype set by hand (--set
    # hardware.dtype=fp32) takes its kind's compile only.
    kinds: dict[Literal["bf16", "fp32"], CpuKind] | None = None

    @model_validator(mode="after")
    def _auto(self) -> "HardwareConfig":
        # The config layer only checks the declaration; it never looks at the machine.
        if self.dtype == "auto" and self.device != "cpu":
            raise ValueError("dtype: auto is for device cpu; a GPU profile names its dtype")
        if self.kinds is not None:
            if self.device != "cpu":
                raise ValueError("kinds: CPU kinds are for device cpu")
            missing = [k for k in CPU_KINDS if k not in self.kinds]
            if missing:
                raise ValueError(
                    f"kinds: declare every CPU kind ({', '.join(CPU_KINDS)}); missing {missing[0]}"
                )
        if self.compile == "auto" and self.kinds is None:
            raise ValueError("compile: auto takes its value from kinds; declare kinds or use true/false")
        return self
