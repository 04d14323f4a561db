"""A Llama-style decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3): RoPE, RMSNorm, a gated MLP (SwiGLU, or Gemma's
GeGLU) and grouped-query attention, with optional q/k/v and output biases, queries and keys normalised before RoPE
(per head or over the projection), norms after attention and the MLP too (Gemma's sandwich), RMSNorms that scale by
(1 + their parameter), scaled embeddings and a tied or untied head; layers of several kinds (a sliding window, a
RoPE base of their own) in one stacked block; a BlockStack, so it can be pipelined. Its projections are kept apart
(q, k, v; gate, up), as Hugging Face checkpoints store them (xlatrain/hf/). With model.moe a block's MLP is a
Mixture of Experts (xlatrain/models/experts.py), and the block returns its router's statistics beside its output;
where some layers keep the MLP, those are a second stack (models/interleave.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from flax import nnx

from xlatrain.models.attention import cached_attention, causal_attention
from xlatrain.models.axes import axes
from xlatrain.models.blocks import stack_blocks
from xlatrain.models.decoder import Decoder, by_heads, dropout_keys, residual_stream, row_parallel
from xlatrain.models.embedding import TokenEmbed
from xlatrain.models.experts import MoEMLP, MoEShape, RouterStats
from xlatrain.models.interface import Documents
from xlatrain.models.interleave import Interleaving, interleaving_of
from xlatrain.models.linear import linear
from xlatrain.models.lora import LoRAShape, projected, projection
from xlatrain.models.rope import inverse_frequencies, rotate
from xlatrain.sharding import BATCH, SEQUENCE, constrain
from xlatrain.tensor_group import dropped, enter_region, kv_heads_for_local_queries

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
"""model.mlp_activation: the gate's activation."""


@dataclass(frozen=True)
class LayerKind:
    """What sets a layer apart from others of the same stacked block: its attention's window and its RoPE."""

    window: int | None
    """None: every earlier position."""
    rope_theta: float
    rope_scaling: tuple | None
    """model.rope_scaling's items (a tuple, so that the kind hashes), or None."""

    def frequencies(self, head_dim: int):
        return inverse_frequencies(head_dim, self.rope_theta, None if self.rope_scaling is None
                                   else dict(self.rope_scaling))


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
    rope_theta_sliding: float | None = None
    """The sliding layers' RoPE base (without scaling); None: rope_theta and rope_scaling on every layer."""
    mlp_activation: str = "silu"
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    score_scale_dim: int | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    clip_qkv: float | None = None
    moe: MoEShape | None = None
    """Mixture-of-Experts feed-forward layers in place of the gated MLP (model.moe); None: the MLP."""
    moe_layers: tuple[int, ...] = ()
    """The layers with experts (model.moe); the others keep the MLP. (): every layer, where moe is set."""
    lora: LoRAShape | None = None
    """Low-rank adapters on the projections (model.lora); None: none."""

    def interleaving(self) -> Interleaving | None:
        """The dense and expert layers' order where the model has both kinds (None: one kind)."""
        return None if self.moe is None else interleaving_of(self.layers, self.moe_layers)

    def layer_kinds(self) -> tuple[tuple[LayerKind, ...], tuple[int, ...]]:
        """(the distinct kinds of layer, each layer's index among them)."""
        def kind(window: int | None) -> LayerKind:
            if window is not None and self.rope_theta_sliding is not None:
                return LayerKind(window, self.rope_theta_sliding, None)
            return LayerKind(window, self.rope_theta, self.rope_scaling)

        per_layer = [kind(window) for window in self.windows or (None,) * self.layers]
        kinds = tuple(dict.fromkeys(sorted(per_layer, key=lambda k: (k.window is not None, k.window or 0))))
        return kinds, tuple(kinds.index(k) for k in per_layer)


