"""Built-in and user models, optimizers by name, schedules with warmup, and the weight-decay mask."""

import json
import math
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DIGITS_MLP, REPO
from flax import nnx
from test_config import cli_error
from xlatrain.lowering.pipeline.residuals import saving_matmuls
from xlatrain.lowering.step import cross_entropy_with_integer_labels

from xlatrain.config import derive, load_config
from xlatrain.data.spec import DataSpec
from xlatrain.errors import UserError
from xlatrain.models import model_factory
from xlatrain.models.embedding import lookup, scatter_rows, sorted_rows
from xlatrain.models.linear import dense_dot_general
from xlatrain.optim import build_optimizer, decay_mask, learning_rate_schedule
from xlatrain.pipeline.layout import StageLayout
from xlatrain.trainer import train

TOKENS = DataSpec((16,), np.dtype(np.int32), (16,), np.dtype(np.int32), 256)


def gpt(*overrides):
    config = load_config(None, ["model.layers=3", "model.width=32", "model.heads=4", "data.seq_len=16", *overrides])
    return model_factory(config.model, TOKENS)(nnx.Rngs(0))


@pytest.mark.parametrize("layers, platform, scans", [(4, "cpu", False), (16, "cpu", False), (17, "cpu", True),
                                                     (12, "gpu", False), (48, "gpu", False), (49, "gpu", True),
                                                     (4, "tpu", True)])
def test_scan_layers_auto_unrolls_shallow_stacks_on_cpus_and_gpus(layers, platform, scans):
    assert load_config(None, [f"model.layers={layers}"]).model.scans_layers(platform) is scans
    assert load_config(None, [f"model.layers={layers}", "model.scan_layers=false"]).model.scans_layers("gpu") is False


def test_gpt_is_causal_and_scan_matches_loop():
    scanned, looped = gpt("model.scan_layers=true"), gpt("model.scan_layers=false")
    assert scanned.scan_blocks and not looped.scan_blocks
    same_params = jax.tree.map(np.array_equal, nnx.to_pure_dict(nnx.state(scanned)),
                               nnx.to_pure_dict(nnx.state(looped)))
    assert all(jax.tree.leaves(same_params))  # both stack the layers; scan_layers only changes the loop
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 256
    np.testing.assert_allclose(scanned(tokens), looped(tokens), rtol=1e-5, atol=1e-5)
    changed = tokens.at[:, 10].set(7)
    np.testing.assert_array_equal(scanned(tokens)[:, :10], scanned(changed)[:, :10])
    assert not np.allclose(scanned(tokens)[:, 10:], scanned(changed)[:, 10:])


def test_unrolled_layers_gradient_is_one_concatenate_per_stacked_leaf_and_equals_the_scans():
    """Indexing layer i out of the stacked params would make its gradient a stacked-size pad per layer, summed."""
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 256

    def blocks_gradient(model):
        graphdef, params = nnx.split(model, nnx.Param)
        return jax.grad(lambda p: nnx.merge(graphdef, p)(tokens).sum())(params)["blocks"]

    looped, scanned = gpt("model.scan_layers=false"), gpt("model.scan_layers=true")
    stacked_shapes = {leaf.shape for leaf in jax.tree.leaves(nnx.state(looped.blocks, nnx.Param))}
    made = [(eqn.primitive.name, var.aval.shape) for eqn in all_equations(jax.make_jaxpr(blocks_gradient)(looped).jaxpr)
            for var in eqn.outvars]
    assert [shape for name, shape in made if name == "pad" and shape in stacked_shapes] == []
    assert {shape for name, shape in made if name == "concatenate"} >= stacked_shapes
    # float32 sums in another order: an element's error is relative to the leaf's scale (up to ~100 here)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(np.max(np.abs(b)))),
                 blocks_gradient(looped), blocks_gradient(scanned))


