"""A chunk's backward split into B (input gradient) and W (weight gradients): together they equal the pullback,
B does only the input gradient's matmuls, and nothing is computed twice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_GPT
from xlatrain.lowering.pipeline.chunks import chunk_functions, chunk_inputs, vjp_of
from xlatrain.lowering.pipeline.split_backward import split_pullback

from xlatrain.config import load_config
from xlatrain.models.blocks import split_blocks
from xlatrain.program import build_program


def layer(w, x):
    return jnp.tanh(x @ w["a"]) @ w["b"] + x


def unrolled(ws, x):
    for i in range(ws["a"].shape[0]):
        x = layer(jax.tree.map(lambda t: t[i], ws), x)
    return x


def scanned(ws, x):
    return jax.lax.scan(lambda x, w: (layer(w, x), None), x, ws)[0]


def scanned_with_a_shared_weight(ws, x):
    """A weight every iteration reads: its gradient is a carry of the backward scan, not a stacked output."""
    shared = ws["a"][0]
    return jax.lax.scan(lambda x, b: (jnp.tanh(x @ shared) @ b + x, None), x, ws["b"])[0]


def split_and_run(pullback, cotangent):
    """(the pullback's cotangents as W and B compute them, B's and W's matmul counts, the stash)."""
    split = split_pullback(pullback, cotangent)

    def b(pullback, ct):
        return split.b(pullback, ct)

    def w(pullback, stash):
        return split.w(pullback, stash)

    dx, stash = jax.jit(b)(pullback, cotangent)
    weights = jax.jit(w)(pullback, stash)
    dots = tuple(str(jax.make_jaxpr(f)(pullback, a)).count("dot_general") for f, a in ((b, cotangent), (w, stash)))
    return (*weights, dx), dots, stash


@pytest.mark.parametrize("chunk", [unrolled, scanned, scanned_with_a_shared_weight])
def test_b_and_w_equal_the_pullback_and_b_does_only_the_input_gradients_matmuls(chunk):
    k = jax.random.split(jax.random.key(0), 3)
    ws = {"a": jax.random.normal(k[0], (3, 8, 16)) * 0.3, "b": jax.random.normal(k[1], (3, 16, 8)) * 0.3}
    x = jax.random.normal(k[2], (4, 8))
    y, pullback = jax.vjp(chunk, ws, x)
    cotangent = jnp.cos(y)
    want = jax.tree.leaves(pullback(cotangent))
    got, (b_dots, w_dots), stash = split_and_run(pullback, cotangent)
    for a, b in zip(want, jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    matmuls = 2 if chunk is not unrolled else 6  # per scan body, or all three layers
    assert (b_dots, w_dots) == (matmuls, matmuls)
    # W keeps, per layer, the cotangents of the two matmuls' outputs (the inputs are the forward's residuals)
    assert sorted(s.shape for s in stash) == sorted([(4, 8), (4, 16)] * 3 if chunk is unrolled
                                                    else [(3, 4, 8), (3, 4, 16)])


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("kind", ["first", "middle", "last"])
def test_a_gpt_chunks_b_and_w_equal_its_pullback_with_dropout_and_do_its_work_once(kind, scan):
    program = build_program(load_config(None, [*TINY_GPT, f"model.scan_layers={str(scan).lower()}",
                                               "model.dropout=0.1", "batch.global_size=4"]), jax.devices()[:1])
    params = program.create_state().params
    blocks, rest = split_blocks(params)
    rows = [program.dataset.train[i] for i in range(4)]
    micro = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in ("inputs", "targets")}
    keys = jax.random.split(jax.random.key(1), program.model.blocks.layers)
    functions = chunk_functions(program.model.blocks, program.policy, "cross_entropy", micro, keys, None,
                                jnp.float32(1.0), jnp.float32(micro["targets"].size))
    x = program.model.blocks.before(params, micro["inputs"])
    if kind == "first":  # its input is zeros added to the embedding: B's gradient runs through its blocks
        x = jnp.zeros_like(x)
    out, pullback = vjp_of(kind, functions[kind], chunk_inputs(kind, blocks, rest, x))
    cotangent = jnp.ones(()) if kind == "last" else jnp.cos(out)
    want = jax.tree.leaves(pullback(cotangent))
    got, (b_dots, w_dots), stash = split_and_run(pullback, cotangent)
    for a, b in zip(want, jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=1e-6 * float(np.max(np.abs(a))))
    assert b_dots > 0 and w_dots > 0

    split = split_pullback(pullback, cotangent)
    b_flops, w_flops, whole = (flops_of(f, pullback, a) for f, a in (
        (split.b, cotangent), (split.w, stash), (lambda pullback, ct: pullback(ct), cotangent)))
    assert b_flops + w_flops == pytest.approx(whole, rel=0.03)
    assert 0.3 < w_flops / whole < 0.7  # the weight gradients are about half a backward


def flops_of(fn, *args) -> float:
    """XLA's FLOPs of fn's program (a scan's body counted once on either side); an empty program has none."""
    return jax.jit(fn).lower(*args).compile().cost_analysis().get("flops", 0.0)
