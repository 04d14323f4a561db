"""Context parallelism's attention: a sequence split over the `context` mesh axis, each device holding the
queries, keys and values of its part, attending over every part.

Balance: the row is cut into 2C chunks and device d holds chunks d and 2C-1-d (`balanced_order`), an early and a
late one, so that under causal attention every device has the same work: 2C+1 pairs of (query chunk, key chunk)
with a visible key, two of them on the diagonal. Positions and segment ids travel with the tokens, and each
pair's mask is built from them (xlatrain/models/blockwise.py), so packed documents, sliding windows and soft caps
hold across the split; a chunk pair is run in blocks of at most BLOCK_AT_MOST queries and keys.

- `all_gather`: every device gathers all keys and values (only the key/value heads travel) and runs its queries
  over the chunk pairs it sees. Simple, one collective per layer, but each device holds the whole K/V.
- `ring`: the keys and values go round the devices, a collective permute per step issued before the step's
  computation so that the transfer overlaps it, each device folding the chunks it receives into an online softmax;
  the backward sends them round again, with their gradients travelling beside them and arriving home after the
  last step. The steps after the first are one loop (the last one's permute brings the keys home unused), so that
  the buffers are one step's whatever C: no device holds more than its two chunks of K/V and the two in flight.

One device's part (`local_attention`) meets the rest of its group through a `ContextGroup`: in one global program
a shard_map region over `context` with XLA's collectives (`sequence_split_attention`); in a per-device program the
group the step is traced inside (`inside_context_group`), with XLA's collectives or xlatrain's custom calls.
"""

from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from xlatrain.compat.mapping import shard_map
from xlatrain.models.blockwise import (
    Tokens,
    Visibility,
    attention_over_pairs,
    backward_pairs,
    finished,
    forward_pairs,
    grouped,
    no_gradient,
    output_gradient_terms,
    start,
    visible_pairs,
)
from xlatrain.sharding import CONTEXT, ActivationLayout

ContextAttention = Literal["all_gather", "ring"]


@dataclass(frozen=True, eq=False)
class ContextGroup:
    """The devices of one context group, seen from one of them: how its attention meets, and through which
    collectives (XLA's inside the global program's shard_map region; in a per-device program, XLA's or xlatrain's
    custom calls, lowering/context_link.py)."""

    size: int
    kind: ContextAttention
    shift: Callable[[Any], Any]
    """Each device's tree sent to the next device of the group (the last to the first)."""
    gather: Callable[[jax.Array], jax.Array]
    """The devices' arrays concatenated along axis 1 (the sequence)."""
    index: Callable[[], jax.Array]
    """This device's place in the group."""


def xla_context_group(size: int, kind: ContextAttention) -> ContextGroup:
    return ContextGroup(size, kind, lambda tree: jax.lax.ppermute(tree, CONTEXT, next_in_ring(size)),
                        lambda x: jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True),
                        lambda: jax.lax.axis_index(CONTEXT))


def next_in_ring(size: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % size) for i in range(size)]


_GROUP: ContextVar[ContextGroup | None] = ContextVar("context_group", default=None)


