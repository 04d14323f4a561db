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
  expert can get (every token: dropless), then batched matmuls;
- `blocked`: the choices sorted by expert into blocks of rows, each expert's padded to whole blocks, a loop over
  the blocks multiplying each by its expert's weights: about the chosen experts' FLOPs in small dense matmuls.

Which runs where is chosen by measurement (bench/moe_routing.py).

Expert parallelism (`expert_parallel_experts`): the experts split over the devices of an expert group, each device
routes its own tokens, sends every (token, expert) assignment to the device holding the expert by an all-to-all
of fixed-size buffers, runs its experts on what arrives and sends the results back by a second all-to-all. The
buffers are padded to a bound known when the program is compiled (jax.lax.ragged_all_to_all, which sends only
what each device has, is not implemented on XLA:CPU): dropless, a device may send all its assignments to one
device, so each destination's buffer holds `tokens x top_k` rows.
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, NamedTuple

import jax
import jax.numpy as jnp

Score = Literal["softmax", "sigmoid"]
Formulation = Literal["sorted", "dense", "padded", "blocked"]


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
    run = {"sorted": _sorted, "dense": _dense, "padded": _padded, "blocked": _blocked}.get(formulation)
    if run is None:
        raise ValueError(f"unknown formulation {formulation!r}: sorted, dense, padded or blocked")
    weights = routing.weights.astype(x_TxD.dtype)
    if capacity is not None and formulation == "padded":  # its batches hold `capacity` rows: no place for the rest
        return _padded(x_TxD, routing.experts, weights, gate_ExDxF, up_ExDxF, down_ExFxD, capacity)
    if capacity is not None:
        weights = jnp.where(kept_choices(routing.experts, gate_ExDxF.shape[0], capacity), weights, 0)
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
    hidden = jax.nn.silu(grouped_matmul(rows, gate, sizes)) * grouped_matmul(rows, up, sizes)
    out = grouped_matmul(hidden, down, sizes) * weights_TxK.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(out)


