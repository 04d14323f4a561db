"""The Mixture-of-Experts feed-forward layer of the Llama decoder (model.moe): a float32 router, the routed experts'
SwiGLU MLPs (xlatrain/models/moe.py's formulations), shared experts beside them (DeepSeek's, or Qwen2-MoE's behind a
sigmoid gate), and what the layer tells the step about its routing (`RouterStats`), from which the step makes the
load-balancing losses over the global batch (lowering/step.py) and the router metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from xlatrain.compat.mapping import shard_map
from xlatrain.errors import UserError
from xlatrain.models.axes import axes
from xlatrain.models.blocks import BLOCKS
from xlatrain.models.flax_module import ModelState
from xlatrain.models.linear import linear
from xlatrain.models.moe import (
    ExpertGroup,
    Formulation,
    Score,
    current_expert_group,
    expert_parallel_experts,
    kept_choices,
    route,
    routed_experts,
)
from xlatrain.sharding import CONTEXT, EXPERT, ActivationLayout, expert_split

EXPERT_KERNEL_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                                          out_axis=-1, batch_axis=(0,))
"""nnx.Linear's default (LeCun normal) for each expert's [in, out] kernel on its own."""


@dataclass(frozen=True)
class MoEShape:
    experts: int
    top_k: int
    hidden: int
    """Each routed expert's hidden width."""
    shared_hidden: int = 0
    """The shared experts' hidden width, as one MLP (0: none)."""
    shared_gate: bool = False
    score: Score = "softmax"
    normalise: bool = True
    capacity_factor: float | None = None
    formulation: Formulation = "padded"
    balancing_bias: bool = False
    """DeepSeek-V3's aux-loss-free balancing: a per-expert bias, model state, shifts the choice."""


class RouterStats(NamedTuple):
    """One MoE layer's routing of the tokens it saw, as sums (they add up over replicas and microbatches)."""

    load: jax.Array
    """[E] float32: the (token, expert) choices each expert got, dropped ones included (no gradient)."""
    probability: jax.Array
    """[E] float32: the router's probabilities summed over the tokens (what the auxiliary loss differentiates)."""
    z: jax.Array
    """The router's logsumexp squared, summed over the tokens (ST-MoE's z-loss)."""
    dropped: jax.Array
    """Choices dropped by the capacity (0 when dropless)."""
    tokens: jax.Array
    """Tokens routed."""


class RouterBias(ModelState):
    """DeepSeek-V3's per-expert balancing bias: model state, moved after each step by the experts' load, never by
    the optimizer."""


def capacity_of(shape: MoEShape, tokens: int) -> int | None:
    """How many choices each expert takes from `tokens` tokens: capacity_factor x tokens x top_k / experts rounded
    up, at most the tokens (None: dropless)."""
    if shape.capacity_factor is None:
        return None
    return min(tokens, math.ceil(shape.capacity_factor * tokens * shape.top_k / shape.experts))


class SharedExperts(nnx.Module):
    """The experts every token goes through, as one SwiGLU MLP."""

    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs):
        self.gate, self.up = (linear(width, hidden, use_bias=False, kernel_metadata=axes("embed", "mlp"), rngs=rngs)
                              for _ in range(2))
        self.down = linear(hidden, width, use_bias=False, kernel_metadata=axes("mlp", "embed"), rngs=rngs)

    def __call__(self, x_TxD: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x_TxD)) * self.up(x_TxD))


class MoEMLP(nnx.Module):
    def __init__(self, width: int, shape: MoEShape, *, rngs: nnx.Rngs):
        self.shape = shape
        count, hidden = shape.experts, shape.hidden
        self.router = linear(width, count, use_bias=False, kernel_metadata=axes("embed", None), rngs=rngs)
        self.gate, self.up = (nnx.Param(EXPERT_KERNEL_INIT(rngs.params(), (count, width, hidden), jnp.float32),
                                        **axes("experts", "embed", "mlp")) for _ in range(2))
        self.down = nnx.Param(EXPERT_KERNEL_INIT(rngs.params(), (count, hidden, width), jnp.float32),
                              **axes("experts", "mlp", "embed"))
        self.bias = RouterBias(jnp.zeros((count,), jnp.float32)) if shape.balancing_bias else None
        self.shared = SharedExperts(width, shape.shared_hidden, rngs=rngs) if shape.shared_hidden else None
        self.shared_gate = linear(width, 1, use_bias=False, kernel_metadata=axes("embed", None), rngs=rngs) \
            if shape.shared_gate else None

    def __call__(self, x_BxLxD: jax.Array) -> tuple[jax.Array, RouterStats]:
        batch, length, width = x_BxLxD.shape
        bias = None if self.bias is None else jax.lax.stop_gradient(self.bias[...])
        weights = (self.router.kernel[...], self.gate[...], self.up[...], self.down[...], bias)
        layout, group = expert_split(), current_expert_group()
        if layout is not None:
            out_BxLxD, stats = expert_parallel_layer(self.shape, layout, x_BxLxD, *weights)
        else:  # one device's experts, or (a per-device program) this device's of its group: stats of its own rows
            out_BxLxD, stats = routed_layer(self.shape, x_BxLxD, *weights, group)
        if self.shared is not None:
            shared = self.shared(x_BxLxD)
            if self.shared_gate is not None:
                shared = jax.nn.sigmoid(self.shared_gate(x_BxLxD)) * shared
            out_BxLxD = out_BxLxD + shared
        return out_BxLxD, stats


