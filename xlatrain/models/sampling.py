"""Sampling from a built-in decoder (xlatrain/models/decoder.py): the prompt in one pass that fills the KV cache,
then one token at a time in a compiled `lax.while_loop` (one program for the whole continuation: nothing is
compiled per token), until the end-of-text token or `max_new_tokens`.

A token is chosen as transformers' `generate` chooses it: greedily at temperature 0, else from the softmax of the
logits divided by the temperature, kept to the top_k most likely and to the fewest whose probabilities sum to
top_p (the most likely always stays)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0: greedy."""
    top_k: int | None = None
    top_p: float = 1.0
    end_of_text: int | None = None
    """Stops a row once chosen; None: run to max_new_tokens."""
    vocab_used: int | None = None
    """Ids at or past it (padding rows of a rounded vocabulary) are never chosen; None: every id."""


def within_vocab(logits_BxV: jax.Array, sampling: Sampling) -> jax.Array:
    """float32 logits, -inf at ids past vocab_used."""
    logits = logits_BxV.astype(jnp.float32)
    if sampling.vocab_used is None or sampling.vocab_used >= logits.shape[-1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < sampling.vocab_used, logits, -jnp.inf)


def filtered_logits(logits_BxV: jax.Array, sampling: Sampling) -> jax.Array:
    """float32 logits over the temperature, -inf where top_k, top_p or vocab_used rule an id out."""
    logits = within_vocab(logits_BxV, sampling) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        descending = jnp.sort(logits, axis=-1)[..., ::-1]
        probabilities = jax.nn.softmax(descending, axis=-1)
        before = jnp.cumsum(probabilities, axis=-1) - probabilities
        kept = jnp.sum(before < sampling.top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(descending, kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def choose(logits_BxV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """[B] int32: the next token of each row."""
    if sampling.temperature == 0:
        return jnp.argmax(within_vocab(logits_BxV, sampling), axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits_BxV, sampling), axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnums=(0, 4, 5))
def generate(graphdef: Any, params: Any, prompt_BxP: jax.Array, key: jax.Array, sampling: Sampling,
             cache_dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, max_new_tokens] int32, how many columns were made): each prompt row's continuation. A row that
    chose end_of_text repeats it from there; the loop ends when every row has, or at max_new_tokens."""
    model = nnx.merge(graphdef, params)
    batch, prompt_length = prompt_BxP.shape
    new = sampling.max_new_tokens
    cache = model.empty_cache(batch, prompt_length + new, cache_dtype)
    logits, cache = model.decode(prompt_BxP, cache, jnp.int32(0))
    key, first_key = jax.random.split(key)
    first = choose(logits[:, -1], first_key, sampling)
    tokens = jnp.zeros((batch, new), jnp.int32).at[:, 0].set(first)
    end = -1 if sampling.end_of_text is None else sampling.end_of_text

    def unfinished(carry):
        made, _, _, _, done = carry
        return (made < new) & ~jnp.all(done)

    def one_more(carry):
        made, tokens, cache, key, done = carry
        previous = jax.lax.dynamic_slice_in_dim(tokens, made - 1, 1, axis=1)
        logits, cache = model.decode(previous, cache, prompt_length + made - 1)
        key, step_key = jax.random.split(key)
        token = jnp.where(done, end, choose(logits[:, -1], step_key, sampling))
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], made, axis=1)
        return made + 1, tokens, cache, key, done | (token == end)

    made, tokens, *_ = jax.lax.while_loop(unfinished, one_more, (jnp.int32(1), tokens, cache, key, first == end))
    return tokens, made