class PlusOneRMSNorm(nnx.Module):
    """Gemma's RMSNorm: x / rms(x) x (1 + scale), in float32, its scale starting at zero."""

    def __init__(self, width: int, epsilon: float, names: tuple):
        self.epsilon = epsilon
        self.scale = nnx.Param(jnp.zeros((width,), jnp.float32), **axes(*names))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        scale = (1.0 + self.scale[...].astype(jnp.float32)).reshape((1,) * (x.ndim - 1) + (-1,))
        return (normed * scale).astype(x.dtype)


def rms_norm(shape: LlamaShape, rngs: nnx.Rngs, width: int | None = None, names: tuple = ("embed",)
             ) -> nnx.Module:
    if shape.norm_plus_one:
        return PlusOneRMSNorm(width or shape.width, shape.norm_eps, names)
    return nnx.RMSNorm(width or shape.width, epsilon=shape.norm_eps, scale_metadata=axes(*names), rngs=rngs)


def qk_norms(shape: LlamaShape, rngs: nnx.Rngs) -> tuple[nnx.Module | None, nnx.Module | None]:
    """The RMSNorms of the queries and of the keys (model.qk_norm): over one head (a scale shared by the heads), or
    over the whole projection (a scale per feature, split over tensor as the heads are)."""
    if shape.qk_norm == "head":
        return rms_norm(shape, rngs, shape.head_dim, (None,)), rms_norm(shape, rngs, shape.head_dim, (None,))
    if shape.qk_norm == "projection":
        return (rms_norm(shape, rngs, shape.heads * shape.head_dim, ("heads",)),
                rms_norm(shape, rngs, shape.kv_heads * shape.head_dim, ("kv_heads",)))
    return None, None


def adapters_dropout_keys(rngs: jax.Array | None, lora: LoRAShape | None) -> dict | None:
    """A dropout key per adapted projection while training with adapter dropout; None otherwise."""
    if rngs is None or lora is None or lora.dropout == 0:
        return None
    return {name: jax.random.fold_in(rngs, 1 + index) for index, name in enumerate(lora.targets)}