def all_equations(jaxpr):
    """A jaxpr's equations and those of the jaxprs inside them (jit, custom_vjp, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_equations(sub)


def test_the_token_embeddings_gradient_sums_in_float32_and_sorting_changes_no_bit():
    table = jax.random.normal(jax.random.PRNGKey(0), (300, 16))
    ids = jax.random.randint(jax.random.PRNGKey(1), (4, 50), 0, 256)  # byte-like: many repeats
    weights = jax.random.normal(jax.random.PRNGKey(2), (4, 50, 16))

    def loss(lookup_rows, dtype):
        return jax.grad(lambda t: jnp.sum(lookup_rows(t, dtype).astype(jnp.float32) * weights))(table)

    ours = {dtype: loss(lambda t, d: lookup(t, ids, d), dtype) for dtype in (jnp.float32, jnp.bfloat16)}
    takes = {dtype: loss(lambda t, d: jnp.take(t.astype(d), ids, axis=0), dtype)
             for dtype in (jnp.float32, jnp.bfloat16)}
    np.testing.assert_array_equal(ours[jnp.float32], takes[jnp.float32])
    # bf16: the same rows rounded to bf16 once each, against jnp.take's bf16 sum rounded at every token
    rows_f32 = jnp.zeros((300, 16)).at[ids].add(weights.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(ours[jnp.bfloat16], rows_f32)
    assert not np.array_equal(takes[jnp.bfloat16], rows_f32)
    grads, flat = jax.random.normal(jax.random.PRNGKey(3), (200, 16)), ids.reshape(-1)
    np.testing.assert_array_equal(sorted_rows(grads, flat, 300), scatter_rows(grads, flat, 300))


def test_the_cross_entropy_is_optaxs_without_a_scatter_in_its_gradient():
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 11)) * 5
    labels = jax.random.randint(jax.random.PRNGKey(1), (4, 8), 0, 11)
    weights = jax.random.uniform(jax.random.PRNGKey(2), (4, 8))  # a mask's weights: the cotangent is not constant
    theirs = optax.losses.softmax_cross_entropy_with_integer_labels

    def gradient(cross_entropy):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(cross_entropy(x, labels) * w)))

    np.testing.assert_array_equal(cross_entropy_with_integer_labels(logits, labels), theirs(logits, labels))
    np.testing.assert_array_equal(gradient(cross_entropy_with_integer_labels)(logits, weights),
                                  gradient(theirs)(logits, weights))

    def scatters(cross_entropy):
        return gradient(cross_entropy).lower(logits, weights).as_text().count('"stablehlo.scatter"')

    # optax's take scatters the label logits' gradient into the logits', and its `.take(0)` adds a second
    assert (scatters(theirs), scatters(cross_entropy_with_integer_labels)) == (2, 0)


def largest_transpose(hlo: str) -> int:
    """Elements of the largest array a compiled program transposes (a `transpose` anywhere, fusions included)."""
    shapes = re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} transpose\(", hlo)
    return max((math.prod(int(d) for d in shape.split(",")) for shape in shapes), default=0)


@pytest.mark.parametrize("features_in, features_out", [(32, 128), (128, 32)])
def test_a_dense_layers_weight_gradient_transposes_its_smaller_operand_and_equals_jaxs(features_in, features_out):
    """x [rows, in] @ w [in, out]: XLA:CPU transposes one side of dw = x^T dy; jax's own gradient hands it dy
    (4x x's size when out = 4 in, as in a GPT's first MLP layer), dense_dot_general the smaller side."""
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 64, features_in))
    w = jax.random.normal(jax.random.PRNGKey(1), (features_in, features_out)) / 8
    dense = (((2,), (0,)), ((), ()))

    def gradients(dot_general):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(dot_general(x, w, dense))), argnums=(0, 1)))

    ours, jaxs = gradients(dense_dot_general), gradients(jax.lax.dot_general)
    np.testing.assert_array_equal(dense_dot_general(x, w, dense), jax.lax.dot_general(x, w, dense))
    # the same products, summed over the 512 rows in another order
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max())),
                 ours(x, w), jaxs(x, w))
    smaller = min(x.size, 8 * 64 * features_out + w.size)
    if jax.default_backend() == "cpu":
        assert largest_transpose(ours.lower(x, w).compile().as_text()) <= smaller
        if x.size < smaller:  # the case the layer exists for
            assert largest_transpose(jaxs.lower(x, w).compile().as_text()) > smaller
    bf16 = [a.astype(jnp.bfloat16) for a in (x, w)]
    assert [g.dtype for g in ours(*bf16)] == [jnp.bfloat16] * 2
    # anything but the dense contraction is lax.dot_general's own
    batched = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(dense_dot_general(x, x.transpose(0, 2, 1), batched),
                                  jax.lax.dot_general(x, x.transpose(0, 2, 1), batched))


@pytest.mark.parametrize("how", ["jvp", "jacfwd", "hessian-vector product", "hessian", "vmap of grad",
                                 "grad of vmap over weights"])
def test_a_dense_layer_differentiates_in_every_mode_as_a_plain_matmul(how):
    """Its own rule is a JVP whose weight tangent transposes by the size rule: forward mode, forward over
    reverse and batching give lax.dot_general's results."""
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 32)) / 4
    dense = (((1,), (0,)), ((), ()))
    run = {"jvp": lambda f: jax.jvp(f, (x, w), (x * 0.3, w * 0.7)),
           "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 1))(x, w),
           "hessian-vector product": lambda f: jax.jvp(jax.grad(f, argnums=(0, 1)), (x, w), (x * 0.1, w * 0.2)),
           "hessian": lambda f: jax.hessian(f, argnums=1)(x, w),
           "vmap of grad": lambda f: jax.vmap(jax.grad(f, argnums=1), in_axes=(0, None))(jnp.stack([x, -x]), w),
           "grad of vmap over weights": lambda f: jax.grad(
               lambda w: jnp.sum(jax.vmap(f, in_axes=(None, 0))(x, jnp.stack([w, 2 * w]))))(w)}[how]

    def loss(dot_general):
        return lambda x, w: jnp.sum(jnp.tanh(dot_general(x, w, dense)) ** 2)

    ours, jaxs = (jax.tree.leaves(run(loss(dot_general))) for dot_general in (dense_dot_general, jax.lax.dot_general))
    for a, b in zip(ours, jaxs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_rematerialised_dense_layer_keeps_its_product_as_a_plain_matmul_would():
    """saving_matmuls (a pipeline's remat: none) saves matmul outputs: jax's dots_saveable, which sees the dense
    layer's forward product as a plain matmul (its custom rule is a JVP, not a VJP, which would hide it in a
    call and have it recomputed in the backward)."""
    x, w1, w2 = jnp.ones((8, 4)), jnp.ones((4, 16)), jnp.ones((16, 4))
    dense = (((1,), (0,)), ((), ()))

    def matmuls_in_gradient(dot_general):
        def two_layers(x, w1, w2):
            return jnp.sum(dot_general(jax.nn.gelu(dot_general(jnp.tanh(x), w1, dense)), w2, dense))
        gradient = jax.grad(saving_matmuls(two_layers), argnums=(0, 1, 2))
        return sum(eqn.primitive.name == "dot_general"
                   for eqn in all_equations(jax.make_jaxpr(gradient)(x, w1, w2).jaxpr))

    assert matmuls_in_gradient(dense_dot_general) == matmuls_in_gradient(jax.lax.dot_general) == 6


def test_dropout_only_with_a_key():
    model = gpt("model.dropout=0.5")
    tokens = jnp.zeros((2, 16), jnp.int32)
    np.testing.assert_array_equal(model(tokens), model(tokens))
    assert not np.allclose(model(tokens, rngs=jax.random.key(0)), model(tokens))


@pytest.mark.parametrize("target, message", [
    ("nonexistent_pkg.mod:Thing", "cannot import 'nonexistent_pkg.mod'"),
    ("xlatrain.config:Nope", "has no 'Nope'"),
    ("xlatrain.config:Config", "is not a flax.nnx.Module subclass"),
])
def test_custom_model_target_errors(target, message):
    config = load_config(None, ["model.name=custom", f"model.target={target}", "data.source=digits"])
    with pytest.raises(UserError, match=message):
        model_factory(config.model, TOKENS)


def test_bring_your_own_model_example_trains(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples/custom_model"))
    config = load_config(REPO / "examples/custom_model/custom_model.yaml",
                         ["trainer.steps=60", "trainer.eval_every=60", "trainer.progress=false",
                          f"trainer.run_dir={tmp_path}"])
    result = train(config, echo=lambda _: None)
    assert result.eval_losses[60] < 1.0


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion", "adafactor"])
def test_every_optimizer_lowers_the_loss(name, tmp_path):
    lr = {"adamw": 1e-2, "sgd": 0.3, "lion": 1e-2, "adafactor": 0.05}[name]
    result = train(load_config(None, [*DIGITS_MLP, f"optimizer.name={name}", f"optimizer.lr={lr}",
                                      "trainer.steps=40", "optimizer.weight_decay=1e-4",
                                      f"trainer.run_dir={tmp_path}"]), echo=lambda _: None)
    first, last = np.mean([result.losses[s] for s in (1, 2, 3)]), np.mean([result.losses[s] for s in (38, 39, 40)])
    assert last < 0.6 * first


def test_adafactor_factors_and_clips_each_layer_of_a_stacked_block_as_its_own_matrix():
    """Against optax's Adafactor pieces on the same layers as separate params: stacked [layers, ...] (where
    optax alone would factor this kernel over its layer axis, 12 being one of its two largest dimensions, and
    clip by the RMS of all layers at once) and in a pipeline's stage layout with padding blocks (which stay zero)."""
    config = load_config(None, ["optimizer.name=adafactor", "optimizer.min_dim_size_to_factor=8",
                                "optimizer.weight_decay=0", "optimizer.schedule=constant"])
    reference = optax.chain(optax.scale_by_factored_rms(decay_rate=0.8, min_dim_size_to_factor=8),
                            optax.clip_by_block_rms(1.0), optax.scale(-1.0))
    layers, layout = 12, StageLayout(stages=2, virtual_stages=1, partition=(7, 5))
    rng = np.random.default_rng(0)

    def draw(scale=1.0):
        kernel = rng.normal(size=(layers, 8, 24)) * np.geomspace(1e-3, 1e3, layers)[:, None, None]
        kernel[3, 0, 0] = 1e4  # a spike: this layer's factored update has an RMS above 1 and is clipped
        return {"blocks": {"kernel": jnp.asarray(kernel * scale, jnp.float32),
                           "bias": jnp.asarray(rng.normal(size=(layers, 24)), jnp.float32)},
                "head": {"kernel": jnp.asarray(rng.normal(size=(20, 16)), jnp.float32)}}

    def unstacked(tree):
        return {**{f"{name}{i}": leaf[i] for name, leaf in tree["blocks"].items() for i in range(layers)},
                "head": tree["head"]["kernel"]}

    params = draw()
    stacked = build_optimizer(config.optimizer, optax.constant_schedule(1.0), block_axes=1)
    staged = build_optimizer(config.optimizer, optax.constant_schedule(1.0), block_axes=3)
    states = (stacked.init(params), staged.init(layout.stage_params(params)), reference.init(unstacked(params)))
    for step in range(3):
        grads = draw(scale=step + 1.0)
        ours, stacked_state = jax.jit(stacked.update)(grads, states[0], params)
        staged_updates, staged_state = jax.jit(staged.update)(layout.stage_params(grads), states[1],
                                                              layout.stage_params(params))
        expected, reference_state = reference.update(unstacked(grads), states[2], unstacked(params))
        states = (stacked_state, staged_state, reference_state)
        for name, value in unstacked(ours).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7, err_msg=f"{name}, step {step}")
        np.testing.assert_allclose(staged_updates["blocks"]["kernel"],
                                   layout.to_stages(ours["blocks"]["kernel"]), rtol=1e-5, atol=1e-7)
    assert stacked_state[0][0].v_row["blocks"]["kernel"].shape == (layers, 8)


def test_schedule_warms_up_to_the_scaled_rate_then_decays(devices):
    config = load_config(None, ["batch.global_size=64", "optimizer.lr=0.01", "optimizer.lr_scaling=linear",
                                "optimizer.base_batch_size=16", "optimizer.warmup_steps=10",
                                "optimizer.schedule=linear", "optimizer.final_lr_fraction=0.1",
                                "trainer.steps=110"])
    derived = derive(config, devices)
    schedule = learning_rate_schedule(config.optimizer, derived, config.trainer.steps)
    assert derived.effective_lr == pytest.approx(0.04)
    assert float(schedule(0)) == 0.0 and float(schedule(5)) == pytest.approx(0.02)
    assert float(schedule(10)) == pytest.approx(0.04) and float(schedule(110)) == pytest.approx(0.004)


@pytest.mark.parametrize("shape, cooling", [
    ("linear", [1.0, 0.775, 0.55, 0.325, 0.1]),
    ("cosine", [1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55,
                0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.1]),
    ("1-sqrt", [1.0, 0.1 + 0.9 * (1 - math.sqrt(0.25)), 0.1 + 0.9 * (1 - math.sqrt(0.5)),
                0.1 + 0.9 * (1 - math.sqrt(0.75)), 0.1]),
])
def test_warmup_stable_decay_holds_the_peak_then_cools_down_to_the_horizon(shape, cooling, devices):
    """Warmup 4 steps, stable to step 12, a cooldown of 8 steps ending at the horizon (20) at the final fraction."""
    config = load_config(None, ["optimizer.lr=1.0", "optimizer.schedule=wsd", "optimizer.warmup_steps=4",
                                "optimizer.cooldown_steps=8", f"optimizer.cooldown_shape={shape}",
                                "optimizer.final_lr_fraction=0.1", "trainer.steps=20"])
    schedule = learning_rate_schedule(config.optimizer, derive(config, devices), 20)
    rates = [float(schedule(step)) for step in (0, 2, 4, 8, 12, 14, 16, 18, 20, 25)]
    np.testing.assert_allclose(rates, [0.0, 0.5, 1.0, 1.0, *cooling, 0.1], rtol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.schedule=wsd", "optimizer.warmup_steps=8", "optimizer.cooldown_steps=5", "trainer.steps=12"],
     "optimizer.schedule=wsd warms up for 8 steps and cools down for 5, more than its horizon of 12 steps"),
    (["optimizer.schedule=wsd", "optimizer.cooldown_shape=exp"], "optimizer.cooldown_shape"),
    (["optimizer.cooldown_steps=5"], "optimizer.cooldown_steps shapes the decay of optimizer.schedule=wsd"),
])
def test_what_a_warmup_stable_decay_cannot_do_is_one_line(overrides, message, capsys, tmp_path):
    assert message in cli_error(capsys, "train", *DIGITS_MLP, *overrides, f"trainer.run_dir={tmp_path}")