@contextlib.contextmanager
def inside_context_group(group: ContextGroup | None) -> Iterator[None]:
    """While a per-device step is traced: its attention meets the other parts of the sequence through `group`,
    and its batch is this device's part (lowering/step.py's in_context_order)."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def current_context_group() -> ContextGroup | None:
    return _GROUP.get()


BLOCK_AT_MOST = 512
"""Queries and keys per block of a chunk pair: the largest of 512, 256, 128 that divides the chunk, else the
chunk."""


def balanced_order(length: int, size: int) -> np.ndarray:
    """The row order under context parallelism of `size`: device d's part (the d-th of `size` equal parts) holds
    chunks d and 2 size - 1 - d of the 2 size chunks of the row. The identity for size 1."""
    chunk = length // (2 * size)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for d in range(size)
                           for c in (d, 2 * size - 1 - d)]) if size > 1 else np.arange(length)


def block_of(chunk: int) -> int:
    return next((b for b in (BLOCK_AT_MOST, 256, 128) if b <= chunk and chunk % b == 0), chunk)


def chunk_pairs(query_chunks: list[int], key_chunks: list[int], chunk: int, block: int,
                visibility: Visibility) -> list[tuple[int, int]]:
    """(query block, key block) pairs holding a visible key, for queries and keys held as the listed chunks of
    the row (by their index among the row's chunks, in the order held): a pair of chunks is read only as far as
    causal order and the window reach, whatever device holds it. Packed documents' positions restart at each
    document, but within one document they advance as the row does, so what the row's order rules out holds for
    them too."""
    blocks = chunk // block
    return [(a * blocks + m, b * blocks + n) for a, query in enumerate(query_chunks)
            for b, key in enumerate(key_chunks)
            for m, n in visible_pairs(blocks, blocks, block, (query - key) * chunk, visibility).tolist()]


def _held(device: int, size: int) -> list[int]:
    return [device, 2 * size - 1 - device]


def _per_device(tables: list[list[tuple[int, int]]]) -> np.ndarray:
    """[lists, pairs, 3] (query block, key block, 1), each list padded to the longest with (0, 0, 0), pairs that
    count for nothing (sliding windows give the devices, and the ring's steps, unequal lists; one program, and one
    loop, runs the most)."""
    longest = max(map(len, tables))
    return np.asarray([[(*pair, 1) for pair in table] + [(0, 0, 0)] * (longest - len(table)) for table in tables],
                      np.int32).reshape(len(tables), longest, 3)


def gathered_pairs(size: int, chunk: int, block: int, visibility: Visibility) -> np.ndarray:
    """[size, pairs, 3]: per device, (query block of its two chunks, key block of the gathered keys, which hold
    device d's chunks d and 2 size - 1 - d at chunk places 2d and 2d + 1, counts) with a visible key."""
    gathered = [c for d in range(size) for c in _held(d, size)]
    return _per_device([chunk_pairs(_held(r, size), gathered, chunk, block, visibility) for r in range(size)])


def _ring_lists(size: int, step: int, chunk: int, block: int, visibility: Visibility) -> list:
    return [chunk_pairs(_held(r, size), _held((r - step) % size, size), chunk, block, visibility)
            for r in range(size)]


def ring_pairs(size: int, step: int, chunk: int, block: int, visibility: Visibility) -> np.ndarray:
    """[size, pairs, 3]: per device, at ring step `step` (holding the keys of device r - step), (query block, key
    block of the two chunks held, counts) with a visible key."""
    return _per_device(_ring_lists(size, step, chunk, block, visibility))


def sequence_split_attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array,
                             positions_BxL: jax.Array, segments_BxL: jax.Array | None, visibility: Visibility,
                             layout: ActivationLayout) -> jax.Array:
    """Inside one global program whose rows are in balanced_order and split over `context` (the traced step's
    `layout`): attention through shard_map over that axis, each device running local_attention on its part; the
    rows on layout.rows_on, or (the train step) where the replicas' vmap places them."""
    tokens = token_places(positions_BxL, segments_BxL, q_BxLxHxK.shape[:2])
    split = P(layout.rows_on, CONTEXT)
    heads, kv_heads = (P(layout.rows_on, CONTEXT, layout.axes_of(name)) for name in ("heads", "kv_heads"))
    group = xla_context_group(layout.context, layout.context_attention)

    def local(q, k, v, positions, segments):
        tokens = Tokens(positions, segments)
        return local_attention(q, k, v, tokens, tokens, visibility, group)

    return shard_map(local, layout.mesh, in_specs=(heads, kv_heads, kv_heads, split, split), out_specs=heads)(
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *tokens)


def token_places(positions_BxL: jax.Array, segments_BxL: jax.Array | None, rows_by_length: tuple[int, int]) -> Tokens:
    """The Tokens of a batch's rows: positions for every row, segment ids (one segment where none are given)."""
    positions = jnp.broadcast_to(positions_BxL, rows_by_length).astype(jnp.int32)
    return Tokens(positions, jnp.zeros_like(positions) if segments_BxL is None else segments_BxL.astype(jnp.int32))


def local_attention(q, k, v, queries: Tokens, keys: Tokens, visibility: Visibility, group: ContextGroup,
                    ) -> jax.Array:
    """One device's attention in its context group (the row in balanced_order): q [B, 2c, H, K], k and v
    [B, 2c, G, K], the Tokens of both [B, 2c]."""
    if not visibility.causal:
        raise ValueError("context parallelism balances causal attention; this one is not causal")
    chunk = q.shape[1] // 2
    block = block_of(chunk)
    if group.kind == "all_gather":
        gathered = [group.gather(x) for x in (k, v, *keys)]
        pairs = jnp.asarray(gathered_pairs(group.size, chunk, block, visibility))[group.index()]
        return attention_over_pairs(q, gathered[0], gathered[1], queries, Tokens(*gathered[2:]), pairs, block,
                                    visibility)
    return ring_attention(q, k, v, queries, keys, block, visibility, group)


def _pairs_at(group: ContextGroup, step: int, chunk: int, block: int, visibility: Visibility) -> jax.Array:
    return jnp.asarray(ring_pairs(group.size, step, chunk, block, visibility))[group.index()]


def _remote_pairs(group: ContextGroup, chunk: int, block: int, visibility: Visibility) -> jax.Array:
    """[size - 1, pairs, 3]: this device's pairs at ring steps 1 .. size - 1 (the keys of other devices), each
    step's list padded to the longest, so that one loop runs every step."""
    size = group.size
    lists = [pairs for step in range(1, size) for pairs in _ring_lists(size, step, chunk, block, visibility)]
    return jnp.asarray(_per_device(lists).reshape(size - 1, size, -1, 3))[:, group.index()]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def ring_attention(q, k, v, queries: Tokens, keys: Tokens, block: int, visibility: Visibility,
                   group: ContextGroup) -> jax.Array:
    return _ring_forward(q, k, v, queries, keys, block, visibility, group)[0]


def _ring_forward(q, k, v, queries, keys, block, visibility, group):
    """Step 0 on the device's own keys, then one loop over the others' as they arrive: one loop's buffers,
    whatever the ring's size (unrolled, each step's held their own: 1.6x one device's temporaries at C = 8)."""
    chunk = q.shape[1] // 2

    def step(carry, pairs):
        running, held = carry
        onward = group.shift(held)  # in flight during this step's work; the last step's, home, unused
        return (forward_pairs(running, q, held[0], held[1], queries, held[2], pairs, block, visibility), onward), None

    carry = step((start(q, k.shape[2]), (k, v, keys)), _pairs_at(group, 0, chunk, block, visibility))[0]
    running = jax.lax.scan(step, carry, _remote_pairs(group, chunk, block, visibility))[0][0]
    attended, log_sum_exp = finished(running, q)
    return attended, (q, k, v, queries, keys, attended, log_sum_exp)


def _ring_backward(block, visibility, group, saved, d_attended):
    """The forward's ring again, each device's keys' gradients travelling beside them: after the last step they
    are home."""
    q, k, v, queries, keys, attended, log_sum_exp = saved
    chunk = q.shape[1] // 2
    d_out, delta = output_gradient_terms(attended, d_attended, k.shape[2])

    def step(carry, pairs):
        dq, held, d_held = carry
        onward = group.shift(held)
        dq_step, dk, dv = backward_pairs(q, held[0], held[1], queries, held[2], pairs, block, visibility,
                                         log_sum_exp, d_out, delta)
        return (dq + dq_step, onward, group.shift((d_held[0] + dk, d_held[1] + dv))), None

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    carry = step((jnp.zeros(grouped(q, k.shape[2]).shape, jnp.float32), (k, v, keys), zeros),
                 _pairs_at(group, 0, chunk, block, visibility))[0]
    dq, _, d_held = jax.lax.scan(step, carry, _remote_pairs(group, chunk, block, visibility))[0]
    return (dq.reshape(q.shape).astype(q.dtype), d_held[0].astype(k.dtype), d_held[1].astype(v.dtype),
            *no_gradient(queries, keys))


ring_attention.defvjp(_ring_forward, _ring_backward)
