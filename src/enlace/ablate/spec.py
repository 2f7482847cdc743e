"""An ablation file (configs/ablations/<name>.yaml): the variants of one run that `enlace ablate` compares.

Every variant is the selected run (params.yaml, its `stage`, its `set`) plus the variant's own overrides.
The harness decides the step count, the schedule's lengths, the seed and the checkpoint and eval cadence
itself, so a variant may not set those (see FITTED).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, StrictFloat, StrictInt, ValidationError, field_validator, model_validator

from ..config.base import Strict
from ..config.resolve import _read_yaml
from ..errors import ConfigError

BASELINE = "baseline"
# Keys the harness sets for each run: the budget decides the step count and the schedule's lengths, the
# seed list the seed; checkpoints and evaluations other than the last would spend the budget unevenly.
FITTED = (
    "train.max_steps",
    "train.schedule.warmup_steps",
    "train.schedule.decay_steps",
    "train.seed",
    "train.checkpoint.every",
    "train.eval_every",
)
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")  # a variant's name is a folder name


class AblationSpec(Strict):
    name: str = Field(pattern=NAME.pattern)
    # Wall-time budget of each variant's training (the whole pretrain command), in seconds.
    budget_s: StrictFloat = Field(gt=0)
    # Seeds, first first. Every variant runs the first; a variant whose prose bits per byte lands within
    # `second_seed_below` (relative) of the baseline's runs the others too, and so does the baseline:
    # a difference that small is within what a seed alone can move.
    seeds: list[StrictInt] = Field(default=[1337, 1338], min_length=1)
    second_seed_below: StrictFloat = Field(default=0.01, ge=0)
    # A params.yaml section whose layers replace `config`'s (`smoke`: the byte-level model), or none.
    stage: Literal["smoke"] | None = None
    set: list[str] = []  # overrides every variant shares, baseline included
    # Steps of the calibration run that measures a variant's step time (the first logged interval,
    # start-up and compilation, is not a step time: it goes to the fixed overhead).
    calibration_steps: StrictInt = Field(default=40, ge=10)
    # Plan the steps for this fraction of the budget: step times drift on a shared machine, and a run
    # past its budget is stopped (SIGTERM: it saves) before its decay ends.
    fill: StrictFloat = Field(default=0.95, gt=0, le=1)
    # name -> overrides ("section.key=value"); "baseline" (no overrides, usually) is the reference row.
    variants: dict[str, list[str]]

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"seeds repeat: {v}")
        return v

    @model_validator(mode="after")
    def _variants(self) -> AblationSpec:
        if BASELINE not in self.variants:
            raise ValueError(f"variants must include {BASELINE!r}, the row every other is compared with")
        for name, overrides in [("set", self.set), *self.variants.items()]:
            if name != "set" and not NAME.match(name):
                raise ValueError(f"variant name {name!r}: use lowercase letters, digits, '.', '_' or '-'")
            for o in overrides:
                key = o.split("=", 1)[0].strip()
                if "=" not in o or "." not in key:
                    raise ValueError(f"{name}: {o!r} is not section.key=value")
                if key in FITTED:
                    raise ValueError(
                        f"{name}: {key} is set by the harness for the budget ({', '.join(FITTED)})"
                    )
        return self


def load_spec(path: Path) -> AblationSpec:
    try:
        return AblationSpec.model_validate(_read_yaml(Path(path), "ablation"))
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(map(str, err["loc"])) or "ablation"
        raise ConfigError(str(path), where, err["msg"].removeprefix("Value error, ")) from None
