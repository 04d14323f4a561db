"""Log-likelihoods of continuations after contexts from a built-in decoder's forward on one device, as
lm-evaluation-harness's HFLM computes them: the context and the continuation are one sequence, cut from the left to
the model's context plus one; the continuation's tokens are scored by the logits before each; a continuation is
greedy when each of its tokens is the most likely one there.

Requests are scored longest first in batches, each padded on the right (causal attention: the padding changes no
earlier logit) to a bucket length, a power of two from 16 up to the model's context, so that a whole evaluation
compiles a few programs rather than one per length."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlatrain.data.tokenizers import Tokenizer

SMALLEST_BUCKET = 16


@dataclass(frozen=True)
class TextModel:
    """A built-in decoder as evaluation reads it: its nnx graph definition, its tokenizer, its context and
    vocabulary; the weights are given to each scoring."""

    graphdef: Any
    tokenizer: Tokenizer
    context: int
    vocab: int


@dataclass(frozen=True)
class Scored:
    log_likelihood: float
    greedy: bool


def bucket_length(length: int, context: int) -> int:
    """The padded length of a batch whose longest row is `length` tokens."""
    return min(max(SMALLEST_BUCKET, 1 << (length - 1).bit_length()), context)


def _continuation_scores(graphdef: Any, variables: Any, inputs_BxL: jax.Array, targets_BxL: jax.Array,
                         scored_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = nnx.merge(graphdef, variables)(inputs_BxL).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, targets_BxL[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets_BxL
    return (jnp.sum(jnp.where(scored_BxL, picked, 0.0), axis=-1),
            jnp.all(jnp.where(scored_BxL, greedy, True), axis=-1))


class Scorer:
    """Scores (context ids, continuation ids) pairs with a decoder's weights on one device: `graphdef` its nnx
    graph definition, each call's `variables` its params and model state (TrainedDecoder.module's pair);
    `context`: the model's longest sequence. Its programs are compiled once for every call."""

    def __init__(self, graphdef: Any, context: int, batch_size: int):
        self._scores = jax.jit(partial(_continuation_scores, graphdef))
        self.context, self.batch_size = context, batch_size

    def score(self, variables: Any, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[Scored]:
        rows = [self._row(np.asarray(context), np.asarray(continuation)) for context, continuation in pairs]
        found: list[Scored] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            length = bucket_length(len(rows[batch[0]][0]), self.context)
            inputs, targets, scored = (np.zeros((self.batch_size, length), np.int32) for _ in range(3))
            for row, index in enumerate(batch):
                tokens, count = rows[index]
                inputs[row, :len(tokens) - 1], targets[row, :len(tokens) - 1] = tokens[:-1], tokens[1:]
                scored[row, len(tokens) - 1 - count:len(tokens) - 1] = 1
            sums, greedy = jax.device_get(self._scores(variables, inputs, targets, scored.astype(bool)))
            for row, index in enumerate(batch):
                found[index] = Scored(float(sums[row]), bool(greedy[row]))
        return found

    def _row(self, context: np.ndarray, continuation: np.ndarray) -> tuple[np.ndarray, int]:
        """(the tokens the batch row holds: the last context + 1 of context and continuation, how many of the
        last are the continuation's)."""
        whole = np.concatenate([context, continuation]).astype(np.int32)[-(self.context + 1):]
        return whole, min(len(continuation), len(whole) - 1)
