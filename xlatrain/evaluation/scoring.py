"""Log-likelihoods of continuations after contexts from a built-in decoder's forward, as
lm-evaluation-harness's HFLM computes them: the context and the continuation are one sequence, cut from the left to
the model's context plus one; the continuation's tokens are scored by the logits before each; a continuation is
greedy when each of its tokens is the most likely one there.

Requests are scored longest first in batches, each padded on the right (causal attention: the padding changes no
earlier logit) to a bucket length, a power of two from 16 up to the model's context, so that a whole evaluation
compiles a few programs rather than one per length. Each batch's rows are split over the evaluation's devices, and
with several processes each scores its share of the batches (devices.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from xlatrain.data.tokenizers import Tokenizer
from xlatrain.evaluation.devices import everyones_results, my_share, rows_sharding

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
    """Scores (context ids, continuation ids) pairs with a decoder's weights on `mesh` (devices.py): `graphdef` its
    nnx graph definition, each call's `variables` its params and model state placed on the mesh
    (devices.placed_weights); `context`: the model's longest sequence; `batch_size` rounded up to a multiple of the
    devices. Its programs are compiled once for every call."""

    def __init__(self, graphdef: Any, context: int, batch_size: int, mesh: Mesh):
        self._scores = jax.jit(partial(_continuation_scores, graphdef))
        self.context, self.mesh = context, mesh
        self.batch_size = -(-batch_size // mesh.size) * mesh.size
        self.rows = rows_sharding(mesh)

    def score(self, variables: Any, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[Scored]:
        rows = [self._row(np.asarray(context), np.asarray(continuation)) for context, continuation in pairs]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        mine = {}
        for _, batch in my_share([order[start:start + self.batch_size]
                                  for start in range(0, len(order), self.batch_size)]):
            length = bucket_length(len(rows[batch[0]][0]), self.context)
            inputs, targets, scored = (np.zeros((self.batch_size, length), np.int32) for _ in range(3))
            for row, index in enumerate(batch):
                tokens, count = rows[index]
                inputs[row, :len(tokens) - 1], targets[row, :len(tokens) - 1] = tokens[:-1], tokens[1:]
                scored[row, len(tokens) - 1 - count:len(tokens) - 1] = 1
            sums, greedy = jax.device_get(self._scores(variables, *jax.device_put(
                (inputs, targets, scored.astype(bool)), self.rows)))
            mine.update((index, [float(sums[row]), bool(greedy[row])]) for row, index in enumerate(batch))
        return [Scored(*found) for found in everyones_results("scores", mine, len(rows))]

    def _row(self, context: np.ndarray, continuation: np.ndarray) -> tuple[np.ndarray, int]:
        """(the tokens the batch row holds: the last context + 1 of context and continuation, how many of the
        last are the continuation's)."""
        whole = np.concatenate([context, continuation]).astype(np.int32)[-(self.context + 1):]
        return whole, min(len(continuation), len(whole) - 1)
