"""A Llama-style decoder (Llama, Mistral, Qwen2, Qwen3): RoPE, RMSNorm, a SwiGLU MLP and grouped-query attention,
with optional q/k/v and output biases, queries and keys normalised before RoPE (per head or over the projection) and
a tied or untied head; a BlockStack, so it can be pipelined. Its projections
are kept apart (q, k, v; gate, up), as Hugging Face checkpoints store them (xlatrain/hf/)."""

from __future__ import annotations

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
from xlatrain.models.linear import linear
from xlatrain.models.rope import inverse_frequencies, rotate
from xlatrain.sharding import BATCH, constrain
from xlatrain.tensor_group import dropped, enter_region, kv_heads_for_local_queries


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab: int
    rope_theta: float
    rope_scaling: tuple | None
    """model.rope_scaling's items (a tuple, so that the shape hashes), or None."""
    norm_eps: float
    qkv_bias: bool
    out_bias: bool
    tie_embeddings: bool
    dropout: float
    scan_layers: bool
    dtype: jnp.dtype = jnp.float32
    """Compute dtype of the embeddings (the precision policy's); other layers follow their inputs."""
    qk_norm: str | None = None
    """model.qk_norm: "head", "projection" or None."""
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: full causal attention); () for every layer full."""

    def window_kinds(self) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
        """(the distinct windows, each layer's index among them)."""
        windows = self.windows or (None,) * self.layers
        kinds = tuple(sorted(set(windows), key=lambda w: -1 if w is None else w))
        return kinds, tuple(kinds.index(w) for w in windows)


def rms_norm(shape: LlamaShape, rngs: nnx.Rngs, width: int | None = None, names: tuple = ("embed",)
             ) -> nnx.RMSNorm:
    return nnx.RMSNorm(width or shape.width, epsilon=shape.norm_eps, scale_metadata=axes(*names), rngs=rngs)


def qk_norms(shape: LlamaShape, rngs: nnx.Rngs) -> tuple[nnx.RMSNorm | None, nnx.RMSNorm | None]:
    """The RMSNorms of the queries and of the keys (model.qk_norm): over one head (a scale shared by the heads), or
    over the whole projection (a scale per feature, split over tensor as the heads are)."""
    if shape.qk_norm == "head":
        return rms_norm(shape, rngs, shape.head_dim, (None,)), rms_norm(shape, rngs, shape.head_dim, (None,))
    if shape.qk_norm == "projection":
        return (rms_norm(shape, rngs, shape.heads * shape.head_dim, ("heads",)),
                rms_norm(shape, rngs, shape.kv_heads * shape.head_dim, ("kv_heads",)))
    return None, None


class LlamaBlock(nnx.Module):
    def __init__(self, shape: LlamaShape, *, rngs: nnx.Rngs):
        d, k = shape.width, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, k
        self.rope = (k, shape.rope_theta, shape.rope_scaling)
        self.attn_norm = rms_norm(shape, rngs)
        self.q = linear(d, shape.heads * k, use_bias=shape.qkv_bias, kernel_metadata=axes("embed", "heads"),
                        bias_metadata=axes("heads"), rngs=rngs)
        self.k, self.v = (linear(d, shape.kv_heads * k, use_bias=shape.qkv_bias,
                                 kernel_metadata=axes("embed", "kv_heads"), bias_metadata=axes("kv_heads"), rngs=rngs)
                          for _ in range(2))
        self.qk_norm = shape.qk_norm
        self.q_norm, self.k_norm = qk_norms(shape, rngs)
        self.windows, self.kind_of_layer = shape.window_kinds()
        self.attn_out = linear(shape.heads * k, d, use_bias=shape.out_bias, kernel_metadata=axes("heads", "embed"),
                               bias_metadata=axes("embed"), rngs=rngs)
        self.mlp_norm = rms_norm(shape, rngs)
        self.gate, self.up = (linear(d, shape.mlp_hidden, use_bias=False, kernel_metadata=axes("embed", "mlp"),
                                     rngs=rngs) for _ in range(2))
        self.down = linear(shape.mlp_hidden, d, use_bias=False, kernel_metadata=axes("mlp", "embed"), rngs=rngs)
        self.dropout = nnx.Dropout(shape.dropout)

    def __call__(self, x_BxLxD, *, rngs: jax.Array | None = None, documents: Documents | None = None,
                 layer: jax.Array | None = None):
        q, k, v = self._qkv(x_BxLxD, None if documents is None else documents.positions)
        segment_ids = None if documents is None else documents.segment_ids
        attended_BxLxHxK = by_heads(self._by_kind(
            layer, lambda window: causal_attention(q, k, v, segment_ids, window)))
        return self._after_attention(x_BxLxD, attended_BxLxHxK, dropout_keys(rngs))

    def decode(self, x_BxTxD, keys_BxSxGxK, values_BxSxGxK, start, layer: jax.Array | None = None):
        q, k, v = self._qkv(x_BxTxD, start + jnp.arange(x_BxTxD.shape[1]))
        attended_BxTxHxK, keys, values = self._by_kind(
            layer, lambda window: cached_attention(q, k, v, keys_BxSxGxK, values_BxSxGxK, start, window))
        return self._after_attention(x_BxTxD, attended_BxTxHxK, (None, None)), keys, values

    def _by_kind(self, layer: jax.Array | None, attend):
        """`attend(window)` with this layer's window: the one every layer has, or (layers of several kinds) the
        branch its number picks, each branch's window static so that it computes only the products inside it."""
        if len(self.windows) == 1:
            return attend(self.windows[0])
        kind = jnp.asarray(self.kind_of_layer, jnp.int32)[layer]
        return jax.lax.switch(kind, [lambda window=window: attend(window) for window in self.windows])

    def _qkv(self, x_BxLxD, positions):
        """Heads are -1: a device of a tensor group holds some of them (xlatrain/tensor_group.py). Positions: those
        of the whole sequence (None: 0, 1, ...), which sequence parallelism gathers before attention."""
        normed = enter_region(self.attn_norm(x_BxLxD))
        batch, length, _ = normed.shape
        positions = jnp.arange(length) if positions is None else positions
        q_BxLxHxK = self._heads(self.q(normed), self.q_norm)
        k_BxLxGxK, v_BxLxGxK = (kv_heads_for_local_queries(self._heads(proj(normed), norm), self.kv_heads)
                                for proj, norm in ((self.k, self.k_norm), (self.v, None)))
        head_dim, theta, scaling = self.rope
        frequencies = inverse_frequencies(head_dim, theta, None if scaling is None else dict(scaling))
        q_BxLxHxK, k_BxLxGxK = rotate(q_BxLxHxK, positions, frequencies), rotate(k_BxLxGxK, positions, frequencies)
        return by_heads(q_BxLxHxK), by_heads(k_BxLxGxK, "kv_heads"), by_heads(v_BxLxGxK, "kv_heads")

    def _heads(self, projected_BxLxF, norm: nnx.RMSNorm | None):
        """A projection [batch, length, heads x head width] as heads, normalised as model.qk_norm says."""
        if norm is not None and self.qk_norm == "projection":
            projected_BxLxF = norm(projected_BxLxF)
        batch, length, _ = projected_BxLxF.shape
        heads_BxLxHxK = projected_BxLxF.reshape(batch, length, -1, self.head_dim)
        return norm(heads_BxLxHxK) if norm is not None and self.qk_norm == "head" else heads_BxLxHxK

    def _after_attention(self, x_BxLxD, attended_BxLxHxK, keys):
        batch, length = attended_BxLxHxK.shape[:2]
        attended = row_parallel(self.attn_out, attended_BxLxHxK.reshape(batch, length, -1))
        x_BxLxD = residual_stream(x_BxLxD + self._drop(attended, keys[0]))
        normed = enter_region(self.mlp_norm(x_BxLxD))
        hidden_BxLxF = constrain(jax.nn.silu(self.gate(normed)) * self.up(normed), BATCH, None, "mlp")
        return residual_stream(x_BxLxD + self._drop(row_parallel(self.down, hidden_BxLxF), keys[1]))

    def _drop(self, x, key):
        return dropped(x, self.dropout.rate, key)


class Llama(Decoder):
    def __init__(self, shape: LlamaShape, *, rngs: nnx.Rngs):
        self.shape = shape
        self.kv_heads, self.head_width = shape.kv_heads, shape.head_dim
        self.embed = TokenEmbed(shape.vocab, shape.width, dtype=shape.dtype,
                                embedding_metadata=axes("vocab", "embed"), rngs=rngs)
        self.blocks = stack_blocks(lambda layer_rngs: LlamaBlock(shape, rngs=layer_rngs), shape.layers, rngs)
        self.scan_blocks = shape.scan_layers
        self.numbered_layers = len(shape.window_kinds()[0]) > 1
        self.norm = rms_norm(shape, rngs)
        self.head = None if shape.tie_embeddings else linear(
            shape.width, shape.vocab, use_bias=False, kernel_metadata=axes("embed", "vocab"), rngs=rngs)

    def embed_at(self, tokens_BxL, positions_BxL):
        """Positions enter in each block's RoPE, not here."""
        return self.embed(tokens_BxL)

    def final_norm(self, x_BxLxD):
        return self.norm(x_BxLxD)
