"""Shared base for every config layer: unknown keys are errors, at every level.

Fields use pydantic's StrictInt/StrictFloat/StrictBool: `true` is never the number 1, nor `1` a boolean
(lax pydantic would coerce both). StrictFloat still takes an integer (`lr: 1`). NaN and infinity are not
config values.
"""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)
