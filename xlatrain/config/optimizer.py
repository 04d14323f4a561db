"""The `batch` and `optimizer` sections: what one optimizer step sees and does."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from xlatrain.config.base import Fraction, NonNegativeInt, PositiveInt, Strict


class BatchConfig(Strict):
    """What one optimizer step sees. The global batch is the data-parallel size x the per-replica batch, and must
    divide by the data-parallel size x batch.microbatches; with a pipeline, each replica's accumulation microbatch
    is cut again into parallel.pipeline.microbatches (docs/pipelines.md)."""

    global_size: PositiveInt | None = None
    """Samples per optimizer step over all replicas; 16 when neither size is set."""
    per_replica: PositiveInt | None = None
    """Samples per optimizer step on each data-parallel replica (alternative to global_size)."""
    microbatches: PositiveInt = 1
    """Gradient accumulation inside the compiled step (`lax.scan`); equals one step on the whole batch."""

    @model_validator(mode="after")
    def _at_most_one_size(self) -> BatchConfig:
        if self.global_size is not None and self.per_replica is not None:
            raise ValueError("set only one of batch.global_size and batch.per_replica")
        if self.global_size is None and self.per_replica is None:
            object.__setattr__(self, "global_size", 16)
        return self


class OptimizerBase(Strict):
    """Every optimizer is one optax chain: its own scaling, decoupled weight decay, then the scheduled learning
    rate; global-norm clipping applies to the synchronised, unscaled gradients before it (the AMP order). The
    effective learning rate is printed at the start, saved in config.yaml and logged every step (`lr`)."""

    lr: Annotated[float, Field(gt=0)] = 3e-3
    """Peak learning rate at optimizer.base_batch_size."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """linear or sqrt: scale optimizer.lr by (global batch / optimizer.base_batch_size) or its square root."""
    base_batch_size: PositiveInt | None = None
    """Global batch that optimizer.lr was tuned for; default: the run's global batch."""
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """constant, cosine or linear decay after the warmup, up to the horizon (optimizer.decay_steps)."""
    warmup_steps: NonNegativeInt = 0
    """Linear warmup from 0, clamped to the schedule's horizon."""
    decay_steps: PositiveInt | None = None
    """The schedule's horizon (warmup included): the step where decay ends. null: trainer.steps when the run is
    created; saved in the run's config.yaml, so resuming with more trainer.steps keeps it unless this is set."""
    final_lr_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    """End of the decay, as a fraction of the peak."""
    clip_norm: Annotated[float, Field(gt=0)] | None = 1.0
    """Clip the synchronised, unscaled gradients to this global norm; null: no clipping."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """Decoupled weight decay (not on parameters of rank < 2: biases and norm scales)."""


class AdamWConfig(OptimizerBase):
    name: Literal["adamw"]
    """optax's AdamW."""
    b1: Fraction = 0.9
    """Decay of Adam's first moment."""
    b2: Fraction = 0.999
    """Decay of Adam's second moment."""
    eps: Annotated[float, Field(gt=0)] = 1e-8
    """Adam's epsilon."""


class SGDConfig(OptimizerBase):
    name: Literal["sgd"]
    """SGD with momentum."""
    momentum: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    """Heavy-ball momentum (0: plain SGD)."""
    nesterov: bool = False
    """Nesterov momentum."""


class LionConfig(OptimizerBase):
    name: Literal["lion"]
    """Lion (sign of the interpolated momentum)."""
    b1: Fraction = 0.9
    """Lion's interpolation factor."""
    b2: Fraction = 0.99
    """Lion's momentum decay."""


class AdafactorConfig(OptimizerBase):
    name: Literal["adafactor"]
    """optax's Adafactor: factored second moments, update clipping at RMS 1; each layer of stacked blocks is its
    own matrix."""
    decay_rate: Fraction = 0.8
    """Second-moment decay exponent."""
    min_dim_size_to_factor: PositiveInt = 128
    """Second moments are factored over dimensions of at least this size."""


OptimizerConfig = Annotated[
    Union[AdamWConfig, SGDConfig, LionConfig, AdafactorConfig], Field(discriminator="name")
]
