"""Optimizer and learning-rate schedule from config, built from optax's pieces.

Every optimizer is the same chain: the optimizer's scaling -> decoupled weight decay (not on biases
and norm scales) -> multiply by the scheduled learning rate. Global-norm clipping (optimizer.clip_norm)
is not in the chain: the train step applies it to the synchronised, unscaled gradients (the AMP order).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from xlatrain.config import (
    AdafactorConfig,
    AdamWConfig,
    Derived,
    LionConfig,
    OptimizerConfig,
    SGDConfig,
)
from xlatrain.models.blocks import in_blocks


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


def stacked_axes(params, block_axes: int):
    """Per leaf, how many leading axes stack layers: `block_axes` under "blocks" (a BlockStack's stacked
    layers), 0 elsewhere."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: block_axes if in_blocks(path) else 0, params)


def decay_mask(params, block_axes: int = 0):
    """Weight decay applies to matrices and kernels only: rank < 2 (not counting the axes that stack layers)
    means a bias or a norm scale."""
    return jax.tree.map(lambda p, stacked: p.ndim - stacked >= 2, params, stacked_axes(params, block_axes))


_ONE = "param"
"""The key of the one-parameter tree `layerwise` hands its inner transformation."""


def _is_one(node) -> bool:
    return isinstance(node, dict) and set(node) == {_ONE}


def layerwise(inner: optax.GradientTransformation, block_axes: int) -> optax.GradientTransformation:
    """`inner` applied to each parameter on its own and, in a BlockStack's stacked params, to each layer on
    its own (vmapped over the `block_axes` leading axes). This is what a per-parameter optimizer (Adafactor's
    factored moments and update clipping by a parameter's RMS) means for stacked layers, and it makes the
    update the same whether the layers are stacked [layers, ...] or laid out for a pipeline [virtual stages,
    stages, blocks, ...], padding blocks included (they stay zero). `inner`'s state may hold parameter-shaped
    trees (each parameter's part vmapped) and shared values such as a step count (not vmapped: they must not
    depend on a parameter)."""

    def one_param_state(leaf, stacked: int):
        """The structure of `inner`'s state for one layer of `leaf`."""
        return jax.eval_shape(lambda q: inner.init({_ONE: q}), jax.ShapeDtypeStruct(leaf.shape[stacked:], leaf.dtype))

    def vmap_axes(state):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: 0 if jax.tree_util.DictKey(_ONE) in path else None, state)

    def over_layers(fn, stacked: int, in_axes, out_axes):
        for _ in range(stacked):
            fn = jax.vmap(fn, in_axes=in_axes, out_axes=out_axes)
        return fn

    def assemble(states: list, treedef):
        """One state from each parameter's: their parameter-shaped parts as trees, shared parts from the first."""
        return jax.tree.map(lambda *nodes: treedef.unflatten([n[_ONE] for n in nodes]) if _is_one(nodes[0])
                            else nodes[0], *states, is_leaf=_is_one)

    def part_of(state, template, treedef, index: int):
        return jax.tree.map(lambda t, node: {_ONE: treedef.flatten_up_to(node)[index]} if _is_one(t) else node,
                            template, state, is_leaf=_is_one)

    def init(params):
        leaves, treedef = jax.tree.flatten(params)
        if not leaves:  # optax.tree_map_params' placeholder for the whole params
            return inner.init(params)
        states = []
        for leaf, stacked in zip(leaves, jax.tree.leaves(stacked_axes(params, block_axes)), strict=True):
            axes = vmap_axes(one_param_state(leaf, stacked))
            states.append(over_layers(lambda q: inner.init({_ONE: q}), stacked, 0, axes)(leaf))
        return assemble(states, treedef)

    def update(updates, state, params=None):
        leaves, treedef = jax.tree.flatten(updates)
        if not leaves:
            return inner.update(updates, state, params)
        param_leaves = treedef.flatten_up_to(params) if params is not None else [None] * len(leaves)

        def one(u, s, p):
            new_u, new_s = inner.update({_ONE: u}, s, None if p is None else {_ONE: p})
            return new_u[_ONE], new_s

        results = []
        for index, (u, p, stacked) in enumerate(zip(leaves, param_leaves,
                                                     jax.tree.leaves(stacked_axes(updates, block_axes)), strict=True)):
            template = one_param_state(u, stacked)
            axes = vmap_axes(template)
            run = over_layers(one, stacked, (0, axes, None if p is None else 0), (0, axes))
            results.append(run(u, part_of(state, template, treedef, index), p))
        return treedef.unflatten([u for u, _ in results]), assemble([s for _, s in results], treedef)

    return optax.GradientTransformation(init, update)


def build_optimizer(config: OptimizerConfig, schedule: optax.Schedule, block_axes: int = 0,
                    frozen: Any = None) -> optax.GradientTransformation:
    """`block_axes`: how many leading axes stack the layers of a BlockStack's params (see decay_mask).
    `frozen`: ModelDef.frozen; the frozen parameters' gradients are zero (the forward stops them), so every
    scaling would leave them as they are: it is masked off them, keeping no moments for them (a frozen
    backbone's), and weight decay must skip them too."""
    parts = _scaling(config, block_axes)
    if frozen is not None and parts:
        parts = [optax.masked(optax.chain(*parts), jax.tree.map(lambda f: f is not True, frozen))]
    if config.weight_decay > 0:
        def mask(params):
            decayed = decay_mask(params, block_axes)
            return decayed if frozen is None else jax.tree.map(lambda d, f: d and f is False, decayed, frozen)

        parts.append(optax.add_decayed_weights(config.weight_decay, mask=mask))
    parts.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*parts)


def _scaling(config: OptimizerConfig, block_axes: int) -> list[optax.GradientTransformation]:
    if isinstance(config, AdamWConfig):
        return [optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps)]
    if isinstance(config, SGDConfig):
        return [optax.trace(decay=config.momentum, nesterov=config.nesterov)] if config.momentum else []
    if isinstance(config, LionConfig):
        return [optax.scale_by_lion(b1=config.b1, b2=config.b2)]
    assert isinstance(config, AdafactorConfig)
    # Factored second moments and update clipping per weight matrix: per layer of a stacked block.
    return [layerwise(optax.chain(optax.scale_by_factored_rms(decay_rate=config.decay_rate,
                                                              min_dim_size_to_factor=config.min_dim_size_to_factor),
                                  optax.clip_by_block_rms(1.0)), block_axes)]
