"""What the built-in decoders (GPT, Llama) share: tokens in, logits out, positions from the packed documents,
a head of their own or the embedding table's, and cached decoding for sampling (xlatrain/models/sampling.py).

Decoding runs the blocks over a few new tokens at a time, each block reading the keys and values of the tokens
before them from a cache [layers, batch, length, kv heads, head width] instead of recomputing them, and writing
those of the new tokens into it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype

from xlatrain.models.blocks import BLOCKS, DENSE_BLOCKS, BlockStack, layer_applier, layer_numbers
from xlatrain.models.interface import Documents
from xlatrain.models.interleave import Interleaving, in_layer_order, run_interleaved
from xlatrain.models.linear import dense_dot_general
from xlatrain.models.lora import LoRALinear
from xlatrain.sharding import BATCH, LENGTH, SEQUENCE, constrain
from xlatrain.tensor_group import enter_region, leave_region


class KVCache(NamedTuple):
    keys: jax.Array
    """[layers, batch, length, kv heads, head width]"""
    values: jax.Array


class Decoder(BlockStack):
    """A BlockStack over token ids whose blocks also define `decode(x, keys, values, start) -> (x, keys, values)`
    (one layer's cache). A subclass sets `embed` (a TokenEmbed) and `head` (None when tied to the embedding),
    and defines `embed_at` and `final_norm`."""

    kv_heads: int
    head_width: int
    head: nnx.Module | None
    logit_softcap: float | None = None
    """The logits soft-capped to (-c, c) as tanh(x / c) c (Gemma 2's final_logit_softcapping); None: as they are."""
    adapted: bool = False
    """Whether the model is trained through low-rank adapters (models/lora.py), its other parameters frozen."""
    interleaving: Interleaving | None = None
    """Layers of two kinds in two stacks (model.moe.dense_layers_first, interleave): those numbered
    interleaving.second from `blocks`, the others from `dense_blocks` (models/interleave.py); None: `blocks` alone."""

    def embed_at(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        raise NotImplementedError

    def final_norm(self, x_BxLxD: jax.Array) -> jax.Array:
        raise NotImplementedError

    def before_blocks(self, tokens_BxL, documents: Documents | None = None):
        """Positions restart at 0 in each packed document."""
        positions = jnp.arange(tokens_BxL.shape[1])[None] if documents is None else documents.positions
        return residual_stream(self.embed_at(tokens_BxL, positions))

    def after_blocks(self, x_BxLxD):
        x_BxLxD = enter_region(self.final_norm(x_BxLxD))
        logits_BxLxV = self.embed.attend(x_BxLxD) if self.head is None else self.head(x_BxLxD)
        if self.logit_softcap is not None:
            logits_BxLxV = jnp.tanh(logits_BxLxV / self.logit_softcap) * self.logit_softcap
        return constrain(logits_BxLxV, BATCH, SEQUENCE, "vocab")

    def layer_count(self) -> int:
        return super().layer_count() if self.interleaving is None else self.interleaving.layers

    def run_layers(self, x: jax.Array, keys_L: jax.Array | None, documents: Documents | None) -> Any:
        if self.interleaving is None:
            return super().run_layers(x, keys_L, documents)

        def kind(stack: str) -> tuple[Callable, Any]:
            graphdef, params_Nx = nnx.split(getattr(self, stack))
            apply = layer_applier(graphdef)

            def run(params, x, inputs):
                key, number = inputs
                out = apply(params, x, key, documents, number)
                return out if isinstance(out, tuple) else (out, None)

            return run, params_Nx

        (dense, dense_params), (experts, expert_params) = kind(DENSE_BLOCKS), kind(BLOCKS)
        numbers = layer_numbers(self.numbered_layers, 0, self.interleaving.layers)
        x, _, reports = run_interleaved(self.interleaving, dense, experts, dense_params, expert_params, x,
                                        (keys_L, numbers), self.scan_blocks)
        return x if reports is None else (x, reports)

    def empty_cache(self, batch: int, length: int, dtype: jnp.dtype) -> KVCache:
        zeros = jnp.zeros((self.layer_count(), batch, length, self.kv_heads, self.head_width), dtype)
        return KVCache(zeros, zeros)

    def decode(self, tokens_BxT: jax.Array, cache: KVCache, start: jax.Array, padding_B: jax.Array | None = None
               ) -> tuple[jax.Array, KVCache]:
        """Logits of tokens in cache slots start, start + 1, ... of rows whose earlier tokens are in `cache`, and
        the cache with theirs added. `padding_B`: each row's left padding, the first slots, which no query reads;
        a row's positions begin after it (None: none)."""
        positions_BxT = start + jnp.arange(tokens_BxT.shape[1])[None]
        positions_BxT = positions_BxT if padding_B is None else jnp.maximum(positions_BxT - padding_B[:, None], 0)
        x = self.embed_at(tokens_BxT, positions_BxT)

        def kind(stack: str) -> tuple[Callable, Any]:
            graphdef, params_Nx = nnx.split(getattr(self, stack))

            def layer(params, x, inputs):
                keys, values, number = inputs
                block = nnx.merge(graphdef, params)
                x, keys, values = (block.decode(x, keys, values, start, positions_BxT, padding_B) if number is None
                                   else block.decode(x, keys, values, start, positions_BxT, padding_B, layer=number))
                return x, (keys, values)

            return layer, params_Nx

        layer, params_Lx = kind(BLOCKS)
        inputs_L = (cache.keys, cache.values, layer_numbers(self.numbered_layers, 0, self.layer_count()))
        if self.interleaving is None:
            x, (keys, values) = jax.lax.scan(lambda x, carried: layer(carried[0], x, carried[1]), x,
                                             (params_Lx, inputs_L))
        else:
            dense, dense_params = kind(DENSE_BLOCKS)
            x, dense_out, expert_out = run_interleaved(self.interleaving, dense, layer, dense_params, params_Lx, x,
                                                       inputs_L, scan=True)
            keys, values = in_layer_order(self.interleaving, dense_out, expert_out)
        return self.after_blocks(x), KVCache(keys, values)


def residual_stream(x_BxLxD: jax.Array) -> jax.Array:
    """The activations between the tensor-parallel regions: whole on each device of a tensor group, or split
    along the sequence with sequence parallelism (xlatrain.sharding.constrain)."""
    return constrain(x_BxLxD, BATCH, LENGTH, None)


def row_parallel(layer: nnx.Linear, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """`layer(x)` for a layer whose input features are split over a tensor group (attention's output projection,
    the MLP's last layer): each device's product (and its adapter's, a LoRALinear's, with dropout `key`) summed
    over the group (xlatrain/tensor_group.py) before the bias, which is added once."""
    adapted = layer.delta(x, key) if isinstance(layer, LoRALinear) else None
    x, kernel, bias = promote_dtype((x, layer.kernel[...], None if layer.bias is None else layer.bias[...]),
                                    dtype=layer.dtype)
    y = dense_dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=layer.precision)
    y = leave_region(y if adapted is None else y + adapted)
    return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


def by_heads(x_BxLxHxK: jax.Array, heads: str = "heads") -> jax.Array:
    """Attention's queries, keys, values and outputs: split by whole heads over a tensor group."""
    return constrain(x_BxLxHxK, BATCH, SEQUENCE, heads, None)


def dropout_keys(rngs: jax.Array | None) -> tuple:
    """A block's two dropout keys (attention output, MLP output); None at evaluation."""
    return (None, None) if rngs is None else tuple(jax.random.split(rngs))
