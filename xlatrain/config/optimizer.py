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
    schedule: Literal["constant", "cosine", "linear", "wsd"] = "cosine"
    """constant, cosine or linear decay after the warmup, up to the horizon (optimizer.decay_steps). wsd
    (warmup-stable-decay): the peak from the warmup's end until optimizer.cooldown_steps before the horizon, then
    a decay of optimizer.cooldown_shape to the final rate at the horizon."""
    warmup_steps: NonNegativeInt = 0
    """Linear warmup from 0, clamped to the schedule's horizon."""
    decay_steps: PositiveInt | None = None
    """The schedule's horizon (warmup included): the step where decay ends. null: trainer.steps when the run is
    created; saved in the run's config.yaml, so resuming with more trainer.steps keeps it unless this is set."""
    cooldown_steps: PositiveInt | None = None
    """optimizer.schedule=wsd: the decay's steps, ending at the horizon; null: a fifth of the horizon."""
    cooldown_shape: Literal["linear", "cosine", "1-sqrt"] | None = None
    """optimizer.schedule=wsd: the decay's shape from the peak to the final rate (1-sqrt: 1 - sqrt(progress),
    Hägele et al.'s); null: linear."""
    final_lr_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    """End of the decay, as a fraction of the peak."""
    clip_norm: Annotated[float, Field(gt=0)] | None = 1.0
    """Clip the synchronised, unscaled gradients to this global norm; null: no clipping."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """Decoupled weight decay (not on parameters of rank < 2: biases and norm scales)."""


    @model_validator(mode="after")
    def _cooldown_only_with_wsd(self) -> OptimizerBase:
        for key in ("cooldown_steps", "cooldown_shape"):
            if getattr(self, key) is not None and self.schedule != "wsd":
                raise ValueError(f"optimizer.{key} shapes the decay of optimizer.schedule=wsd, and the schedule is "
                                 f"{self.schedule}: set optimizer.schedule=wsd, or drop optimizer.{key}")
        return self


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


class MuonConfig(OptimizerBase):
    name: Literal["muon"]
    """Muon (optax.contrib's momentum, Newton-Schulz and state) for the hidden matrices of a BlockStack's layers:
    attention and MLP projections and each expert's matrices, each layer's matrix (and the GPT's q, k and v) its
    own. AdamW for the rest (embeddings, head, norms, biases, routers), with its own learning rate and decay.
    Runs in parallel.mode=jit with every strategy (each matrix orthogonalised whole on one of the devices that
    hold its shards), and in the per-device modes (a pipeline's) with parallel.strategy=replicated and
    mesh.tensor=1 (docs/training-step.md)."""
    momentum: Fraction = 0.95
    """Decay of Muon's momentum."""
    nesterov: bool = True
    """Nesterov momentum."""
    ns_steps: PositiveInt = 5
    """Newton-Schulz iterations (Keller Jordan's quintic coefficients)."""
    rms_match: Annotated[float, Field(gt=0)] | None = None
    """null: Keller Jordan's update scale sqrt(max(1, fan_out / fan_in)). A number (Moonlight: 0.2): scale each
    orthogonalised update by sqrt(max(fan_in, fan_out)) x it, an update RMS like AdamW's, so that AdamW's
    learning rate and weight decay carry over."""
    adam_lr: Annotated[float, Field(gt=0)] | None = None
    """Peak learning rate of the AdamW group (scaled and scheduled as optimizer.lr); null: optimizer.lr."""
    adam_weight_decay: Annotated[float, Field(ge=0)] | None = None
    """Decoupled weight decay of the AdamW group (its matrices: embeddings, head); null: optimizer.weight_decay."""
    b1: Fraction = 0.9
    """The AdamW group's first-moment decay."""
    b2: Fraction = 0.999
    """The AdamW group's second-moment decay."""
    eps: Annotated[float, Field(gt=0)] = 1e-8
    """The AdamW group's epsilon (and Muon's, in its Frobenius normalisation)."""


class ScheduleFreeAdamWConfig(OptimizerBase):
    name: Literal["schedule_free_adamw"]
    """optax.contrib's schedule-free AdamW (Defazio et al.): no decay schedule (optimizer.schedule=constant, its
    warmup optimizer.warmup_steps); the params trained are the gradient's point y, and evaluation, export --hf and
    sample use the averaged x (schedule_free_eval_params). Checkpoints hold the raw state."""
    b1: Fraction = 0.9
    """The interpolation between the average x and the iterate z (Adam's first-moment decay in the base)."""
    b2: Fraction = 0.999
    """Decay of the second moment."""
    eps: Annotated[float, Field(gt=0)] = 1e-8
    """Adam's epsilon."""
    weight_lr_power: Annotated[float, Field(ge=0)] = 2.0
    """Each step's weight in the average x: its learning rate to this power."""

    @model_validator(mode="after")
    def _constant_schedule(self) -> ScheduleFreeAdamWConfig:
        if self.schedule != "constant":
            raise ValueError(f"optimizer.name=schedule_free_adamw replaces the decay schedule (optimizer.schedule="
                             f"{self.schedule}): set optimizer.schedule=constant (optimizer.warmup_steps still warms "
                             "up)")
        return self


OptimizerConfig = Annotated[
    Union[AdamWConfig, SGDConfig, LionConfig, AdafactorConfig, MuonConfig, ScheduleFreeAdamWConfig],
    Field(discriminator="name")
]