def test_weight_decay_skips_biases_and_norm_scales():
    params = {"dense": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)}, "norm": {"scale": jnp.ones(3)}}
    assert decay_mask(params) == {"dense": {"kernel": True, "bias": False}, "norm": {"scale": False}}
    stacked = {"blocks": {"kernel": jnp.ones((4, 3, 3)), "bias": jnp.ones((4, 3))}, "head": {"bias": jnp.ones(3)}}
    assert decay_mask(stacked, block_axes=1) == {"blocks": {"kernel": True, "bias": False}, "head": {"bias": False}}
    config = load_config(None, ["optimizer.weight_decay=0.5", "optimizer.clip_norm=null", "optimizer.name=sgd",
                                "optimizer.momentum=0", "optimizer.schedule=constant", "optimizer.lr=1.0"])
    tx = build_optimizer(config.optimizer, optax.constant_schedule(1.0))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    assert float(updates["dense"]["kernel"][0, 0]) == -0.5 and float(updates["dense"]["bias"][0]) == 0.0


def test_a_cooldown_starts_in_a_new_run_from_a_checkpoint_of_anothers_stable_phase(tmp_path):
    """trainer.init_from copies params, optimizer state, step and data position: a run started from step 4 of
    another with the same schedule goes on bit for bit as it did; one with a shorter horizon cools down from there."""
    wsd = [*DIGITS_MLP, "optimizer.schedule=wsd", "optimizer.lr=0.01", "optimizer.warmup_steps=2",
           "optimizer.cooldown_steps=2", "optimizer.final_lr_fraction=0", "trainer.checkpoint_every=2",
           "trainer.keep_checkpoints=10"]

    def run(name, steps, *overrides):
        return train(load_config(None, [*wsd, f"trainer.steps={steps}", f"trainer.run_dir={tmp_path / name}",
                                        *overrides]), echo=lambda _: None)

    base = run("base", 8)
    same = run("same", 8, f"trainer.init_from={tmp_path / 'base'}@4")
    assert same.start_step == 4 and same.losses == {step: base.losses[step] for step in range(5, 9)}
    run("cooled", 6, f"trainer.init_from={tmp_path / 'base'}@4")
    rates = {record["step"]: record["lr"] for record in map(json.loads, (tmp_path / "cooled" / "metrics.jsonl")
                                                             .read_text().splitlines()) if "lr" in record}
    assert rates == pytest.approx({5: 0.01, 6: 0.005})


