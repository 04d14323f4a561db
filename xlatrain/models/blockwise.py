"""Attention over blocks of queries and keys with an online softmax, for sequences too long for one [L, L] array.

The pairs of (query block, key block) that hold a visible key are listed once, in order; one loop runs over them,
keeping each query block's running maximum, sum and weighted values (FlashAttention's forward), and the backward
walks the same pairs again from the saved output and log-sum-exp (its backward), so that neither the scores nor
their mask ever exist for more than one pair of blocks: memory is the inputs' and outputs' size plus one block of
scores. A pair's mask is computed inside the loop from the tokens' indices (causal order, sliding windows) and
their segment ids (packed documents). Grouped-query heads: each key/value head serves its group of query heads
without being repeated.
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
    """A query at i sees the keys j with i - window < j <= i (None: every earlier key, or every key)."""
    scale: float
    softcap: float | None


def visible_pairs(query_blocks: int, key_blocks: int, block: int, offset: int, visibility: Visibility,
                  ) -> np.ndarray:
    """[pairs, 2] (query block, key block) holding at least one visible key, by query block then key block: with
    causal order those at or below the diagonal, with a window those it reaches. `offset`: the first query's
    index less the first key's (the keys before the queries, as in a cache)."""
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


def blockwise_attention(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, block: int,
                        visibility: Visibility, segments_BxL: jax.Array | None = None,
                        key_segments_BxS: jax.Array | None = None) -> jax.Array:
    """Attention of every query over the keys it sees, in blocks of `block` queries and keys (both lengths a
    multiple of it). `segments_BxL`/`key_segments_BxS`: packed documents (a query sees its own document's keys)."""
    queries, keys = q_BxLxHxK.shape[1], k_BxSxGxK.shape[1]
    if queries % block or keys % block:
        raise ValueError(f"blockwise attention: lengths {queries} and {keys} are not multiples of the block {block}")
    pairs = visible_pairs(queries // block, keys // block, block, keys - queries, visibility)
    if segments_BxL is None:
        segments_BxL = jnp.zeros(q_BxLxHxK.shape[:2], jnp.int32)
        key_segments_BxS = jnp.zeros(k_BxSxGxK.shape[:2], jnp.int32)
    elif key_segments_BxS is None:
        key_segments_BxS = segments_BxL
    return _attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, segments_BxL, key_segments_BxS, jnp.asarray(pairs),
                      block, visibility)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, segments, key_segments, pairs, block, visibility):
    return _forward(q, k, v, segments, key_segments, pairs, block, visibility)[0]


def _grouped(q_BxLxHxK: jax.Array, groups: int) -> jax.Array:
    """[B, L, H, K] -> [B, L, G, H / G, K]: query head h reads key/value head h // (H / G), as jax's attention."""
    batch, length, heads, width = q_BxLxHxK.shape
    return q_BxLxHxK.reshape(batch, length, groups, heads // groups, width)


def _pair_scores(q_blk, k_blk, q_seg, k_seg, i, j, block, offset, visibility):
    """One pair's capped scores [B, G, R, Qb, Kb] in float32 (masked keys at NEGATIVE), its mask, and the tanh of
    the soft cap (for its derivative; None without one)."""
    scores = jnp.einsum("bqgrk,bsgk->bgrqs", q_blk, k_blk, preferred_element_type=jnp.float32) * visibility.scale
    capped = None
    if visibility.softcap is not None:
        capped = jnp.tanh(scores / visibility.softcap)
        scores = capped * visibility.softcap
    query_index = offset + i * block + jnp.arange(block)[:, None]
    key_index = j * block + jnp.arange(block)[None, :]
    visible = jnp.ones((block, block), bool)
    if visibility.causal:
        visible &= key_index <= query_index
    if visibility.window is not None:
        visible &= key_index > query_index - visibility.window
    visible = visible[None] & (q_seg[:, :, None] == k_seg[:, None, :])
    visible = visible[:, None, None]
    return jnp.where(visible, scores, NEGATIVE), visible, capped


def _blocks(x, index, block):
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=1)