class LlamaBlock(nnx.Module):
    def __init__(self, shape: LlamaShape, *, rngs: nnx.Rngs):
        d, k = shape.width, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, k
        self.kinds, self.kind_of_layer = shape.layer_kinds()
        self.score_scale = None if shape.score_scale_dim is None else shape.score_scale_dim ** -0.5
        self.softcap = shape.attn_softcap
        self.activation = shape.mlp_activation
        self.attn_norm = rms_norm(shape, rngs)
        lora = shape.lora
        self.q = projection(d, shape.heads * k, "q", lora, in_axis="embed", out_axis="heads",
                            use_bias=shape.qkv_bias, rngs=rngs)
        self.k, self.v = (projection(d, shape.kv_heads * k, name, lora, in_axis="embed", out_axis="kv_heads",
                                     use_bias=shape.qkv_bias, rngs=rngs) for name in ("k", "v"))
        self.qk_norm = shape.qk_norm
        self.q_norm, self.k_norm = qk_norms(shape, rngs)
        self.clip_qkv = shape.clip_qkv
        self.attn_out = projection(shape.heads * k, d, "o", lora, in_axis="heads", out_axis="embed",
                                   use_bias=shape.out_bias, rngs=rngs)
        self.post_attn_norm = rms_norm(shape, rngs) if shape.sandwich_norms else None
        self.mlp_norm = rms_norm(shape, rngs)
        if shape.moe is None:
            self.gate, self.up = (projection(d, shape.mlp_hidden, name, lora, in_axis="embed", out_axis="mlp",
                                             use_bias=False, rngs=rngs) for name in ("gate", "up"))
            self.down = projection(shape.mlp_hidden, d, "down", lora, in_axis="mlp", out_axis="embed",
                                   use_bias=False, rngs=rngs)
            self.moe = None
        else:
            self.moe = MoEMLP(d, shape.moe, rngs=rngs)
        self.post_mlp_norm = rms_norm(shape, rngs) if shape.sandwich_norms else None
        self.dropout = nnx.Dropout(shape.dropout)
        self.lora = lora

    def __call__(self, x_BxLxD, *, rngs: jax.Array | None = None, documents: Documents | None = None,
                 layer: jax.Array | None = None):
        adapter_keys = adapters_dropout_keys(rngs, self.lora)
        q, k, v, positions = self._qkv(x_BxLxD, None if documents is None else documents.positions, adapter_keys)
        segment_ids = None if documents is None else documents.segment_ids

        def attend(kind: LayerKind):
            return causal_attention(*self._rotated(q, k, positions, kind), v, segment_ids, kind.window,
                                    scale=self.score_scale, softcap=self.softcap, positions=positions)

        attended_BxLxHxK = by_heads(self._by_kind(layer, attend))
        x_BxLxD, stats = self._after_attention(x_BxLxD, attended_BxLxHxK, dropout_keys(rngs), adapter_keys)
        return x_BxLxD if stats is None else (x_BxLxD, stats)

    def decode(self, x_BxTxD, keys_BxSxGxK, values_BxSxGxK, start, positions_BxT, padding_B,
               layer: jax.Array | None = None):
        q, k, v, positions = self._qkv(x_BxTxD, positions_BxT)

        def attend(kind: LayerKind):
            return cached_attention(*self._rotated(q, k, positions, kind), v, keys_BxSxGxK, values_BxSxGxK, start,
                                    kind.window, scale=self.score_scale, softcap=self.softcap, padding_B=padding_B)

        attended_BxTxHxK, keys, values = self._by_kind(layer, attend)
        return self._after_attention(x_BxTxD, attended_BxTxHxK, (None, None))[0], keys, values

    def _by_kind(self, layer: jax.Array | None, attend):
        """`attend(kind)` with this layer's kind: the one every layer has, or (layers of several kinds) the branch
        its number picks, each branch's window and RoPE static, so that it computes only the products inside its
        window."""
        if len(self.kinds) == 1:
            return attend(self.kinds[0])
        index = jnp.asarray(self.kind_of_layer, jnp.int32)[layer]
        return jax.lax.switch(index, [lambda kind=kind: attend(kind) for kind in self.kinds])

    def _qkv(self, x_BxLxD, positions, adapter_keys: dict | None = None):
        """q, k, v before RoPE, and the positions to rotate them by. Heads are -1: a device of a tensor group holds
        some of them (xlatrain/tensor_group.py). Positions: those of the whole sequence (None: 0, 1, ...), which
        sequence parallelism gathers before attention."""
        normed = enter_region(self.attn_norm(x_BxLxD))
        positions = jnp.arange(normed.shape[1]) if positions is None else positions
        keys = adapter_keys or {}
        q_BxLxHxK = self._heads(projected(self.q, normed, keys.get("q")), self.q_norm)
        k_BxLxGxK, v_BxLxGxK = (
            kv_heads_for_local_queries(self._heads(projected(proj, normed, keys.get(name)), norm), self.kv_heads)
            for name, proj, norm in (("k", self.k, self.k_norm), ("v", self.v, None)))
        return q_BxLxHxK, k_BxLxGxK, by_heads(v_BxLxGxK, "kv_heads"), positions

    def _rotated(self, q_BxLxHxK, k_BxLxGxK, positions, kind: LayerKind):
        frequencies = kind.frequencies(self.head_dim)
        return (by_heads(rotate(q_BxLxHxK, positions, frequencies)),
                by_heads(rotate(k_BxLxGxK, positions, frequencies), "kv_heads"))

    def _heads(self, projected_BxLxF, norm: nnx.Module | None):
        """A projection [batch, length, heads x head width] as heads, normalised as model.qk_norm says and clipped
        as model.clip_qkv does."""
        if norm is not None and self.qk_norm == "projection":
            projected_BxLxF = norm(projected_BxLxF)
        batch, length, _ = projected_BxLxF.shape
        heads_BxLxHxK = projected_BxLxF.reshape(batch, length, -1, self.head_dim)
        if norm is not None and self.qk_norm == "head":
            heads_BxLxHxK = norm(heads_BxLxHxK)
        return heads_BxLxHxK if self.clip_qkv is None else jnp.clip(heads_BxLxHxK, -self.clip_qkv, self.clip_qkv)

    def _after_attention(self, x_BxLxD, attended_BxLxHxK, keys, adapter_keys: dict | None = None
                         ) -> tuple[jax.Array, RouterStats | None]:
        """(the block's output, its router's statistics where it has experts)."""
        batch, length = attended_BxLxHxK.shape[:2]
        adapter_keys = adapter_keys or {}
        attended = self._sandwiched(self.post_attn_norm, row_parallel(
            self.attn_out, attended_BxLxHxK.reshape(batch, length, -1), adapter_keys.get("o")))
        x_BxLxD = residual_stream(x_BxLxD + self._drop(attended, keys[0]))
        normed = enter_region(self.mlp_norm(x_BxLxD))
        stats = None
        if self.moe is not None:
            out, stats = self.moe(normed)
        else:
            gated = (ACTIVATIONS[self.activation](projected(self.gate, normed, adapter_keys.get("gate")))
                     * projected(self.up, normed, adapter_keys.get("up")))
            out = row_parallel(self.down, constrain(gated, BATCH, SEQUENCE, "mlp"), adapter_keys.get("down"))
        out = self._sandwiched(self.post_mlp_norm, out)
        return residual_stream(x_BxLxD + self._drop(out, keys[1])), stats

    @staticmethod
    def _sandwiched(norm: nnx.Module | None, x):
        return x if norm is None else norm(x)

    def _drop(self, x, key):
        return dropped(x, self.dropout.rate, key)