@jax.custom_vjp
def grouped_matmul(rows_MxK: jax.Array, weights_GxKxN: jax.Array, sizes_G: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot (rows grouped in order, group g's sizes_G[g] rows times weights_GxKxN[g]) that also runs
    under vmap, as the train step's replicas do: jax 0.10 batches no ragged_dot (NotImplementedError), so each of
    its products here, forward and both gradients, is batched by folding the batch into the groups."""
    return _ragged(rows_MxK, weights_GxKxN, sizes_G)


def _grouped_forward(rows, weights, sizes):
    return _ragged(rows, weights, sizes), (rows, weights, sizes)


def _grouped_backward(saved, d_MxN):
    rows, weights, sizes = saved
    d_rows = _ragged(d_MxN, jnp.swapaxes(weights, 1, 2), sizes)
    return d_rows, _ragged_weight_gradient(rows, d_MxN, sizes).astype(weights.dtype), None


grouped_matmul.defvjp(_grouped_forward, _grouped_backward)


@jax.custom_batching.custom_vmap
def _ragged(rows_MxK, weights_GxKxN, sizes_G):
    return jax.lax.ragged_dot(rows_MxK, weights_GxKxN, sizes_G)


@_ragged.def_vmap
def _ragged_batched(size, batched, rows, weights, sizes):
    """A batch of grouped matmuls as one whose groups are the batch's, each element's in turn."""
    rows, weights, sizes = _with_batch(size, batched, rows, weights, sizes)
    out = jax.lax.ragged_dot(rows.reshape(-1, rows.shape[-1]), weights.reshape(-1, *weights.shape[2:]),
                             sizes.reshape(-1))
    return out.reshape(size, rows.shape[1], -1), True


@jax.custom_batching.custom_vmap
def _ragged_weight_gradient(rows_MxK, d_MxN, sizes_G):
    """[G, K, N]: each group's rows^T d over its own rows."""
    return _weight_gradient(rows_MxK, d_MxN, sizes_G)


@_ragged_weight_gradient.def_vmap
def _ragged_weight_gradient_batched(size, batched, rows, d, sizes):
    rows, d, sizes = _with_batch(size, batched, rows, d, sizes)
    out = _weight_gradient(rows.reshape(-1, rows.shape[-1]), d.reshape(-1, d.shape[-1]), sizes.reshape(-1))
    return out.reshape(size, sizes.shape[1], *out.shape[1:]), True


def _weight_gradient(rows_MxK, d_MxN, sizes_G):
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                lhs_ragged_dimensions=(0,), rhs_group_dimensions=())
    return jax.lax.ragged_dot_general(rows_MxK, d_MxN, sizes_G, numbers)


def _with_batch(size, batched, *values):
    return tuple(v if b else jnp.broadcast_to(v, (size, *v.shape)) for v, b in zip(values, batched, strict=True))


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


BLOCK_ROWS = 64
"""Rows of a block of the blocked formulation (fewer where the choices are few)."""
LOOPED_BLOCK_PRODUCTS = 2**23
"""The blocked formulation loops over its blocks where a block's matmul has this many products (rows x width x
hidden) or more, and otherwise runs them at once with each block's weights copied: on two CPU cores, at 64 x 512 x
1024 the loop took 0.81x the time of the copies, at 64 x 256 x 512 1.0x, at 64 x 128 x 192 (the whole MoE step)
1.18x (bench/HISTORY.md)."""


def _blocked(x, experts_TxK, weights_TxK, gate, up, down):
    """The choices sorted by expert into blocks of BLOCK_ROWS rows, each expert's rows padded to whole blocks (at
    most experts x (block - 1) padding rows in all), and each block multiplied by its expert's weights
    (MegaBlocks' block-sparse layout as dense blocks): about the chosen experts' FLOPs. Large blocks run in a loop
    over the blocks, each reading its expert's weights in place; small ones at once, the weights copied per block
    (LOOPED_BLOCK_PRODUCTS). The rows move by gathers alone, forward and backward (`_rows_of_choices`,
    `_choices_of_rows`)."""
    tokens, top_k = experts_TxK.shape
    count, choices = gate.shape[0], tokens * top_k
    block = max(8, min(BLOCK_ROWS, choices // count))
    blocks = -(-(choices + count * (block - 1)) // block)
    flat = experts_TxK.reshape(-1)
    sizes = jnp.bincount(flat, length=count)
    ends = jnp.cumsum(-(-sizes // block) * block)  # each expert's region of whole blocks ends here
    row_A = ends[flat] - -(-sizes // block)[flat] * block + _place_in_group(flat, count)
    choice_R = jnp.full((blocks * block,), -1, jnp.int32).at[row_A].set(jnp.arange(choices, dtype=jnp.int32))
    rows_NxBxD = _rows_of_choices(x, row_A.reshape(tokens, top_k), choice_R).reshape(blocks, block, -1)
    expert_N = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right"), count - 1)
    if block * math.prod(gate.shape[1:]) < LOOPED_BLOCK_PRODUCTS:  # every block at once, its expert's weights copied
        hidden = (jax.nn.silu(jnp.einsum("nbd,ndf->nbf", rows_NxBxD, gate[expert_N]))
                  * jnp.einsum("nbd,ndf->nbf", rows_NxBxD, up[expert_N]))
        out_NxBxD = jnp.einsum("nbf,nfd->nbd", hidden, down[expert_N])
    else:
        def one_block(_, block_and_expert):
            rows_BxD, e = block_and_expert
            pick = lambda w: jax.lax.dynamic_index_in_dim(w, e, keepdims=False)  # noqa: E731
            return None, (jax.nn.silu(rows_BxD @ pick(gate)) * (rows_BxD @ pick(up))) @ pick(down)

        out_NxBxD = jax.lax.scan(one_block, None, (rows_NxBxD, expert_N))[1]
    out_RxD = out_NxBxD.reshape(blocks * block, -1)
    return _choices_of_rows(out_RxD, row_A.reshape(tokens, top_k), choice_R, weights_TxK)


@jax.custom_vjp
def _rows_of_choices(x_TxD, row_TxK, choice_R):
    """[R, D]: row r the token of the choice choice_R[r] (t x top_k + k; -1: a padding row, zeros)."""
    return _token_rows(x_TxD, choice_R, row_TxK.shape[1])


def _rows_of_choices_forward(x_TxD, row_TxK, choice_R):
    return _token_rows(x_TxD, choice_R, row_TxK.shape[1]), (row_TxK, choice_R)


def _rows_of_choices_backward(saved, d_RxD):
    row_TxK, choice_R = saved
    return jnp.sum(d_RxD[row_TxK], axis=1), None, None  # each token's rows, one per choice


_rows_of_choices.defvjp(_rows_of_choices_forward, _rows_of_choices_backward)


@jax.custom_vjp
def _choices_of_rows(out_RxD, row_TxK, choice_R, weights_TxK):
    """[T, D]: each token's rows weighted by its choices' weights and summed."""
    return jnp.einsum("tkd,tk->td", out_RxD[row_TxK], weights_TxK)


def _choices_of_rows_forward(out_RxD, row_TxK, choice_R, weights_TxK):
    picked_TxKxD = out_RxD[row_TxK]
    return jnp.einsum("tkd,tk->td", picked_TxKxD, weights_TxK), (picked_TxKxD, row_TxK, choice_R, weights_TxK)


def _choices_of_rows_backward(saved, d_TxD):
    picked_TxKxD, row_TxK, choice_R, weights_TxK = saved
    top_k = row_TxK.shape[1]
    valid = choice_R >= 0
    weight_R = jnp.where(valid, weights_TxK.reshape(-1)[jnp.maximum(choice_R, 0)], 0)
    d_out = _token_rows(d_TxD, choice_R, top_k) * weight_R[:, None].astype(d_TxD.dtype)
    return d_out, None, None, jnp.einsum("tkd,td->tk", picked_TxKxD, d_TxD).astype(weights_TxK.dtype)


_choices_of_rows.defvjp(_choices_of_rows_forward, _choices_of_rows_backward)


def _token_rows(x_TxD, choice_R, top_k):
    """Row r: the token of choice choice_R[r], or zeros where it is -1 (padding)."""
    valid = choice_R >= 0
    return jnp.where(valid[:, None], x_TxD[jnp.maximum(choice_R, 0) // top_k], 0).astype(x_TxD.dtype)


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


_GROUP: ContextVar[ExpertGroup | None] = ContextVar("expert_group", default=None)


@contextlib.contextmanager
def inside_expert_group(group: ExpertGroup | None) -> Iterator[None]:
    """While a per-device step is traced: its MoE layers' experts are split over `group`, each device holding its
    own and routing its own rows (lowering/expert_link.py makes the group)."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def current_expert_group() -> ExpertGroup | None:
    return _GROUP.get()


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
