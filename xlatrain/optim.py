"""Optimizer and learning-rate schedule from config, built from optax's pieces.

Every optimizer is the same chain: the optimizer's scaling -> decoupled weight decay (not on biases
and norm scales) -> multiply by the scheduled learning rate. Global-norm clipping (optimizer.clip_norm)
is not in the chain: the train step applies it to the synchronised, unscaled gradients (the AMP order).
"""

from __future__ import annotations

from functools import partial

import jax
import optax

from xlatrain.config import AdafactorConfig, AdamWConfig, Derived, LionConfig, OptimizerConfig, SGDConfig
from xlatrain.models.blocks import BLOCKS


def learning_rate_schedule(config: OptimizerConfig, derived: Derived, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the effective (batch-scaled) LR, then constant, cosine or linear decay."""
    peak = derived.effective_lr
    warmup = min(config.warmup_steps, total_steps)
    final = peak * config.final_lr_fraction
    decay_steps = max(total_steps - warmup, 1)
    after = {
        "constant": optax.constant_schedule(peak),
        "cosine": optax.cosine_decay_schedule(peak, decay_steps, alpha=config.final_lr_fraction),
        "linear": optax.linear_schedule(peak, final, decay_steps),
    }[config.schedule]
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def decay_mask(params, block_axes: int = 0):
    """Weight decay applies to matrices and kernels only: rank < 2 means a bias or a norm scale. Under
    "blocks" (a BlockStack's stacked layers) the leading `block_axes` axes stack layers and do not count."""

    def decayed(path, p):
        stacked = block_axes if path and getattr(path[0], "key", None) == BLOCKS else 0
        return p.ndim - stacked >= 2

    return jax.tree_util.tree_map_with_path(decayed, params)


def build_optimizer(config: OptimizerConfig, schedule: optax.Schedule,
                    block_axes: int = 0) -> optax.GradientTransformation:
    """`block_axes`: how many leading axes stack the layers of a BlockStack's params (see decay_mask)."""
    parts = _scaling(config)
    if config.weight_decay > 0:
        parts.append(optax.add_decayed_weights(config.weight_decay, mask=partial(decay_mask, block_axes=block_axes)))
    parts.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*parts)


def _scaling(config: OptimizerConfig) -> list[optax.GradientTransformation]:
    if isinstance(config, AdamWConfig):
        return [optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps)]
    if isinstance(config, SGDConfig):
        return [optax.trace(decay=config.momentum, nesterov=config.nesterov)] if config.momentum else []
    if isinstance(config, LionConfig):
        return [optax.scale_by_lion(b1=config.b1, b2=config.b2)]
    assert isinstance(config, AdafactorConfig)
    return [optax.scale_by_factored_rms(decay_rate=config.decay_rate,
                                        min_dim_size_to_factor=config.min_dim_size_to_factor),
            optax.clip_by_block_rms(1.0)]
