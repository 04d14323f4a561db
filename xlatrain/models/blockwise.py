"""Attention over blocks of queries and keys with an online softmax, for sequences too long for one [L, L] array.

The pairs of (query block, key block) that hold a visible key are listed once; one loop runs over them, keeping
each query block's running maximum, sum and weighted values (FlashAttention's forward), and the backward walks the
same pairs again from the saved output and log-sum-exp (its backward), so that neither the scores nor their mask
ever exist for more than one pair of blocks: memory is the inputs' and outputs' size plus one block of scores. A
pair's mask is computed inside the loop from the tokens' positions (causal order, sliding windows) and segment ids
(packed documents): positions are the tokens' indices in the row, or, where the row's order is not the tokens'
(context parallelism's balanced chunks), given with them. Grouped-query heads: each key/value head serves its
group of query heads without being repeated.

The loops are pieces that context parallelism (xlatrain/models/context.py) runs again for each block of keys
that reaches a device: `forward_pairs` from a carried state, `finished`, and `backward_pairs`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NEGATIVE = -1e30
"""The score of a masked key: exp() of it less any real score is 0, and unlike -inf it never makes a NaN."""


class Visibility(NamedTuple):
    """What a query sees, as static facts (the mask of each block pair is built from them inside the loop)."""

    causal: bool
    window: int | None
    """A query at i sees the keys j with i - window < j <= i, in causal order as jax's local_window_size (window -
    1, 0) has it (None: every earlier key, or every key)."""
    scale: float
    softcap: float | None


class Tokens(NamedTuple):
    """Where each query or key is: [B, length] positions (causal order and windows compare them) and segment ids
    (a query sees its own document's keys); either may be [1, length], the same for every row."""

    positions: jax.Array
    segments: jax.Array

    def block(self, index: jax.Array, size: int) -> Tokens:
        return Tokens(*(jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1) for x in self))


class Running(NamedTuple):
    """The forward's state over the key blocks seen so far, per query: weighted values (not yet divided),
    maximum score and sum of exp(score - maximum); [B, L, G, R, K] and [B, G, R, L] in float32."""

    out: jax.Array
    maximum: jax.Array
    total: jax.Array


def sees(query_Qx1: jax.Array, key_1xK: jax.Array, window: int | None) -> jax.Array:
    """[Q, K]: whether a query at each position sees a key at each position: an earlier one or itself, and with a
    sliding window one of its `window` latest (i - window < j <= i)."""
    visible_QxK = key_1xK <= query_Qx1
    return visible_QxK if window is None else visible_QxK & (key_1xK > query_Qx1 - window)


def visible_pairs(query_blocks: int, key_blocks: int, block: int, offset: int, visibility: Visibility,
                  ) -> np.ndarray:
    """[pairs, 2] (query block, key block) holding at least one visible key, by query block then key block, for
    queries and keys in row order: with causal order those at or below the diagonal, with a window those it
    reaches. `offset`: the first query's index less the first key's."""
    pairs = []
    for i in range(query_blocks):
        first_query, last_query = offset + i * block, offset + (i + 1) * block - 1
        for j in range(key_blocks):
            first_key, last_key = j * block, (j + 1) * block - 1
            if visibility.causal and first_key > last_query:
                continue
            if visibility.window is not None and last_key <= first_query - visibility.window:
                continue
            pairs.append((i, j))
    return np.asarray(pairs, np.int32).reshape(-1, 2)


def in_row_order(length: int, segments_BxL: jax.Array | None) -> Tokens:
    """Tokens of a row in its own order: positions 0..length-1, one segment unless given."""
    segments = jnp.zeros((1, length), jnp.int32) if segments_BxL is None else segments_BxL
    return Tokens(jnp.arange(length, dtype=jnp.int32)[None], segments)


