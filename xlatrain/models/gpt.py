"""A decoder-only transformer over tokens, with causal attention; a BlockStack, so it can be pipelined. On packed
data it keeps attention and positions inside each document."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from xlatrain.models.attention import causal_attention
from xlatrain.models.axes import axes
from xlatrain.models.blocks import BlockStack, stack_blocks
from xlatrain.models.embedding import TokenEmbed
from xlatrain.models.interface import Documents
from xlatrain.models.linear import linear


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
        self.qkv = linear(d, 3 * d, kernel_metadata=axes("embed", "heads"), bias_metadata=axes("heads"),
                          rngs=rngs)
        self.attn_out = linear(d, d, kernel_metadata=axes("heads", "embed"), bias_metadata=axes("embed"),
                               rngs=rngs)
        self.ln_mlp = nnx.LayerNorm(d, scale_metadata=axes("embed"), bias_metadata=axes("embed"), rngs=rngs)
        self.mlp_in = linear(d, shape.mlp_ratio * d, kernel_metadata=axes("embed", "mlp"),
                             bias_metadata=axes("mlp"), rngs=rngs)
        self.mlp_out = linear(shape.mlp_ratio * d, d, kernel_metadata=axes("mlp", "embed"),
                              bias_metadata=axes("embed"), rngs=rngs)
        self.dropout = nnx.Dropout(shape.dropout)

    def __call__(self, x_BxLxD, *, rngs: jax.Array | None = None, documents: Documents | None = None):
        batch, length, width = x_BxLxD.shape
        keys = (None, None) if rngs is None else tuple(jax.random.split(rngs))
        qkv_BxLx3xHxK = self.qkv(self.ln_attn(x_BxLxD)).reshape(
            batch, length, 3, self.heads, width // self.heads)
        q, k, v = (qkv_BxLx3xHxK[:, :, i] for i in range(3))
        attended_BxLxHxK = causal_attention(q, k, v, None if documents is None else documents.segment_ids)
        x_BxLxD = x_BxLxD + self._drop(self.attn_out(attended_BxLxHxK.reshape(batch, length, width)), keys[0])
        hidden_BxLxF = jax.nn.gelu(self.mlp_in(self.ln_mlp(x_BxLxD)))
        return x_BxLxD + self._drop(self.mlp_out(hidden_BxLxF), keys[1])

    def _drop(self, x, key):
        return self.dropout(x, deterministic=key is None, rngs=key)


class GPT(BlockStack):
    def __init__(self, shape: GPTShape, *, rngs: nnx.Rngs):
        self.shape = shape
        # nnx.Embed computes in its `dtype` (float32 unless told), not in the dtype of its table.
        self.embed = TokenEmbed(shape.vocab, shape.width, dtype=shape.dtype,
                                embedding_metadata=axes("vocab", "embed"), rngs=rngs)
        self.position = nnx.Embed(shape.max_len, shape.width, dtype=shape.dtype,
                                  embedding_metadata=axes(None, "embed"), rngs=rngs)
        self.blocks = stack_blocks(lambda layer_rngs: Block(shape, rngs=layer_rngs), shape.layers, rngs)
        self.scan_blocks = shape.scan_layers
        self.ln_final = nnx.LayerNorm(shape.width, scale_metadata=axes("embed"), bias_metadata=axes("embed"),
                                      rngs=rngs)
        self.head = linear(shape.width, shape.vocab, kernel_metadata=axes("embed", "vocab"),
                           bias_metadata=axes("vocab"), rngs=rngs)

    def before_blocks(self, tokens_BxL, documents: Documents | None = None):
        """Positions restart at 0 in each packed document."""
        if documents is None:
            return self.embed(tokens_BxL) + self.position(jnp.arange(tokens_BxL.shape[1]))[None]
        return self.embed(tokens_BxL) + self.position(documents.positions)

    def after_blocks(self, x_BxLxD):
        return self.head(self.ln_final(x_BxLxD))
