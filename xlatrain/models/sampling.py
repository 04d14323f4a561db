"""Sampling from a built-in decoder (xlatrain/models/decoder.py): the prompt in one pass that fills the KV cache,
then one token at a time in a compiled `lax.while_loop` (one program for the whole continuation: nothing is
compiled per token), until a stop id or `max_new_tokens`. Prompts of different lengths share a batch left-padded,
each row at its own positions, its padding never attended; stop strings are found by the host between compiled
runs of the same loop (`generate_until`).

A token is chosen as transformers' `generate` chooses it: greedily at temperature 0, else from the softmax of the
logits divided by the temperature, kept to the top_k most likely and to the fewest whose probabilities sum to
top_p (the most likely always stays)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0: greedy."""
    top_k: int | None = None
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    """A row stops once it chooses one of these (the end-of-text, a chat template's end-of-turn ids); none: it runs
    to max_new_tokens."""
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


class Decoding(NamedTuple):
    """The decode loop's state between compiled calls."""

    made: jax.Array
    """Columns of `tokens` chosen so far."""
    tokens: jax.Array
    """[B, max_new_tokens] int32."""
    cache: Any
    key: jax.Array
    done: jax.Array
    """[B] bool: the row chose a stop id (or the host found a stop string)."""
    padding: jax.Array | None
    """[B] int32: each row's left padding, the cache slots its attention never reads (None: no row is padded)."""


def start_decoding(graphdef: Any, params: Any, prompt_BxP: jax.Array, key: jax.Array, sampling: Sampling,
                   cache_dtype: Any, padding_B: jax.Array | None = None) -> Decoding:
    """The prompts in one pass that fills the KV cache, and each row's first token. Rows are left-padded to one
    length: row b's tokens begin after its padding_B[b] pads, at position 0 (None: none padded)."""
    model = nnx.merge(graphdef, params)
    batch, prompt_length = prompt_BxP.shape
    padding_B = None if padding_B is None else padding_B.astype(jnp.int32)
    cache = model.empty_cache(batch, prompt_length + sampling.max_new_tokens, cache_dtype)
    logits, cache = model.decode(prompt_BxP, cache, jnp.int32(0), padding_B)
    key, first_key = jax.random.split(key)
    first = choose(logits[:, -1], first_key, sampling)
    tokens = jnp.zeros((batch, sampling.max_new_tokens), jnp.int32).at[:, 0].set(first)
    return Decoding(jnp.int32(1), tokens, cache, key, stops(first, sampling), padding_B)


def continue_decoding(graphdef: Any, params: Any, state: Decoding, sampling: Sampling,
                      until: jax.Array | int) -> Decoding:
    """One token at a time in a `lax.while_loop` until `until` columns are made or every row is done. A row that is
    done repeats its last token."""
    model = nnx.merge(graphdef, params)
    prompt_length = state.cache.keys.shape[2] - sampling.max_new_tokens

    def unfinished(state: Decoding):
        return (state.made < jnp.minimum(until, sampling.max_new_tokens)) & ~jnp.all(state.done)

    def one_more(state: Decoding) -> Decoding:
        made, tokens, cache, key, done, padding = state
        previous = jax.lax.dynamic_slice_in_dim(tokens, made - 1, 1, axis=1)
        logits, cache = model.decode(previous, cache, prompt_length + made - 1, padding)
        key, step_key = jax.random.split(key)
        token = jnp.where(done, previous[:, 0], choose(logits[:, -1], step_key, sampling))
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], made, axis=1)
        return Decoding(made + 1, tokens, cache, key, done | stops(token, sampling), padding)

    return jax.lax.while_loop(unfinished, one_more, state)


def stops(token_B: jax.Array, sampling: Sampling) -> jax.Array:
    return jnp.isin(token_B, jnp.asarray(sampling.stop_ids, jnp.int32)) if sampling.stop_ids else (
        jnp.zeros(token_B.shape, bool))


@partial(jax.jit, static_argnums=(0, 4, 5))
def generate(graphdef: Any, params: Any, prompt_BxP: jax.Array, key: jax.Array, sampling: Sampling,
             cache_dtype: Any = jnp.float32, padding_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, max_new_tokens] int32, how many columns were made): each prompt row's continuation, in one
    program. A row that chose a stop id repeats it from there; the loop ends when every row has, or at
    max_new_tokens."""
    state = start_decoding(graphdef, params, prompt_BxP, key, sampling, cache_dtype, padding_B)
    state = continue_decoding(graphdef, params, state, sampling, sampling.max_new_tokens)
    return state.tokens, state.made


_start = jax.jit(start_decoding, static_argnums=(0, 4, 5))
_continue = jax.jit(continue_decoding, static_argnums=(0, 3), donate_argnums=(2,))


def generate_until(graphdef: Any, params: Any, prompts: list[np.ndarray], key: jax.Array, sampling: Sampling,
                   text_of: Callable[[list[int]], str], stop_strings: tuple[str, ...] = (),
                   cache_dtype: Any = jnp.float32, check_every: int = 16,
                   rows: jax.sharding.Sharding | None = None) -> list[tuple[str, np.ndarray]]:
    """Each prompt's continuation as (text, ids), the prompts of different lengths left-padded into one batch: its
    ids up to the first stop id (left out), its text (`text_of` the ids) up to the first stop string (left out,
    as lm-evaluation-harness's `until`). The host looks for stop strings every `check_every` tokens, between runs
    of the compiled loop, and a row that has one stops; without stop strings the loop runs once, to the end.
    `rows`: the batch's rows split over devices (evaluation's; their count divides the prompts')."""
    length = max(len(p) for p in prompts)
    padding = np.asarray([length - len(p) for p in prompts], np.int32)
    batch = np.zeros((len(prompts), length), np.int32)
    for row, prompt in enumerate(prompts):
        batch[row, padding[row]:] = prompt
    placed = (jnp.asarray(batch), jnp.asarray(padding)) if rows is None else jax.device_put((batch, padding), rows)
    state = _start(graphdef, params, placed[0], key, sampling, cache_dtype, placed[1])
    while True:
        made = int(state.made)
        ids = [_before_stop(row[:made], sampling.stop_ids) for row in np.asarray(state.tokens)]
        texts = [text_of(row.tolist()) for row in ids]
        cut = [min((text.find(s) for s in stop_strings if s in text), default=len(text)) for text in texts]
        found = np.asarray([at < len(text) for at, text in zip(cut, texts)])
        if made >= sampling.max_new_tokens or np.all(np.asarray(state.done) | found):
            return [(text[:at], row) for text, at, row in zip(texts, cut, ids)]
        state = _continue(graphdef, params, state._replace(done=state.done | found), sampling,
                          made + check_every if stop_strings else sampling.max_new_tokens)


def _before_stop(tokens: np.ndarray, stop_ids: tuple[int, ...]) -> np.ndarray:
    stopped = np.flatnonzero(np.isin(tokens, stop_ids)) if stop_ids else []
    return tokens[:stopped[0]] if len(stopped) else tokens
