"""Causal attention in query blocks (xlatrain/models/attention.py): the same values and gradients as the dense causal
attention, and how many blocks a length gets."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from xlatrain.lowering.flops import step_flops

from xlatrain.models import attention as attention_module
from xlatrain.models.attention import attention, causal_attention, causal_attention_in_query_blocks, query_blocks


@pytest.mark.parametrize("length, blocks", [(256, 4), (128, 4), (96, 3), (64, 2), (48, 1), (32, 1), (8, 1)])
def test_a_length_gets_up_to_four_blocks_of_at_least_32_queries(length, blocks):
    assert query_blocks(length) == blocks


def qkv(length, dtype=jnp.float32):
    return tuple(jax.random.normal(jax.random.PRNGKey(i), (2, length, 3, 8), dtype) for i in range(3))


@pytest.mark.parametrize("blocks", [2, 3, 4])
def test_blocks_give_the_dense_causal_attentions_values_and_gradients(blocks):
    q, k, v = qkv(48)
    weights = jax.random.normal(jax.random.PRNGKey(9), q.shape)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * weights)

    dense = jax.value_and_grad(loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
                               argnums=(0, 1, 2))(q, k, v)
    blocked = jax.value_and_grad(loss(lambda q, k, v: causal_attention_in_query_blocks(q, k, v, blocks)),
                                 argnums=(0, 1, 2))(q, k, v)
    for want, got in zip(jax.tree.leaves(dense), jax.tree.leaves(blocked), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_on_cpu_a_causal_attention_runs_in_blocks_and_skips_the_products_above_them():
    q, k, v = qkv(128)
    dense = step_flops(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True), q, k, v)
    assert dense == 2 * 2 * (2 * 3 * 128 * 128 * 8)  # q.k and p.v over every pair: batch 2, 3 heads of 8
    assert step_flops(lambda *a: attention(*a, is_causal=True), q, k, v) == dense * (1 + 2 + 3 + 4) / 16
    assert step_flops(lambda *a: attention(*a, is_causal=False), q, k, v) == dense
    np.testing.assert_allclose(attention(q, k, v, is_causal=True),
                               jax.nn.dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)


def test_float16_runs_in_float32_and_returns_float16():
    q, k, v = qkv(32, jnp.float16)
    out = attention(q, k, v, is_causal=True)
    assert out.dtype == jnp.float16
    want = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
    np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=2e-3, atol=2e-3)


def test_a_gpu_run_without_cudnn_says_once_that_attention_falls_back_and_what_to_install(monkeypatch, capsys):
    """`xlatrain train` on a GPU host without cuDNN fell back to XLA's attention silently. The GPU and the missing
    cuDNN are stood in for: the run's description asks jax for the platform, compat for cuDNN."""
    from types import SimpleNamespace

    from conftest import TINY_GPT

    from xlatrain import trainer
    from xlatrain.config import load_config
    from xlatrain.program import build_program

    program = build_program(load_config(None, [*TINY_GPT, "precision.policy=bf16"]), jax.devices()[:1])
    monkeypatch.setattr(attention_module, "cudnn_missing", lambda: "cuDNN not found")
    monkeypatch.setattr(trainer.jax, "devices", lambda: [SimpleNamespace(platform="gpu")])
    trainer._describe(program, echo=lambda _: None)
    warned = capsys.readouterr().err.strip().splitlines()
    assert warned == ["xlatrain: warning: attention falls back to XLA's, not cuDNN's fused kernel (cuDNN not found): "
                      "about 5x slower in the forward and backward (bench.gpu); pip install nvidia-cudnn-cu13 beside "
                      "jax's CUDA plugin"]
    assert attention_module.fused_attention_missing("gpu", jnp.float32) is None  # float32 never takes cuDNN's
    monkeypatch.setattr(attention_module, "cudnn_missing", lambda: None)
    assert attention_module.fused_attention_missing("gpu", jnp.bfloat16) is None


def test_the_attention_traced_for_a_gpu_says_which_kernel_each_kind_of_layer_takes_and_why(monkeypatch):
    """What `xlatrain lower --target` reports: cuDNN's fused kernel, or XLA's and why (no cuDNN, a soft cap, float32);
    on a CPU, XLA's in query blocks."""
    from xlatrain.runtime.platform import compiling_for

    AttentionPath = attention_module.AttentionPath
    q32 = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    q16 = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.bfloat16)
    monkeypatch.setattr(attention_module, "cudnn_missing", lambda: "cuDNN not found")

    def traced(platform, q, **options):
        with compiling_for(platform), attention_module.attention_paths() as paths:
            jax.make_jaxpr(lambda *qkv: causal_attention(*qkv, **options))(q, q, q)
        return paths

    assert traced("gpu", q16, window=16) == [AttentionPath(16, None, "XLA's", "cuDNN not found: pip install "
                                                           "nvidia-cudnn-cu13 beside jax's CUDA plugin")]
    [capped] = traced("gpu", q16, softcap=50.0)
    assert (capped.window, capped.softcap, capped.kernel) == (None, 50.0, "XLA's")
    assert "has no soft-capping" in capped.why
    assert traced("gpu", q32)[0].why == "cuDNN's fused kernel takes bfloat16 and float16, not float32"
    assert traced("cpu", q32, window=16) == [AttentionPath(16, None, "XLA's, in 2 query blocks")]