def routed_layer(shape: MoEShape, x_BxLxD, router_DxE, gate, up, down, bias_E, group: ExpertGroup | None = None,
                 total=lambda x: x) -> tuple[jax.Array, RouterStats]:
    """The routed experts over a layer's tokens, and their RouterStats: on one device, or (`group`) on one device of
    an expert group holding its experts' weights, whose tokens `total` sums a value over."""
    batch, length, width = x_BxLxD.shape
    x_TxD = x_BxLxD.reshape(-1, width)
    logits_TxE = x_TxD.astype(jnp.float32) @ router_DxE.astype(jnp.float32)
    routing = route(logits_TxE, shape.top_k, shape.score, shape.normalise, bias_E)
    size = 1 if group is None else group.size
    capacity = capacity_of(shape, x_TxD.shape[0] * size)
    if group is None:
        out_TxD = routed_experts(x_TxD, routing, gate, up, down, shape.formulation, capacity)
    else:
        kept = routing if capacity is None else routing._replace(weights=jnp.where(
            kept_choices(routing.experts, shape.experts, capacity, group), routing.weights, 0.0))
        out_TxD = expert_parallel_experts(x_TxD, kept, gate, up, down, group, shape.formulation)
    return out_TxD.reshape(batch, length, width), router_stats(logits_TxE, routing, shape.experts, capacity, total,
                                                               group)


def expert_parallel_layer(shape: MoEShape, layout: ActivationLayout, x_BxLxD, router_DxE, gate, up, down, bias_E,
                          ) -> tuple[jax.Array, RouterStats]:
    """Inside one global program whose experts are split over `expert` (the traced step's `layout`): the routed
    experts through a shard_map region over the mesh, each device routing its part of the replica's rows (split
    over `expert`, and along the sequence over `context`) to the devices of its expert group by XLA's all-to-all;
    each expert's MLP split over `tensor` where the rules split `mlp`, its partial sums added over the group."""
    if x_BxLxD.shape[0] % layout.expert:
        raise UserError(f"mesh.expert={layout.expert} shares each data replica's rows among its devices, and a "
                        f"microbatch gives a replica {x_BxLxD.shape[0]} rows: make the rows per replica and microbatch "
                        f"(batch.global_size / mesh.data / batch.microbatches, and the eval batch's) a multiple of "
                        f"{layout.expert}")
    mlp = layout.axes_of("mlp")
    shared = tuple(axis for axis in (layout.rows_on, CONTEXT if layout.context > 1 else None) if axis)
    tokens = P(layout.rows(), CONTEXT if layout.context > 1 else None, None)
    expert_in, expert_out = P(EXPERT, None, mlp), P(EXPERT, mlp, None)
    group = xla_expert_group(layout.expert)

    def local(x, router, gate, up, down, bias):
        out, stats = routed_layer(shape, x, router, gate, up, down, bias, group,
                                  lambda value: jax.lax.psum(value, (EXPERT, *shared)))
        return (out if mlp is None else jax.lax.psum(out, mlp)), stats

    stats_spec = RouterStats(*[P()] * len(RouterStats._fields))
    return shard_map(local, layout.mesh, in_specs=(tokens, P(), expert_in, expert_in, expert_out, P()),
                     out_specs=(tokens, stats_spec))(x_BxLxD, router_DxE, gate, up, down, bias_E)


