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

from xlatrain.models.axes import axes
from xlatrain.models.blocks import BLOCKS
from xlatrain.models.flax_module import ModelState
from xlatrain.models.linear import linear
from xlatrain.models.moe import Formulation, Score, route, routed_experts

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
        x_TxD = x_BxLxD.reshape(-1, width)
        logits_TxE = x_TxD.astype(jnp.float32) @ self.router.kernel[...].astype(jnp.float32)
        shape = self.shape
        routing = route(logits_TxE, shape.top_k, shape.score, shape.normalise,
                        None if self.bias is None else jax.lax.stop_gradient(self.bias[...]))
        capacity = capacity_of(shape, x_TxD.shape[0])
        out_TxD = routed_experts(x_TxD, routing, self.gate[...], self.up[...], self.down[...], shape.formulation,
                                 capacity)
        if self.shared is not None:
            shared = self.shared(x_TxD)
            if self.shared_gate is not None:
                shared = jax.nn.sigmoid(self.shared_gate(x_TxD)) * shared
            out_TxD = out_TxD + shared
        return out_TxD.reshape(batch, length, width), router_stats(logits_TxE, routing, shape.experts, capacity)


def router_stats(logits_TxE: jax.Array, routing, count: int, capacity: int | None) -> RouterStats:
    load = jnp.sum(jax.nn.one_hot(routing.experts, count, dtype=jnp.float32), axis=(0, 1))
    dropped = jnp.zeros((), jnp.float32) if capacity is None else jnp.sum(jnp.maximum(load - capacity, 0.0))
    return RouterStats(jax.lax.stop_gradient(load), jnp.sum(routing.probabilities, axis=0),
                       jnp.sum(jax.nn.logsumexp(logits_TxE, axis=-1) ** 2), jax.lax.stop_gradient(dropped),
                       jnp.asarray(logits_TxE.shape[0], jnp.float32))


ROUTER_SUMS = ("router_load", "router_dropped", "router_tokens")
"""The per-layer sums a step's metrics carry for the router metrics (`RouterBalance.metrics`)."""


@dataclass(frozen=True)
class RouterBalance:
    """The load-balancing losses over the global batch and the balancing bias's update, from the MoE layers'
    RouterStats (stacked [layers, ...])."""

    aux_loss_weight: float
    z_loss_weight: float
    bias_rate: float | None

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

    @staticmethod
    def metrics(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Per MoE layer: the busiest expert's share of the choices over the mean share (max / mean), their
        coefficient of variation, and the fraction dropped by the capacity; and the worst layer's of each."""
        load_LxE, dropped_L = sums["router_load"], sums["router_dropped"]
        mean_L = jnp.mean(load_LxE, axis=-1)
        per_layer = {"router_max_over_mean": jnp.max(load_LxE, axis=-1) / mean_L,
                     "router_cv": jnp.std(load_LxE, axis=-1) / mean_L,
                     "router_dropped": dropped_L / jnp.sum(load_LxE, axis=-1)}
        found = {}
        for name, values in per_layer.items():
            found[name] = jnp.max(values)
            found.update({f"{name}_layer{layer}": values[layer] for layer in range(values.shape[0])})
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
