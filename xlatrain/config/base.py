"""What every config section shares: the strict frozen base and the number types."""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

INT32_MAX = 2**31 - 1
"""Counts and sizes must fit the int32 that array shapes, indices and XLA's loop counters use."""
PositiveInt = Annotated[int, Field(gt=0, le=INT32_MAX)]
NonNegativeInt = Annotated[int, Field(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
"""What numpy's and torch's generators accept."""
Fraction = Annotated[float, Field(gt=0.0, lt=1.0)]
DropoutRate = Annotated[float, Field(ge=0.0, lt=1.0)]


def expanded(value: Any) -> Any:
    """A path as a shell would have made it: `~` and $VARIABLES expanded (a shell leaves them alone inside
    key=value, and YAML always does); anything but a string as it is."""
    return os.path.expandvars(os.path.expanduser(value)) if isinstance(value, str) else value


PathText = Annotated[str, BeforeValidator(expanded)]
"""A config value that names a file or directory."""


class Strict(BaseModel):
    """A config section: unknown keys refused, frozen once validated. Each field's docstring is its description:
    docs/configuration.md is generated from them (config/reference.py, which reads them from the source, so that
    loading a config does not)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, allow_inf_nan=False)


def positive_ints(value: Any) -> bool:
    """Whether a raw config value is a list of integers >= 1 (YAML's true is not one)."""
    return isinstance(value, (list, tuple)) and all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)
