"""The `batch` and `optimizer` sections: what one optimizer step sees and does."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from xlatrain.config.base import Fraction, NonNegativeInt, PositiveInt, Strict


class BatchConfig(Strict):
    global_size: PositiveInt | None = None
    """Samples per optimizer step over all replicas; 16 when neither size is set."""
    per_replica: PositiveInt | None = None
    """Samples per optimizer step on each data-parallel replica (alternative to global_size)."""
    microbatches: PositiveInt = 1
    """Gradient-accumulation steps inside one compiled step."""

    @model_validator(mode="after")
    def _at_most_one_size(self) -> BatchConfig:
        if self.global_size is not None and self.per_replica is not None:
            raise ValueError("set only one of batch.global_size and batch.per_replica")
        if self.global_size is None and self.per_replica is None:
            object.__setattr__(self, "global_size", 16)
        return self


class OptimizerBase(Strict):
    lr: Annotated[float, Field(gt=0)] = 3e-3
    """Peak learning rate at optimizer.base_batch_size."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch_size: PositiveInt | None = None
    """Global batch that optimizer.lr was tuned for; default: the run's global batch."""
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    """Linear warmup from 0, clamped to the schedule's horizon."""
    decay_steps: PositiveInt | None = None
    """The schedule's horizon (warmup included): the step where decay ends. null: trainer.steps when the run is
    created; saved in the run's config.yaml, so resuming with more trainer.steps keeps it unless this is set."""
    final_lr_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    clip_norm: Annotated[float, Field(gt=0)] | None = 1.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0


class AdamWConfig(OptimizerBase):
    name: Literal["adamw"]
    b1: Fraction = 0.9
    b2: Fraction = 0.999
    eps: Annotated[float, Field(gt=0)] = 1e-8


class SGDConfig(OptimizerBase):
    name: Literal["sgd"]
    momentum: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    nesterov: bool = False


class LionConfig(OptimizerBase):
    name: Literal["lion"]
    b1: Fraction = 0.9
    b2: Fraction = 0.99


class AdafactorConfig(OptimizerBase):
    name: Literal["adafactor"]
    decay_rate: Fraction = 0.8
    min_dim_size_to_factor: PositiveInt = 128


OptimizerConfig = Annotated[
    Union[AdamWConfig, SGDConfig, LionConfig, AdafactorConfig], Field(discriminator="name")
]