def xla_expert_group(size: int) -> ExpertGroup:
    """The devices over `expert` through XLA's collectives (inside a shard_map region over it)."""
    return ExpertGroup(size, lambda blocks: jax.lax.all_to_all(blocks, EXPERT, 0, 0, tiled=True),
                       lambda value: jax.lax.all_gather(value, EXPERT), lambda: jax.lax.axis_index(EXPERT))


def router_stats(logits_TxE: jax.Array, routing, count: int, capacity: int | None, total=lambda x: x,
                 group: ExpertGroup | None = None) -> RouterStats:
    """The layer's RouterStats, each summed by `total` (over the devices that share a replica's tokens); the
    choices dropped as the capacity counts them, over the expert group's tokens."""
    load = jnp.sum(jax.nn.one_hot(routing.experts, count, dtype=jnp.float32), axis=(0, 1))
    dropped = jnp.zeros((), jnp.float32)
    if capacity is not None:
        group_load = load if group is None else jnp.sum(group.all_gather(load), axis=0)
        dropped = jnp.sum(jnp.maximum(group_load - capacity, 0.0)) / (1 if group is None else group.size)
    return RouterStats(*map(total, (jax.lax.stop_gradient(load), jnp.sum(routing.probabilities, axis=0),
                                    jnp.sum(jax.nn.logsumexp(logits_TxE, axis=-1) ** 2),
                                    jax.lax.stop_gradient(dropped), jnp.asarray(logits_TxE.shape[0], jnp.float32))))


ROUTER_SUMS = ("router_load", "router_dropped", "router_tokens")
"""The per-layer sums a step's metrics carry for the router metrics (`RouterBalance.metrics`)."""


@dataclass(frozen=True)
class RouterBalance:
    """The load-balancing losses over the global batch and the balancing bias's update, from the MoE layers'
    RouterStats (stacked [layers, ...])."""

    aux_loss_weight: float
    z_loss_weight: float
    bias_rate: float | None
    layers: tuple[int, ...]
    """The MoE layers' numbers among all the model's layers, in the order of their statistics."""

    def objective(self, stats: RouterStats, total) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(this replica's share of the weighted losses, its metric sums). `total` sums a value over every replica
        of the microbatch (and the devices that hold parts of its sequence). The auxiliary loss is transformers'
        load_balancing_loss_func over every layer's tokens of the global microbatch: experts x sum_e load_e x
        probability_e / (layers x tokens)^2, the loads summed over the replicas first (they carry no gradient), so
        that the replicas' shares add up to it and to its gradient."""
        count = stats.load.shape[-1]
        rows = total(jnp.sum(stats.tokens))
        load_E = total(jnp.sum(stats.load, axis=0))
        balance = count * jnp.sum(load_E * jnp.sum(stats.probability, axis=0)) / rows ** 2
        z = jnp.sum(stats.z) / rows
        sums = {"router_aux_loss": balance, "router_z_loss": z, "router_load": stats.load,
                "router_dropped": stats.dropped, "router_tokens": stats.tokens}
        return self.aux_loss_weight * balance + self.z_loss_weight * z, sums

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Per MoE layer (named by its number among all the layers): the busiest expert's share of the choices over
        the mean share (max / mean), their coefficient of variation, and the fraction dropped by the capacity; and
        the worst layer's of each."""
        load_LxE, dropped_L = sums["router_load"], sums["router_dropped"]
        mean_L = jnp.mean(load_LxE, axis=-1)
        per_layer = {"router_max_over_mean": jnp.max(load_LxE, axis=-1) / mean_L,
                     "router_cv": jnp.std(load_LxE, axis=-1) / mean_L,
                     "router_dropped": dropped_L / jnp.sum(load_LxE, axis=-1)}
        found = {}
        for name, values in per_layer.items():
            found[name] = jnp.max(values)
            found.update({f"{name}_layer{layer}": values[index] for index, layer in enumerate(self.layers)})
        return found

    def rebalance(self, model_state: dict, load_LxE: jax.Array) -> dict:
        """DeepSeek-V3's update, once a step from the step's whole load (every microbatch, every replica): each
        expert's bias up by bias_rate where it got fewer choices than the mean, down where more."""
        if self.bias_rate is None:
            return model_state
        blocks = model_state[BLOCKS]
        bias = blocks["moe"]["bias"]
        step = self.bias_rate * jnp.sign(jnp.mean(load_LxE, axis=-1, keepdims=True) - load_LxE)
        return {**model_state, BLOCKS: {**blocks, "moe": {**blocks["moe"], "bias": bias + step.astype(bias.dtype)}}}
