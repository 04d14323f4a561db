"""A decoder-only transformer over tokens, with causal attention and optional scan over layers."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from xlatrain import compat
from xlatrain.models.axes import axes


@dataclass(frozen=True)
class GPTShape:
    layers: int
    width: int
    heads: int
    mlp_ratio: int
    vocab: int
    max_len: int
    dropout: float
    scan_layers: bool
    dtype: jnp.dtype = jnp.float32
    """Compute dtype of the embeddings (the precision policy's); other layers follow their inputs."""


class Block(nnx.Module):
    def __init__(self, shape: GPTShape, *, rngs: nnx.Rngs):
        d = shape.width
        self.heads = shape.heads
        self.ln_attn = nnx.LayerNorm(d, scale_metadata=axes("embed"), bias_metadata=axes("embed"), rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, kernel_metadata=axes("embed", "heads"), bias_metadata=axes("heads"),
                              rngs=rngs)
        self.attn_out = nnx.Linear(d, d, kernel_metadata=axes("heads", "embed"), bias_metadata=axes("embed"),
                                   rngs=rngs)
        self.ln_mlp = nnx.LayerNorm(d, scale_metadata=axes("embed"), bias_metadata=axes("embed"), rngs=rngs)
        self.mlp_in = nnx.Linear(d, shape.mlp_ratio * d, kernel_metadata=axes("embed", "mlp"),
                                 bias_metadata=axes("mlp"), rngs=rngs)
        self.mlp_out = nnx.Linear(shape.mlp_ratio * d, d, kernel_metadata=axes("mlp", "embed"),
                                  bias_metadata=axes("embed"), rngs=rngs)
        self.dropout = nnx.Dropout(shape.dropout)

    def __call__(self, x_BxLxD, key: jax.Array | None):
        batch, length, width = x_BxLxD.shape
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        qkv_BxLx3xHxK = self.qkv(self.ln_attn(x_BxLxD)).reshape(
            batch, length, 3, self.heads, width // self.heads)
        q, k, v = (qkv_BxLx3xHxK[:, :, i] for i in range(3))
        attended_BxLxHxK = compat.causal_attention(q, k, v)
        x_BxLxD = x_BxLxD + self._drop(self.attn_out(attended_BxLxHxK.reshape(batch, length, width)), keys[0])
        hidden_BxLxF = jax.nn.gelu(self.mlp_in(self.ln_mlp(x_BxLxD)))
        return x_BxLxD + self._drop(self.mlp_out(hidden_BxLxF), keys[1])

    def _drop(self, x, key):
        return self.dropout(x, deterministic=key is None, rngs=key)


class GPT(nnx.Module):
    def __init__(self, shape: GPTShape, *, rngs: nnx.Rngs):
        self.shape = shape
        # nnx.Embed computes in its `dtype` (float32 unless told), not in the dtype of its table.
        self.embed = nnx.Embed(shape.vocab, shape.width, dtype=shape.dtype, embedding_metadata=axes("vocab", "embed"),
                               rngs=rngs)
        self.position = nnx.Embed(shape.max_len, shape.width, dtype=shape.dtype,
                                  embedding_metadata=axes(None, "embed"), rngs=rngs)
        if shape.scan_layers:
            self.blocks = _stacked_blocks(shape, rngs)
        else:
            self.blocks = nnx.List([Block(shape, rngs=rngs) for _ in range(shape.layers)])
        self.ln_final = nnx.LayerNorm(shape.width, scale_metadata=axes("embed"), bias_metadata=axes("embed"),
                                      rngs=rngs)
        self.head = nnx.Linear(shape.width, shape.vocab, kernel_metadata=axes("embed", "vocab"),
                               bias_metadata=axes("vocab"), rngs=rngs)

    def __call__(self, tokens_BxL, *, rngs: jax.Array | None = None):
        length = tokens_BxL.shape[1]
        x_BxLxD = self.embed(tokens_BxL) + self.position(jnp.arange(length))[None]
        layer_keys = None if rngs is None else jax.random.split(rngs, self.shape.layers)
        if self.shape.scan_layers:
            x_BxLxD = _scan_blocks(self.blocks, x_BxLxD, layer_keys)
        else:
            for i, block in enumerate(self.blocks):
                x_BxLxD = block(x_BxLxD, None if layer_keys is None else layer_keys[i])
        return self.head(self.ln_final(x_BxLxD))


def _stacked_blocks(shape: GPTShape, rngs: nnx.Rngs) -> Block:
    """One Block whose parameters carry a leading `layers` axis, for lax.scan."""

    @nnx.split_rngs(splits=shape.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs: nnx.Rngs) -> Block:
        return Block(shape, rngs=layer_rngs)

    return make(rngs)


def _scan_blocks(stacked: Block, x_BxLxD, layer_keys):
    graphdef, params_Lx = nnx.split(stacked)

    def body(x, layer):
        params, key = layer
        return nnx.merge(graphdef, params)(x, key), None

    return jax.lax.scan(body, x_BxLxD, (params_Lx, layer_keys))[0]