def blockwise_attention(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, block: int,
                        visibility: Visibility, segments_BxL: jax.Array | None = None) -> jax.Array:
    """Self-attention of every query over the keys it sees, in row order, in blocks of `block` queries and keys
    (the length a multiple of it). `segments_BxL`: packed documents."""
    length = q_BxLxHxK.shape[1]
    if length % block or k_BxSxGxK.shape[1] != length:
        raise ValueError(f"blockwise attention: length {length} is not a multiple of the block {block}")
    tokens = in_row_order(length, segments_BxL)
    pairs = jnp.asarray(visible_pairs(length // block, length // block, block, 0, visibility))
    return attention_over_pairs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, tokens, tokens, pairs, block, visibility)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def attention_over_pairs(q, k, v, queries: Tokens, keys: Tokens, pairs, block, visibility):
    """Attention of the queries over the keys of the listed [pairs, 2 or 3] (query block, key block) pairs (each query
    sees no others): one device's whole attention, or (context.py) its queries over gathered keys."""
    return _over_pairs_forward(q, k, v, queries, keys, pairs, block, visibility)[0]


def grouped(q_BxLxHxK: jax.Array, groups: int) -> jax.Array:
    """[B, L, H, K] -> [B, L, G, H / G, K]: query head h reads key/value head h // (H / G), as jax's attention."""
    batch, length, heads, width = q_BxLxHxK.shape
    return q_BxLxHxK.reshape(batch, length, groups, heads // groups, width)


def start(q_BxLxHxK: jax.Array, groups: int) -> Running:
    batch, length, heads, width = q_BxLxHxK.shape
    shape = (batch, groups, heads // groups, length)
    return Running(jnp.zeros((batch, length, groups, heads // groups, width), jnp.float32),
                   jnp.full(shape, NEGATIVE, jnp.float32), jnp.zeros(shape, jnp.float32))


def _scores(q_blk, k_blk, queries: Tokens, keys: Tokens, visibility: Visibility, pair):
    """One pair's capped scores [B, G, R, Qb, Kb] in float32 (masked keys at NEGATIVE), its mask, and the tanh of
    the soft cap (for its derivative; None without one). A pair's third entry, where given, is 0 for a pair that
    only pads a list (context.py) and sees nothing."""
    scores = jnp.einsum("bqgrk,bsgk->bgrqs", q_blk, k_blk, preferred_element_type=jnp.float32) * visibility.scale
    capped = None
    if visibility.softcap is not None:
        capped = jnp.tanh(scores / visibility.softcap)
        scores = capped * visibility.softcap
    visible = queries.segments[:, :, None] == keys.segments[:, None, :]
    if visibility.causal or visibility.window is not None:
        visible &= sees(queries.positions[:, :, None], keys.positions[:, None, :], visibility.window)
    if pair.shape[0] > 2:
        visible &= pair[2] > 0
    visible = visible[:, None, None]
    return jnp.where(visible, scores, NEGATIVE), visible, capped


def _blocks(x, index, block, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=axis)


def _placed(x, update, index, block, axis=1):
    return jax.lax.dynamic_update_slice_in_dim(x, update, index * block, axis=axis)


def forward_pairs(running: Running, q, k, v, queries: Tokens, keys: Tokens, pairs, block: int,
                  visibility: Visibility) -> Running:
    """`running` after the key blocks of `pairs` (k, v: [B, S, G, K], the keys the pairs' key blocks index)."""
    q_g = grouped(q, k.shape[2])

    def step(state: Running, pair):
        i, j = pair[0], pair[1]
        scores, visible, _ = _scores(_blocks(q_g, i, block), _blocks(k, j, block), queries.block(i, block),
                                     keys.block(j, block), visibility, pair)
        before = _blocks(state.maximum, i, block, axis=3)
        now = jnp.maximum(before, scores.max(axis=-1))
        weights = jnp.where(visible, jnp.exp(scores - now[..., None]), 0.0)
        kept = jnp.exp(before - now)
        total = _blocks(state.total, i, block, axis=3) * kept + weights.sum(axis=-1)
        values = jnp.einsum("bgrqs,bsgk->bqgrk", weights.astype(v.dtype), _blocks(v, j, block),
                            preferred_element_type=jnp.float32)
        out = _blocks(state.out, i, block) * jnp.moveaxis(kept, 3, 1)[..., None] + values
        return Running(_placed(state.out, out, i, block), _placed(state.maximum, now, i, block, axis=3),
                       _placed(state.total, total, i, block, axis=3)), None

    return jax.lax.scan(step, running, pairs)[0]


def finished(running: Running, q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the attention [B, L, H, K] in q's dtype, the log-sum-exp of each query's scores [B, G, R, L])."""
    total = jnp.where(running.total > 0, running.total, 1.0)  # a query that sees no key gets 0
    attended = (running.out / jnp.moveaxis(total, 3, 1)[..., None]).astype(q.dtype).reshape(q.shape)
    return attended, running.maximum + jnp.log(total)


def output_gradient_terms(attended: jax.Array, d_attended: jax.Array, groups: int) -> tuple[jax.Array, jax.Array]:
    """(d_attended grouped [B, L, G, R, K], and each query's sum of d_attended x attended [B, G, R, L]), in
    float32: what every pair's backward reads."""
    d_out = grouped(d_attended, groups).astype(jnp.float32)
    return d_out, jnp.moveaxis(jnp.sum(d_out * grouped(attended, groups).astype(jnp.float32), axis=-1), 1, 3)


def backward_pairs(q, k, v, queries: Tokens, keys: Tokens, pairs, block: int, visibility: Visibility,
                   log_sum_exp, d_out, delta) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq grouped [B, L, G, R, K], dk, dv [B, S, G, K]) in float32, from the key blocks of `pairs`."""
    q_g = grouped(q, k.shape[2])

    def step(carry, pair):
        dq, dk, dv = carry
        i, j = pair[0], pair[1]
        q_blk, k_blk, v_blk = _blocks(q_g, i, block), _blocks(k, j, block), _blocks(v, j, block)
        scores, visible, capped = _scores(q_blk, k_blk, queries.block(i, block), keys.block(j, block), visibility,
                                          pair)
        weights = jnp.where(visible, jnp.exp(scores - _blocks(log_sum_exp, i, block, axis=3)[..., None]), 0.0)
        d_out_blk = _blocks(d_out, i, block)
        dv_blk = jnp.einsum("bgrqs,bqgrk->bsgk", weights, d_out_blk)
        d_weights = jnp.einsum("bqgrk,bsgk->bgrqs", d_out_blk, v_blk.astype(jnp.float32))
        d_scores = weights * (d_weights - _blocks(delta, i, block, axis=3)[..., None])
        if capped is not None:
            d_scores = d_scores * (1.0 - capped**2)
        d_scores = d_scores * visibility.scale
        dq_blk = jnp.einsum("bgrqs,bsgk->bqgrk", d_scores, k_blk.astype(jnp.float32))
        dk_blk = jnp.einsum("bgrqs,bqgrk->bsgk", d_scores, q_blk.astype(jnp.float32))
        return (_placed(dq, _blocks(dq, i, block) + dq_blk, i, block),
                _placed(dk, _blocks(dk, j, block) + dk_blk, j, block),
                _placed(dv, _blocks(dv, j, block) + dv_blk, j, block)), None

    init = (jnp.zeros(q_g.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    return jax.lax.scan(step, init, pairs)[0]


def no_gradient(*trees):
    """The cotangents of integer inputs (positions, segments, pairs)."""
    return tuple(jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), tree) for tree in trees)


def _over_pairs_forward(q, k, v, queries, keys, pairs, block, visibility):
    attended, log_sum_exp = finished(forward_pairs(start(q, k.shape[2]), q, k, v, queries, keys, pairs, block,
                                                   visibility), q)
    return attended, (q, k, v, queries, keys, pairs, attended, log_sum_exp)


def _over_pairs_backward(block, visibility, saved, d_attended):
    q, k, v, queries, keys, pairs, attended, log_sum_exp = saved
    d_out, delta = output_gradient_terms(attended, d_attended, k.shape[2])
    dq, dk, dv = backward_pairs(q, k, v, queries, keys, pairs, block, visibility, log_sum_exp, d_out, delta)
    return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            *no_gradient(queries, keys, pairs))


attention_over_pairs.defvjp(_over_pairs_forward, _over_pairs_backward)
