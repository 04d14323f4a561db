"""Optimizer and learning-rate schedule from config, built from optax's pieces.

Every optimizer is the same chain: the optimizer's scaling -> decoupled weight decay (not on biases
and norm scales) -> multiply by the scheduled learning rate. Global-norm clipping (optimizer.clip_norm)
is not in the chain: the train step applies it to the synchronised, unscaled gradients (the AMP order).
"""

from __future__ import annotations

import jax
import optax

from xlatrain.config import AdafactorConfig, AdamWConfig, Derived, LionConfig, OptimizerConfig, SGDConfig


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


def decay_mask(params):
    """Weight decay applies to matrices and kernels only: rank < 2 means a bias or a norm scale."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def build_optimizer(config: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    parts = _scaling(config)
    if config.weight_decay > 0:
        parts.append(optax.add_decayed_weights(config.weight_decay, mask=decay_mask))
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