@pytest.mark.parametrize("init_from, message", [
    ("{tmp}/nowhere", "names no run directory with checkpoints"),
    ("{tmp}/base@3", "has no checkpoint at step 3; it has [2]"),
    ("{tmp}/base@x", "must be RUN_DIR or RUN_DIR@STEP"),
])
def test_a_start_from_another_run_that_cannot_be_is_one_line(init_from, message, capsys, tmp_path):
    train(load_config(None, [*DIGITS_MLP, "trainer.steps=2", f"trainer.run_dir={tmp_path / 'base'}"]),
          echo=lambda _: None)
    assert message in cli_error(capsys, "train", *DIGITS_MLP, "trainer.steps=4", f"trainer.run_dir={tmp_path / 'new'}",
                                f"trainer.init_from={init_from.format(tmp=tmp_path)}")
    assert not (tmp_path / "new" / "checkpoints").exists() or not any((tmp_path / "new" / "checkpoints").iterdir())


def test_a_run_starts_from_another_runs_state_or_from_weights_not_both(capsys):
    assert "trainer.init_from starts the run from another run's whole state, and model.lora.init_from" in cli_error(
        capsys, "config", "model.name=llama", "model.lora.rank=2", "model.lora.init_from=adapter",
        "trainer.init_from=runs/base")
