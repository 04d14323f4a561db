"""Mixture-of-Experts routing and the routed experts' SwiGLU MLPs, as pure functions over a layer's tokens.

A router scores every token against every expert (float32 whatever the compute dtype), each token goes to its
`top_k` experts, and its output is their outputs weighted by the router: Mixtral's, Qwen2/3-MoE's and OLMoE's
softmax over the experts (the chosen weights renormalised to sum to one or not), or DeepSeek-V3's sigmoid
scores, whose choice (not weights) a per-expert bias shifts (aux-loss-free balancing). Dropless: every token
reaches every expert it chose. Three formulations of the experts' matmuls give the same result:

- `sorted`: the (token, expert) assignments sorted by expert and run as one grouped matmul (`jax.lax.ragged_dot`)
  per weight, the FLOPs of the chosen experts only;
- `dense`: every expert on every token, combined by a [tokens, experts] weight matrix that is zero off the
  chosen experts (one einsum per weight: experts / top_k times the FLOPs, no gather or scatter);
- `padded`: each expert's tokens gathered into a [experts, capacity, width] batch whose capacity is the most any
  expert can get (every token: dropless), then batched matmuls.

Which runs where is chosen by measurement (bench/moe_routing.py).

Expert parallelism (`expert_parallel_experts`): the experts split over the devices of an expert group, each device
routes its own tokens, sends every (token, expert) assignment to the device holding the expert by an all-to-all
of fixed-size buffers, runs its experts on what arrives and sends the results back by a second all-to-all. The
buffers are padded to a bound known when the program is compiled (jax.lax.ragged_all_to_all, which sends only
what each device has, is not implemented on XLA:CPU): dropless, a device may send all its assignments to one
device, so each destination's buffer holds `tokens x top_k` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp

Score = Literal["softmax", "sigmoid"]
Formulation = Literal["sorted", "dense", "padded"]


class Routing(NamedTuple):
    """Each token's chosen experts [T, k] (int32) and their weights [T, k] (float32), and the router's
    probabilities [T, E] (float32: what the load-balancing loss reads)."""

    experts: jax.Array
    weights: jax.Array
    probabilities: jax.Array


def route(logits_TxE: jax.Array, top_k: int, score: Score = "softmax", normalise: bool = True,
          bias_E: jax.Array | None = None) -> Routing:
    """The router's choice from its logits. softmax: probabilities over the experts, the top_k largest chosen
    (normalised to sum to one where `normalise`). sigmoid: each expert's score on its own, chosen by score +
    `bias_E` (DeepSeek-V3's balancing bias, which moves the choice, not the weights), the chosen scores
    normalised where `normalise`."""
    logits = logits_TxE.astype(jnp.float32)
    probabilities = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    choosing = probabilities if bias_E is None else probabilities + bias_E.astype(jnp.float32)[None]
    experts = jax.lax.top_k(choosing, top_k)[1]
    weights = jnp.take_along_axis(probabilities, experts, axis=-1)
    if normalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights, probabilities)


def routed_experts(x_TxD: jax.Array, routing: Routing, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
                   down_ExFxD: jax.Array, formulation: Formulation = "sorted", capacity: int | None = None
                   ) -> jax.Array:
    """sum over each token's chosen experts e of weight x down_e(silu(x gate_e) * (x up_e)): [T, D], in x's
    dtype (the router's weights cast to it, as transformers does). `capacity`: each expert takes at most this many
    choices, every token's first choice before any second (`kept_choices`), the rest dropped (None: dropless)."""
    run = {"sorted": _sorted, "dense": _dense, "padded": _padded}.get(formulation)
    if run is None:
        raise ValueError(f"unknown formulation {formulation!r}: sorted, dense or padded")
    weights = routing.weights.astype(x_TxD.dtype)
    if capacity is not None:
        weights = jnp.where(kept_choices(routing.experts, gate_ExDxF.shape[0], capacity), weights, 0)
        if formulation == "padded":
            return _padded(x_TxD, routing.experts, weights, gate_ExDxF, up_ExDxF, down_ExFxD, capacity)
    return run(x_TxD, routing.experts, weights, gate_ExDxF, up_ExDxF, down_ExFxD)


def kept_choices(experts_TxK: jax.Array, count: int, capacity: int, group: ExpertGroup | None = None) -> jax.Array:
    """[T, k] bool: the choices an expert of `capacity` takes, in priority order (`choice_order`). `group`: the
    capacity counts over the tokens of an expert group's devices, in their order (device 0's first), as one
    device holding all of them would: every device's first choices before any second."""
    one_hot_KxTxE = jax.nn.one_hot(experts_TxK.T, count, dtype=jnp.int32)
    counts_KxE = jnp.sum(one_hot_KxTxE, axis=1)
    totals_KxE, before_KxE = counts_KxE, jnp.zeros_like(counts_KxE)
    if group is not None:
        every_SxKxE = group.all_gather(counts_KxE)
        totals_KxE = jnp.sum(every_SxKxE, axis=0)
        earlier = (jnp.arange(group.size) < group.index()).astype(jnp.int32)
        before_KxE = jnp.einsum("s,ske->ke", earlier, every_SxKxE)
    earlier_slots_KxE = jnp.cumsum(totals_KxE, axis=0) - totals_KxE
    within_KxTxE = jnp.cumsum(one_hot_KxTxE, axis=1) - one_hot_KxTxE
    place_KxT = jnp.sum((within_KxTxE + (earlier_slots_KxE + before_KxE)[:, None]) * one_hot_KxTxE, axis=-1)
    return (place_KxT < capacity).T


def choice_order(experts_TxK: jax.Array) -> jax.Array:
    """The choices as one sequence, every token's first choice before any second (GShard's priority)."""
    return experts_TxK.T.reshape(-1)


def _sorted(x, experts_TxK, weights_TxK, gate, up, down):
    top_k = experts_TxK.shape[1]
    flat = experts_TxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the assignments grouped by expert, tokens in order within each
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    token = order // top_k
    rows = x[token]
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jax.lax.ragged_dot(hidden, down, sizes) * weights_TxK.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(out)


def _dense(x, experts_TxK, weights_TxK, gate, up, down):
    combine_TxE = jnp.zeros((x.shape[0], gate.shape[0]), x.dtype).at[
        jnp.arange(x.shape[0])[:, None], experts_TxK].add(weights_TxK)
    hidden = jax.nn.silu(jnp.einsum("td,edf->etf", x, gate)) * jnp.einsum("td,edf->etf", x, up)
    return jnp.einsum("etf,efd,te->td", hidden, down, combine_TxE)


def _padded(x, experts_TxK, weights_TxK, gate, up, down, capacity=None):
    """Each expert's batch holds `capacity` rows (None: the tokens, dropless); a choice past it is not placed."""
    tokens, top_k = experts_TxK.shape
    count = gate.shape[0]
    flat = choice_order(experts_TxK)
    slot = _place_in_group(flat, count)
    token = jnp.tile(jnp.arange(tokens), top_k)
    rows = tokens if capacity is None else capacity
    batch_ExCxD = jnp.zeros((count, rows, x.shape[1]), x.dtype).at[flat, slot].set(x[token], mode="drop")
    hidden = jax.nn.silu(jnp.einsum("ecd,edf->ecf", batch_ExCxD, gate)) * jnp.einsum("ecd,edf->ecf", batch_ExCxD, up)
    out_ExCxD = jnp.einsum("ecf,efd->ecd", hidden, down)
    out = out_ExCxD.at[flat, slot].get(mode="fill", fill_value=0)
    return jnp.zeros_like(x).at[token].add(out * choice_order(weights_TxK)[:, None])


def _place_in_group(groups_A: jax.Array, count: int) -> jax.Array:
    """Each assignment's place among the earlier assignments to its group (of `count`), in assignment order."""
    one_hot = jax.nn.one_hot(groups_A, count, dtype=jnp.int32)
    return jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)


@dataclass(frozen=True, eq=False)
class ExpertGroup:
    """The devices of one expert group, seen from one of them: each holds experts / size consecutive experts."""

    size: int
    all_to_all: Callable[[jax.Array], jax.Array]
    """[size, ...] -> [size, ...]: block j goes to device j, block i of the result came from device i."""
    all_gather: Callable[[jax.Array], jax.Array] | None = None
    """[...] -> [size, ...]: every device's value, in device order (for a capacity over the group)."""
    index: Callable[[], jax.Array] | None = None
    """This device's place in the group."""


def expert_parallel_experts(x_TxD: jax.Array, routing: Routing, gate_LxDxF: jax.Array, up_LxDxF: jax.Array,
                            down_LxFxD: jax.Array, group: ExpertGroup, formulation: Formulation = "sorted",
                            ) -> jax.Array:
    """routed_experts of this device's tokens when its group's devices hold the experts in turn (this one its
    local experts' weights, L = experts / group.size): the assignments travel to their experts' devices and back."""
    tokens, top_k = routing.experts.shape
    local = gate_LxDxF.shape[0]
    rows = tokens * top_k
    flat = routing.experts.reshape(-1)
    destination = flat // local
    place = (destination, _place_in_group(destination, group.size))  # its row in its destination's block
    token = jnp.arange(rows) // top_k
    sent_SxRxD = jnp.zeros((group.size, rows, x_TxD.shape[1]), x_TxD.dtype).at[place].set(x_TxD[token])
    # which local expert each row is for, and whether it holds one (the blocks are padded)
    wanted_SxR = jnp.full((group.size, rows), -1, jnp.int32).at[place].set(flat % local)
    arrived, wanted = group.all_to_all(sent_SxRxD), group.all_to_all(wanted_SxR)
    held = (wanted >= 0).reshape(-1, 1)
    own = Routing(jnp.maximum(wanted, 0).reshape(-1, 1), held.astype(jnp.float32), jnp.zeros((held.shape[0], local)))
    done = routed_experts(arrived.reshape(-1, x_TxD.shape[1]), own, gate_LxDxF, up_LxDxF, down_LxFxD, formulation)
    back_SxRxD = group.all_to_all(done.reshape(arrived.shape))
    weights = routing.weights.reshape(-1).astype(x_TxD.dtype)
    return jnp.zeros_like(x_TxD).at[token].add(back_SxRxD[place] * weights[:, None])


def load_balancing_loss(probabilities_NxE: jax.Array, experts_NxK: jax.Array, weights_N: jax.Array | None = None,
                        ) -> jax.Array:
    """Switch Transformer's auxiliary loss as transformers' `load_balancing_loss_func` computes it over every layer's
    tokens at once (rows N = layers x tokens): E x sum over the k choices and experts of (the fraction of tokens
    whose k-th choice is e) x (e's mean router probability), the means over the rows that `weights_N` counts
    (all where None; transformers' attention mask)."""
    count = probabilities_NxE.shape[-1]
    chosen_NxKxE = jax.nn.one_hot(experts_NxK, count, dtype=jnp.float32)
    weights = jnp.ones(probabilities_NxE.shape[0], jnp.float32) if weights_N is None else weights_N.astype(jnp.float32)
    total = jnp.sum(weights)
    tokens_per_expert_KxE = jnp.einsum("nke,n->ke", chosen_NxKxE, weights) / total
    probability_per_expert_E = jnp.einsum("ne,n->e", probabilities_NxE, weights) / total
    return count * jnp.sum(tokens_per_expert_KxE * probability_per_expert_E[None])


def router_z_loss(logits_NxE: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss: the mean over rows of logsumexp(logits) squared."""
    return jnp.mean(jax.nn.logsumexp(logits_NxE.astype(jnp.float32), axis=-1) ** 2)