class Llama(Decoder):
    def __init__(self, shape: LlamaShape, *, rngs: nnx.Rngs):
        self.shape = shape
        self.kv_heads, self.head_width = shape.kv_heads, shape.head_dim
        self.embed = TokenEmbed(shape.vocab, shape.width, dtype=shape.dtype,
                                embedding_metadata=axes("vocab", "embed"), rngs=rngs)
        self.interleaving = shape.interleaving()
        if self.interleaving is None:
            self.blocks = stack_blocks(lambda layer_rngs: LlamaBlock(shape, rngs=layer_rngs), shape.layers, rngs)
        else:
            self.dense_blocks = stack_blocks(lambda layer_rngs: LlamaBlock(replace(shape, moe=None), rngs=layer_rngs),
                                             len(self.interleaving.first), rngs)
            self.blocks = stack_blocks(lambda layer_rngs: LlamaBlock(shape, rngs=layer_rngs),
                                       len(self.interleaving.second), rngs)
        self.scan_blocks = shape.scan_layers
        self.numbered_layers = len(shape.layer_kinds()[0]) > 1
        self.embed_scale = math.sqrt(shape.width) if shape.embed_scale else None
        self.logit_softcap = shape.logit_softcap
        self.adapted = shape.lora is not None
        self.norm = rms_norm(shape, rngs)
        self.head = None if shape.tie_embeddings else linear(
            shape.width, shape.vocab, use_bias=False, kernel_metadata=axes("embed", "vocab"), rngs=rngs)

    def embed_at(self, tokens_BxL, positions_BxL):
        """Positions enter in each block's RoPE, not here. Scaled embeddings are multiplied by sqrt(width) rounded to
        their own dtype, as transformers' Gemma does."""
        x_BxLxD = self.embed(tokens_BxL)
        return x_BxLxD if self.embed_scale is None else x_BxLxD * jnp.asarray(self.embed_scale, x_BxLxD.dtype)

    def final_norm(self, x_BxLxD):
        return self.norm(x_BxLxD)
