"""Optimizer and learning-rate schedule from config, built from optax's pieces.

Every optimizer is the same chain: the optimizer's scaling -> decoupled weight decay (not on biases
and norm scales) -> multiply by the scheduled learning rate. Global-norm clipping (optimizer.clip_norm)
is not in the chain: the train step applies it to the synchronised, unscaled gradients (the AMP order).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from xlatrain.config import (
    AdafactorConfig,
    AdamWConfig,
    Derived,
    LionConfig,
    MuonConfig,
    OptimizerConfig,
    ScheduleFreeAdamWConfig,
    SGDConfig,
)
from xlatrain.errors import UserError
from xlatrain.models.blocks import in_blocks
from xlatrain.muon import MatrixOwners, muon_labels, scale_by_muon


def learning_rate_schedule(config: OptimizerConfig, derived: Derived, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the effective (batch-scaled) LR, then constant, cosine or linear decay, or WSD's
    stable phase and cooldown; `total_steps`: the horizon."""
    peak = derived.effective_lr
    final = peak * config.final_lr_fraction
    if config.schedule == "wsd":
        return _warmup_stable_decay(config, peak, final, total_steps)
    warmup = min(config.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    after = {
        "constant": optax.constant_schedule(peak),
        "cosine": optax.cosine_decay_schedule(peak, decay_steps, alpha=config.final_lr_fraction),
        "linear": optax.linear_schedule(peak, final, decay_steps),
    }[config.schedule]
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _warmup_stable_decay(config: OptimizerConfig, peak: float, final: float, horizon: int) -> optax.Schedule:
    cooldown = config.cooldown_steps or max(horizon // 5, 1)
    stable_from, decay_from = config.warmup_steps, horizon - cooldown
    if decay_from < stable_from:
        raise UserError(f"config: optimizer.schedule=wsd warms up for {stable_from} steps and cools down for "
                        f"{cooldown}, more than its horizon of {horizon} steps (optimizer.decay_steps, or "
                        "trainer.steps when it is null): shorten optimizer.warmup_steps or optimizer.cooldown_steps, "
                        "or lengthen the horizon")
    shape = config.cooldown_shape or "linear"
    decay = {"linear": optax.linear_schedule(peak, final, cooldown),
             "cosine": optax.cosine_decay_schedule(peak, cooldown, alpha=config.final_lr_fraction),
             "1-sqrt": lambda step: final + (peak - final) * (1 - jnp.sqrt(jnp.clip(step / cooldown, 0.0, 1.0)))}[shape]
    phases = [optax.constant_schedule(peak), decay]
    if stable_from:
        phases.insert(0, optax.linear_schedule(0.0, peak, stable_from))
    return optax.join_schedules(phases, [stable_from, decay_from] if stable_from else [decay_from])


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
                    frozen: Any = None, owners: MatrixOwners | None = None) -> optax.GradientTransformation:
    """`block_axes`: how many leading axes stack the layers of a BlockStack's params (see decay_mask).
    `frozen`: ModelDef.frozen; the frozen parameters' gradients are zero (the forward stops them), so every
    scaling would leave them as they are: it is masked off them, keeping no moments for them (a frozen
    backbone's), and weight decay must skip them too. `owners`: where Muon orthogonalises each matrix."""
    if isinstance(config, MuonConfig):
        return _muon(config, schedule, block_axes, frozen, owners)
    if isinstance(config, ScheduleFreeAdamWConfig):
        return _schedule_free(config, schedule, block_axes)
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


def _muon(config: MuonConfig, schedule: optax.Schedule, block_axes: int, frozen: Any,
          owners: MatrixOwners | None) -> optax.GradientTransformation:
    """Two groups (muon.py's labels): Muon's orthogonalised momentum on the hidden matrices, AdamW on the rest,
    each with its decay and its peak learning rate on the one schedule; nothing on frozen parameters."""
    adam_lr = config.adam_lr or config.lr
    adam_decay = config.weight_decay if config.adam_weight_decay is None else config.adam_weight_decay
    muon = optax.chain(
        scale_by_muon(config.momentum, config.nesterov, config.ns_steps, config.rms_match, block_axes, owners,
                      config.eps),
        optax.add_decayed_weights(config.weight_decay),
        optax.scale_by_learning_rate(schedule))
    adam = optax.chain(
        optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps),
        optax.add_decayed_weights(adam_decay, mask=lambda params: decay_mask(params, block_axes)),
        optax.scale_by_learning_rate(lambda step: schedule(step) * (adam_lr / config.lr)))
    return optax.partition({"muon": muon, "adam": adam, "frozen": optax.set_to_zero()},
                           lambda params: muon_labels(params, frozen))


def _schedule_free(config: ScheduleFreeAdamWConfig, schedule: optax.Schedule,
                   block_axes: int) -> optax.GradientTransformation:
    """optax.contrib.schedule_free_adamw's chain, with xlatrain's weight-decay mask and its schedule (a constant
    with the warmup, as schedule_free_adamw's warmup_steps makes)."""
    base = optax.chain(
        optax.scale_by_rms(decay=config.b2, eps=config.eps, eps_in_sqrt=False, bias_correction=True),
        optax.add_decayed_weights(config.weight_decay, mask=lambda params: decay_mask(params, block_axes)),
        optax.scale_by_learning_rate(schedule))
    return optax.contrib.schedule_free(base, learning_rate=schedule, b1=config.b1,
                                       weight_lr_power=config.weight_lr_power)


def evaluated_params(opt_state: Any, params: Any) -> Any:
    """The params to evaluate, export and sample: schedule-free's average x (from the gradient's point y and the
    iterate z in its state), the params themselves for every other optimizer."""
    states = [node for node in jax.tree.leaves(opt_state, is_leaf=_is_schedule_free)
              if _is_schedule_free(node)]
    return optax.contrib.schedule_free_eval_params(states[0], params) if states else params


def _is_schedule_free(node: Any) -> bool:
    return isinstance(node, optax.contrib.ScheduleFreeState)


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
