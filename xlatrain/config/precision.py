"""The `precision` section: dtype policies and dynamic loss scaling."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from xlatrain.config.base import Fraction, PositiveInt, Strict

FloatDtype = Literal["float32", "bfloat16", "float16"]


class LossScaleConfig(Strict):
    """Dynamic loss scaling (used when the compute dtype is float16)."""

    initial: Annotated[float, Field(gt=0)] = 2.0**15
    """The loss scale at the start."""
    growth_factor: Annotated[float, Field(gt=1)] = 2.0
    """Multiply the scale by this after loss_scale.growth_interval finite steps in a row."""
    growth_interval: PositiveInt = 2000
    """Grow the scale after this many consecutive steps with finite gradients."""
    backoff_factor: Fraction = 0.5
    """Multiply the scale by this on an overflow (the update is skipped)."""
    min: Annotated[float, Field(gt=0)] = 1.0
    """Smallest scale; an overflow at it counts as a non-finite loss (trainer.on_nonfinite)."""
    max: Annotated[float, Field(gt=0)] = 2.0**24
    """Largest scale."""

    @model_validator(mode="after")
    def _ordered(self) -> LossScaleConfig:
        if not self.min <= self.initial <= self.max:
            raise ValueError(f"precision.loss_scale needs min <= initial <= max (got min={self.min}, "
                             f"initial={self.initial}, max={self.max})")
        return self


class PrecisionConfig(Strict):
    """Dtype policies in the AMP order: scaled gradients, synchronised, then unscaled, checked and clipped
    before the update (docs/performance.md)."""

    policy: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32: everything float32. bf16 / fp16: float32 params, compute in bfloat16 / float16, float32
    outputs; fp16 adds dynamic loss scaling."""
    param_dtype: FloatDtype | None = None
    """Stored (master) parameter dtype; default float32."""
    compute_dtype: FloatDtype | None = None
    """Dtype of params and floating inputs inside the forward/backward pass; default from the policy."""
    output_dtype: FloatDtype | None = None
    """Dtype of the model's outputs (the logits the loss sees); default float32."""
    loss_scale: LossScaleConfig = LossScaleConfig()
