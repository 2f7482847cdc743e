"""The allowed values of the config's and the command line's choices, each defined once.

A config field is typed with its alias (pydantic refuses anything else, naming the choices); code that needs
the values as a tuple (argparse choices, error messages) takes `values(Alias)`.
"""

from typing import Literal, get_args

DecayShape = Literal["linear", "cosine", "1-sqrt"]  # the WSD schedule's decay (train/schedule.py)
OnIdentityChange = Literal["move", "delete"]  # what a changed run does with the old one
TrainLoader = Literal["bytes", "shards"]  # bytes: the smoke stage's raw UTF-8; shards: `enlace shard` output
InstructFormat = Literal["dolly", "chat"]  # instruction data rows (finetune/data.py)
OptimizerName = Literal["adamw", "muon"]  # adamw for everything, or muon for the hidden matrices
MuonAdjustLr = Literal["original", "match_rms_adamw"]  # how torch.optim.Muon scales lr by matrix shape
NewtonSchulzDtype = Literal["bf16", "fp32"]  # the dtype of Muon's Newton-Schulz matmuls (train/optim.py)
DecodeWeights = Literal["auto", "fp32", "bf16", "int8"]  # generation weights (generate.decode_weights)
HeadWeights = Literal["same", "int8"]  # the output head's: as the rest, or int8 (generate.HEAD_WEIGHTS)
# Which kernels decode (generate.decode_weights): auto takes ENLACE's decode kernels wherever they build (else
# torch's), torch keeps torch's own (oneDNN where it packs bf16, its int8 kernel), enlace insists on ENLACE's.
DecodeKernels = Literal["auto", "torch", "enlace"]
KERNELS_HELP = (
    "which kernels decode: auto (ENLACE's kernels at every precision wherever they build, with oneDNN's bf16 "
    "GEMM for prefills on a CPU with native bf16; torch's elsewhere), torch (torch's own everywhere: oneDNN's "
    "packed bf16, torch's int8 kernel) or enlace (ENLACE's, refused where they do not build)"
)
HEAD_HELP = (
    "the output head's weights: same (as --weights) or int8 (weight-only, a scale per row, whatever --weights "
    "is; a tied embedding reads the same rows: one int8 copy)"
)


def values(alias: object) -> tuple[str, ...]:
    return get_args(alias)