def windowed_reference(q, k, v, window, segment_ids=None):
    """Softmax attention with transformers 5's sliding-window mask written out: key j is visible to query i when
    i - window < j <= i (and, with packed documents, j is in i's document)."""
    length = q.shape[1]
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (j <= i) & (j > i - window)
    if segment_ids is not None:
        visible = visible[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(visible)[:, None] if visible.ndim == 3
                                        else jnp.asarray(visible)[None, None])


@pytest.mark.parametrize("length, window, packed", [(16, 4, False), (16, 4, True), (128, 32, True), (256, 32, False),
                                                    (2048, 300, True)])
def test_a_sliding_window_with_packed_documents_equals_the_exact_mask(length, window, packed):
    """2048 tokens run blockwise (xlatrain/models/blockwise.py), the shorter ones in query blocks or whole."""
    q, k, v = qkv(length)
    segment_ids = None
    if packed:
        cuts = np.sort(np.random.default_rng(length).choice(np.arange(1, length), 3, replace=False))
        segment_ids = jnp.asarray(np.stack([np.searchsorted(cuts, np.arange(length), side="right") + 1] * 2))
    ours = causal_attention(q, k, v, segment_ids, window)
    grads = jax.grad(lambda *a: jnp.sum(causal_attention(*a, segment_ids, window) ** 2), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda *a: jnp.sum(windowed_reference(*a, window, segment_ids) ** 2), argnums=(0, 1, 2))(
        q, k, v)
    for got, want in zip((ours, *grads), (windowed_reference(q, k, v, window, segment_ids), *expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(want))))
    assert np.array_equal(causal_attention(q, k, v, segment_ids, length), causal_attention(q, k, v, segment_ids))


def test_blockwise_attention_equals_the_dense_one_with_grouped_heads_soft_caps_and_documents():
    """Values and gradients of the online softmax over block pairs against the scores written out whole."""
    from xlatrain.models.attention import dot_attention
    from xlatrain.models.blockwise import Visibility, blockwise_attention

    q = jax.random.normal(jax.random.PRNGKey(0), (2, 256, 4, 8))
    k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 256, 2, 8)) for i in (1, 2))
    segments = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 5, (2, 256)), axis=1), jnp.int32)
    same = (segments[:, :, None] == segments[:, None, :])[:, None]
    weights = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    for causal, window, softcap in ((True, None, None), (True, 40, 2.0), (False, None, 2.0)):
        ours = jax.value_and_grad(lambda *a: jnp.sum(blockwise_attention(
            *a, 64, Visibility(causal, window, 0.3, softcap), segments) * weights), argnums=(0, 1, 2))(q, k, v)
        band = None if window is None else (window - 1, 0)
        dense = jax.value_and_grad(lambda *a: jnp.sum(dot_attention(
            *a, mask=same, scale=0.3, is_causal=causal, band=band, softcap=softcap) * weights), argnums=(0, 1, 2))(
            q, k, v)
        for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(dense), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def test_a_long_attention_holds_no_length_by_length_array_forward_or_backward():
    """At 8192 packed tokens, no value in the jaxpr of the loss and its gradients (scan bodies included) is as
    large as an eighth of a [length, length] mask: a pair of blocks' scores is the largest."""
    length = 8192
    q = jax.ShapeDtypeStruct((1, length, 2, 8), jnp.float32)
    segments = jax.ShapeDtypeStruct((1, length), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v, s: jnp.sum(causal_attention(q, k, v, s, window=None)),
                                    argnums=(0, 1, 2)))(q, q, q, segments)

    def sizes(jaxpr):
        for equation in jaxpr.eqns:
            yield from (int(np.prod(var.aval.shape)) for var in equation.outvars)
            for inner in jax.extend.core.jaxprs_in_params(equation.params):
                yield from sizes(inner)

    assert max(sizes(jaxpr.jaxpr)) < length * length // 8


def test_a_windowed_layer_computes_at_most_six_tenths_of_a_full_causal_layers_products():
    """Seq 256, a window of 32, XLA's cost analysis of the compiled programs: query blocks of a window's length each
    read under two windows of keys (measured 0.37x)."""
    from xlatrain.compat.monitoring import cost_analysis

    q, k, v = qkv(256)

    def flops(window):
        return cost_analysis(jax.jit(lambda *a: causal_attention(*a, window=window)).lower(q, k, v).compile())["flops"]

    assert flops(32) <= 0.6 * flops(None), flops(32) / flops(None)
