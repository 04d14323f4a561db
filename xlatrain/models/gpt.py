"""A GPT-2 style decoder over tokens, with causal attention; a BlockStack, so it can be pipelined. On packed
data it keeps attention and positions inside each document. Its parameters load from and export to GPT-2
checkpoints (xlatrain/hf/), with a tied head without bias and GPT-2's LayerNorm epsilon."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from xlatrain.models.attention import cached_attention, causal_attention
from xlatrain.models.axes import axes
from xlatrain.models.blocks import stack_blocks
from xlatrain.models.decoder import Decoder, by_heads, dropout_keys, residual_stream, row_parallel
from xlatrain.models.embedding import TokenEmbed
from xlatrain.models.interface import Documents
from xlatrain.models.linear import GroupedLinear, linear
from xlatrain.sharding import BATCH, SEQUENCE, constrain
from xlatrain.tensor_group import dropped, enter_region, sequence_part


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
    tie_embeddings: bool = False
    head_bias: bool = True
    norm_eps: float = 1e-6


def layer_norm(shape: GPTShape, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(shape.width, epsilon=shape.norm_eps, scale_metadata=axes("embed"),
                         bias_metadata=axes("embed"), rngs=rngs)


class Block(nnx.Module):
    def __init__(self, shape: GPTShape, *, rngs: nnx.Rngs):
        d = shape.width
        self.head_width = d // shape.heads
        self.ln_attn = layer_norm(shape, rngs)
        self.qkv = GroupedLinear(d, 3, d, kernel_metadata=axes("embed", None, "heads"),
                                 bias_metadata=axes(None, "heads"), rngs=rngs)
        self.attn_out = linear(d, d, kernel_metadata=axes("heads", "embed"), bias_metadata=axes("embed"),
                               rngs=rngs)
        self.ln_mlp = layer_norm(shape, rngs)
        self.mlp_in = linear(d, shape.mlp_ratio * d, kernel_metadata=axes("embed", "mlp"),
                             bias_metadata=axes("mlp"), rngs=rngs)
        self.mlp_out = linear(shape.mlp_ratio * d, d, kernel_metadata=axes("mlp", "embed"),
                              bias_metadata=axes("embed"), rngs=rngs)
        self.dropout = nnx.Dropout(shape.dropout)

    def __call__(self, x_BxLxD, *, rngs: jax.Array | None = None, documents: Documents | None = None):
        keys = dropout_keys(rngs)
        q, k, v = self._qkv(x_BxLxD)
        segment_ids, positions = (None, None) if documents is None else documents
        attended_BxLxHxK = by_heads(causal_attention(q, k, v, segment_ids, positions=positions))
        return self._after_attention(x_BxLxD, attended_BxLxHxK, keys)

    def decode(self, x_BxTxD, keys_BxSxHxK, values_BxSxHxK, start, positions_BxT, padding_B):
        attended_BxTxHxK, keys, values = cached_attention(*self._qkv(x_BxTxD), keys_BxSxHxK, values_BxSxHxK, start,
                                                          padding_B=padding_B)
        return self._after_attention(x_BxTxD, attended_BxTxHxK, (None, None)), keys, values

    def _qkv(self, x_BxLxD):
        """Heads are -1: a device of a tensor group holds some of them (xlatrain/tensor_group.py)."""
        normed_BxLxD = enter_region(self.ln_attn(x_BxLxD))
        batch, length, _ = normed_BxLxD.shape
        qkv_BxLx3xHxK = self.qkv(normed_BxLxD).reshape(batch, length, 3, -1, self.head_width)
        return tuple(by_heads(qkv_BxLx3xHxK[:, :, i]) for i in range(3))

    def _after_attention(self, x_BxLxD, attended_BxLxHxK, keys):
        batch, length = attended_BxLxHxK.shape[:2]
        attended_BxLxD = row_parallel(self.attn_out, attended_BxLxHxK.reshape(batch, length, -1))
        x_BxLxD = residual_stream(x_BxLxD + self._drop(attended_BxLxD, keys[0]))
        hidden_BxLxF = constrain(jax.nn.gelu(self.mlp_in(enter_region(self.ln_mlp(x_BxLxD)))), BATCH, SEQUENCE, "mlp")
        return residual_stream(x_BxLxD + self._drop(row_parallel(self.mlp_out, hidden_BxLxF), keys[1]))

    def _drop(self, x, key):
        return dropped(x, self.dropout.rate, key)


class GPT(Decoder):
    def __init__(self, shape: GPTShape, *, rngs: nnx.Rngs):
        self.shape = shape
        self.kv_heads, self.head_width = shape.heads, shape.width // shape.heads
        # nnx.Embed computes in its `dtype` (float32 unless told), not in the dtype of its table.
        self.embed = TokenEmbed(shape.vocab, shape.width, dtype=shape.dtype,
                                embedding_metadata=axes("vocab", "embed"), rngs=rngs)
        self.position = nnx.Embed(shape.max_len, shape.width, dtype=shape.dtype,
                                  embedding_metadata=axes(None, "embed"), rngs=rngs)
        self.blocks = stack_blocks(lambda layer_rngs: Block(shape, rngs=layer_rngs), shape.layers, rngs)
        self.scan_blocks = shape.scan_layers
        self.ln_final = layer_norm(shape, rngs)
        self.head = None if shape.tie_embeddings else linear(
            shape.width, shape.vocab, use_bias=shape.head_bias, kernel_metadata=axes("embed", "vocab"),
            bias_metadata=axes("vocab"), rngs=rngs)

    def embed_at(self, tokens_BxL, positions_BxL):
        return self.embed(tokens_BxL) + self.position(sequence_part(positions_BxL))

    def final_norm(self, x_BxLxD):
        return self.ln_final(x_BxLxD)
