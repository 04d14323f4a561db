"""Precision policies and dynamic loss scaling.

A policy names four dtypes: stored params, compute (params and floating inputs inside the
forward/backward pass), model outputs, and the gradient all-reduce. Loss scaling is on when the
compute dtype is float16; its scale and counter live in the train state, so they are checkpointed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from xlatrain.config import LossScaleConfig, PrecisionConfig

_POLICY_COMPUTE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Policy:
    param: jnp.dtype
    compute: jnp.dtype
    output: jnp.dtype
    communication: jnp.dtype
    loss_scale: LossScaleConfig | None
    """Dynamic loss scaling settings, or None when the compute dtype does not need it."""

    @property
    def dynamic_scale(self) -> bool:
        return self.loss_scale is not None

    def describe(self) -> str:
        text = (f"params {self.param.name}, compute {self.compute.name}, outputs {self.output.name}, "
                f"gradient all-reduce {self.communication.name}")
        if self.loss_scale is not None:
            text += f", dynamic loss scale from {self.loss_scale.initial:g}"
        return text


def resolve_policy(config: PrecisionConfig, communication: str = "float32") -> Policy:
    """The dtypes of a run; `communication` is collectives.dtype."""
    compute = jnp.dtype(config.compute_dtype or _POLICY_COMPUTE[config.policy])
    return Policy(param=jnp.dtype(config.param_dtype or "float32"), compute=compute,
                  output=jnp.dtype(config.output_dtype or "float32"),
                  communication=jnp.dtype(communication),
                  loss_scale=config.loss_scale if compute == jnp.float16 else None)


def cast_floats(tree: Any, dtype: jnp.dtype) -> Any:
    """Cast every floating leaf to `dtype`; integer leaves (token ids, counters) are left alone."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@flax.struct.dataclass
class LossScale:
    scale: jax.Array
    """float32 factor the loss is multiplied by before differentiation (1 without loss scaling)."""
    good_steps: jax.Array
    """Consecutive steps with finite gradients since the scale last changed."""


def initial_loss_scale(policy: Policy) -> LossScale:
    scale = policy.loss_scale.initial if policy.loss_scale is not None else 1.0
    return LossScale(scale=jnp.asarray(scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32))


def next_loss_scale(current: LossScale, finite: jax.Array, config: LossScaleConfig | None) -> LossScale:
    """Back off on overflow; grow after `growth_interval` finite steps in a row; stay within bounds."""
    if config is None:
        return current
    grown = current.good_steps + 1 >= config.growth_interval
    scale = jnp.where(finite, jnp.where(grown, current.scale * config.growth_factor, current.scale),
                      current.scale * config.backoff_factor)
    good_steps = jnp.where(finite & ~grown, current.good_steps + 1, 0)
    return LossScale(scale=jnp.clip(scale, config.min, config.max).astype(jnp.float32),
                     good_steps=good_steps.astype(jnp.int32))