def _forward(q, k, v, segments, key_segments, pairs, block, visibility):
    groups = k.shape[2]
    q_g = _grouped(q, groups)
    batch, length, _, per_group, width = q_g.shape
    offset = k.shape[1] - length
    shape = (batch, groups, per_group, length)
    init = (jnp.zeros((batch, length, groups, per_group, width), jnp.float32), jnp.full(shape, NEGATIVE, jnp.float32),
            jnp.zeros(shape, jnp.float32))

    def step(carry, pair):
        out, running_max, total = carry
        i, j = pair[0], pair[1]
        scores, visible, _ = _pair_scores(_blocks(q_g, i, block), _blocks(k, j, block), _blocks(segments, i, block),
                                          _blocks(key_segments, j, block), i, j, block, offset, visibility)
        before = jax.lax.dynamic_slice_in_dim(running_max, i * block, block, axis=3)
        now = jnp.maximum(before, scores.max(axis=-1))
        weights = jnp.where(visible, jnp.exp(scores - now[..., None]), 0.0)
        kept = jnp.exp(before - now)
        summed = jax.lax.dynamic_slice_in_dim(total, i * block, block, axis=3) * kept + weights.sum(axis=-1)
        values = jnp.einsum("bgrqs,bsgk->bqgrk", weights.astype(v.dtype), _blocks(v, j, block),
                            preferred_element_type=jnp.float32)
        rescaled = _blocks(out, i, block) * jnp.moveaxis(kept, 3, 1)[..., None] + values
        return (jax.lax.dynamic_update_slice_in_dim(out, rescaled, i * block, axis=1),
                jax.lax.dynamic_update_slice_in_dim(running_max, now, i * block, axis=3),
                jax.lax.dynamic_update_slice_in_dim(total, summed, i * block, axis=3)), None

    (out, running_max, total), _ = jax.lax.scan(step, init, pairs)
    total = jnp.where(total > 0, total, 1.0)  # a query that sees no key (none here: each sees itself) gives 0
    attended = (out / jnp.moveaxis(total, 3, 1)[..., None]).astype(q.dtype).reshape(q.shape)
    log_sum_exp = running_max + jnp.log(total)
    return attended, (q, k, v, segments, key_segments, pairs, attended, log_sum_exp)


def _attention_forward(q, k, v, segments, key_segments, pairs, block, visibility):
    return _forward(q, k, v, segments, key_segments, pairs, block, visibility)


def _attention_backward(block, visibility, saved, d_attended):
    q, k, v, segments, key_segments, pairs, attended, log_sum_exp = saved
    groups = k.shape[2]
    q_g, d_out = _grouped(q, groups), _grouped(d_attended, groups).astype(jnp.float32)
    offset = k.shape[1] - q.shape[1]
    delta = jnp.moveaxis(jnp.sum(d_out * _grouped(attended, groups).astype(jnp.float32), axis=-1), 1, 3)

    def step(carry, pair):
        dq, dk, dv = carry
        i, j = pair[0], pair[1]
        q_blk, k_blk, v_blk = _blocks(q_g, i, block), _blocks(k, j, block), _blocks(v, j, block)
        scores, visible, capped = _pair_scores(q_blk, k_blk, _blocks(segments, i, block),
                                               _blocks(key_segments, j, block), i, j, block, offset, visibility)
        lse = jax.lax.dynamic_slice_in_dim(log_sum_exp, i * block, block, axis=3)
        weights = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
        d_out_blk = _blocks(d_out, i, block)
        dv_blk = jnp.einsum("bgrqs,bqgrk->bsgk", weights, d_out_blk)
        d_weights = jnp.einsum("bqgrk,bsgk->bgrqs", d_out_blk, v_blk.astype(jnp.float32))
        d_scores = weights * (d_weights - jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)[..., None])
        if capped is not None:
            d_scores = d_scores * (1.0 - capped**2)
        d_scores = d_scores * visibility.scale
        dq_blk = jnp.einsum("bgrqs,bsgk->bqgrk", d_scores, k_blk.astype(jnp.float32))
        dk_blk = jnp.einsum("bgrqs,bqgrk->bsgk", d_scores, q_blk.astype(jnp.float32))
        return (jax.lax.dynamic_update_slice_in_dim(dq, _blocks(dq, i, block) + dq_blk, i * block, axis=1),
                jax.lax.dynamic_update_slice_in_dim(dk, _blocks(dk, j, block) + dk_blk, j * block, axis=1),
                jax.lax.dynamic_update_slice_in_dim(dv, _blocks(dv, j, block) + dv_blk, j * block, axis=1)), None

    init = (jnp.zeros(q_g.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dq, dk, dv), _ = jax.lax.scan(step, init, pairs)
    no_gradient = [np.zeros(x.shape, jax.dtypes.float0) for x in (segments, key_segments, pairs)]
    return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_gradient)


_attention.defvjp(_attention_forward, _attention_backward)
