"""Precision policies and the AMP order: an overflow anywhere skips the step everywhere, clipping uses the
synchronised norm, bf16/fp16 track fp32, and the order holds in the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DIGITS_MLP, TINY_GPT
from jax.sharding import PartitionSpec as P
from xlatrain.lowering.hlo_graph import amp_order_problems, parse_hlo

from xlatrain.commands import lower
from xlatrain.compat.mapping import shard_map
from xlatrain.config import LossScaleConfig, load_config
from xlatrain.data.loader import make_global
from xlatrain.mesh import train_batch_sharding
from xlatrain.precision import LossScale, next_loss_scale
from xlatrain.program import build_program
from xlatrain.trainer import train

ROWS = 16  # two rows per replica on 8 devices


def program_for(overrides, devices=None):
    config = load_config(None, [*DIGITS_MLP, f"batch.global_size={ROWS}", *overrides])
    return build_program(config, devices)


def digits_batch(program):
    rows = [program.dataset.train[i] for i in range(ROWS)]
    return {k: np.stack([r[k] for r in rows]) for k in ("inputs", "targets")}


def on_devices(program, batch):
    return make_global({k: v[None] for k, v in batch.items()}, train_batch_sharding(program.mesh), 1, 1)


def every_shard(tree):
    """Each device's copy of each leaf, on the host: replicas must agree shard by shard."""
    return [np.asarray(s.data) for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards]


def test_loss_scale_backs_off_grows_and_stays_within_bounds():
    config = LossScaleConfig(initial=8.0, growth_interval=2, min=2.0, max=16.0)
    scale = LossScale(jnp.float32(8.0), jnp.int32(0))
    history = []
    for finite in [True, True, True, True, True, False, False, False]:
        scale = next_loss_scale(scale, jnp.bool_(finite), config)
        history.append(float(scale.scale))
    assert history == [8.0, 16.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0]


@pytest.mark.parametrize("strategy,devices", [("replicated", 8), ("zero1", 8), ("fsdp", 8), ("replicated", 1)],
                         ids=["replicated", "zero1", "fsdp", "single-device"])
def test_overflow_in_one_replica_skips_the_step_on_every_replica(strategy, devices):
    program = program_for(["precision.policy=fp16", f"parallel.strategy={strategy}"], jax.devices()[:devices])
    batch = digits_batch(program)
    batch["inputs"][11] = np.inf  # row 11 belongs to replica 5
    state = program.create_state()
    params, opt_state = every_shard(state.params), every_shard(state.opt_state)
    initial = float(state.loss_scale.scale)

    state, metrics = program.train_step(state, on_devices(program, batch))
    assert not bool(metrics["finite"]) and float(metrics["loss_scale"]) == initial
    assert float(state.loss_scale.scale) == initial / 2 and int(state.step) == 1
    for before, after in zip(params + opt_state, every_shard(state.params) + every_shard(state.opt_state),
                             strict=True):
        np.testing.assert_array_equal(after, before)

    state, metrics = program.train_step(state, on_devices(program, digits_batch(program)))
    assert bool(metrics["finite"]) and float(metrics["loss_scale"]) == initial / 2
    assert not np.array_equal(every_shard(state.params)[0], params[0])


def test_clipping_uses_the_norm_of_the_averaged_gradients_not_a_replicas():
    clip = 1e-3
    program = program_for(["optimizer.name=sgd", "optimizer.momentum=0", "optimizer.lr=1",
                           "optimizer.schedule=constant", f"optimizer.clip_norm={clip}"])
    batch = digits_batch(program)
    state = program.create_state()
    before = jax.device_get(state.params)

    def loss(params, rows):
        logits = program.model.apply(params, jnp.asarray(batch["inputs"][rows]))
        return jnp.mean(optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["targets"][rows]))

    reference = jax.grad(loss)(before, slice(None))
    reference_norm = float(optax.tree.norm(reference))
    replica_norms = [float(optax.tree.norm(jax.grad(loss)(before, slice(2 * r, 2 * r + 2)))) for r in range(8)]

    state, metrics = program.train_step(state, on_devices(program, batch))
    np.testing.assert_allclose(float(metrics["grad_norm"]), reference_norm, rtol=1e-5)
    assert all(abs(n - reference_norm) > 0.01 * reference_norm for n in replica_norms)
    step = jax.tree.map(lambda a, b: a - b, jax.device_get(state.params), before)
    np.testing.assert_allclose(float(optax.tree.norm(step)), clip, rtol=1e-4)
    expected = jax.tree.map(lambda g: -g * clip / reference_norm, reference)
    for got, want in zip(jax.tree.leaves(step), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-7)


def test_communication_dtype_rounds_the_gradient_sum():
    batch = None
    norms = {}
    for dtype in ("float32", "bfloat16"):
        program = program_for([f"collectives.dtype={dtype}"])
        batch = digits_batch(program) if batch is None else batch
        _, metrics = program.train_step(program.create_state(), on_devices(program, batch))
        norms[dtype] = float(metrics["grad_norm"])
    assert norms["bfloat16"] != norms["float32"]
    np.testing.assert_allclose(norms["bfloat16"], norms["float32"], rtol=1e-2)


@pytest.mark.parametrize("overrides", [
    ["precision.policy=fp16"],
    ["precision.policy=bf16", "parallel.strategy=zero1", "batch.microbatches=2"],
    ["parallel.strategy=fsdp", "trainer.on_nonfinite=skip"],
    ["optimizer.clip_norm=null", "collectives.dtype=bfloat16"],
], ids=["fp16", "bf16-zero1-accumulate", "fp32-fsdp-skip", "noclip-bf16comm"])
def test_compiled_step_keeps_the_amp_order(overrides):
    program = program_for(overrides)
    assert lower.amp_order_problems(program) == []


def test_the_order_check_catches_a_step_that_checks_finiteness_before_the_all_reduce():
    """Negative control: each replica decides on its own unsynchronised gradients."""
    program = program_for(["precision.policy=fp16"])
    mesh, model = program.mesh, program.model

    def local_step(params, scale, inputs, targets):
        def scaled_loss(p):
            logits = model.apply(p, inputs[0])
            return scale * jnp.mean(optax.losses.softmax_cross_entropy_with_integer_labels(logits, targets[0]))

        grads = jax.grad(scaled_loss)(params)
        with jax.named_scope("finite_check"):
            # wrong: before the all-reduce
            finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
        grads = jax.tree.map(lambda g: jax.lax.pmean(g, "data") / scale, grads)
        with jax.named_scope("clip"):
            grads, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
        return jax.tree.map(lambda p, g: jnp.where(finite, p - g, p), params, grads)

    def bad_train_step(state, batch):
        params = shard_map(local_step, mesh, in_specs=(P(), P(), P(None, "data"), P(None, "data")),
                           out_specs=P())(
            state.params, state.loss_scale.scale, batch["inputs"], batch["targets"])
        return state.replace(params=params)

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), program.abstract_state)
    compiled = jax.jit(bad_train_step).lower(abstract, program.train_batch_shapes()).compile()
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    params = [i for i, (path, _) in enumerate(leaves) if jax.tree_util.keystr(path).startswith(".params")]
    problems = amp_order_problems(parse_hlo(compiled.as_text()), params, ["inputs", "targets"],
                                  skips_nonfinite=True, clips=True)
    assert "the finite check depends on the batch without passing a cross-replica reduction" in problems, problems
    assert "the parameter update depends on the batch without passing a cross-replica reduction" in problems


@pytest.mark.parametrize("groups, across", [
    ("replica_groups={{0},{1},{2},{3}}", False), ("replica_groups={{0,1},{2,3}}", True), ("replica_groups={}", True),
    ("replica_groups=[4,1]<=[4]", False), ("replica_groups=[2,2]<=[2,2]T(1,0)", True), ("", True)])
def test_a_collective_over_one_device_groups_is_no_reduction(groups, across):
    """XLA:CPU keeps a psum over a one-device mesh axis as a collective of single-device groups (XLA:GPU drops
    it): it must not count as the reduction the AMP order asks for, nor its asynchronous -done."""
    hlo = f"""ENTRY %main (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  %s = f32[8]{{0}} all-reduce-start(%p), channel_id=1, {groups}, to_apply=%add
  ROOT %d = f32[8]{{0}} all-reduce-done(%s)
}}
"""
    graph = parse_hlo(hlo)
    assert graph.reductions() == ({"s", "d"} if across else set())


@pytest.mark.parametrize("asynchronous", [False, True])
def test_each_element_of_a_combined_reduction_depends_on_its_own_operand_alone(asynchronous):
    """XLA combines a tensor group's sum in the forward with the gradient norm's into one all-reduce of a tuple:
    the norm read from it must not depend on the forward's operand."""
    combined = ("%s = (f32[], f32[8]) all-reduce-start(%norm, %forward), to_apply=%add\n"
                "  %r = (f32[], f32[8]) all-reduce-done(%s)" if asynchronous else
                "%r = (f32[], f32[8]) all-reduce(%norm, %forward), to_apply=%add")
    hlo = f"""ENTRY %main (g: f32[], x: f32[8]) -> (f32[], f32[8]) {{
  %g = f32[] parameter(0)
  %x = f32[8]{{0}} parameter(1)
  %norm = f32[] multiply(%g, %g)
  %forward = f32[8]{{0}} negate(%x)
  {combined}
  %n = f32[] get-tuple-element(%r), index=0
  %f = f32[8]{{0}} get-tuple-element(%r), index=1
  ROOT %out = (f32[], f32[8]) tuple(%n, %f)
}}
"""
    graph = parse_hlo(hlo)
    assert "n" not in graph.reachable(["x"]) and "f" in graph.reachable(["x"])
    assert "n" in graph.reachable(["g"]) and "n" not in graph.reachable(["g"], blocked=graph.reductions())


def test_loss_scale_is_checkpointed_and_resumes_exactly(tmp_path):
    common = [*DIGITS_MLP, "precision.policy=fp16", "precision.loss_scale.initial=1024",
              "precision.loss_scale.growth_interval=2", "optimizer.schedule=constant", "trainer.checkpoint_every=3"]

    def run(steps, name):
        config = load_config(None, [*common, f"trainer.steps={steps}", f"trainer.run_dir={tmp_path / name}"])
        return train(config, echo=lambda _: None)

    straight = run(8, "straight")
    run(3, "resumed")
    resumed = run(8, "resumed")
    assert resumed.start_step == 3
    assert [resumed.losses[s] for s in range(4, 9)] == [straight.losses[s] for s in range(4, 9)]
    from xlatrain.run.metrics import read_metrics
    scales = [r["loss_scale"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "loss" in r]
    assert scales == [1024, 1024, 2048, 2048, 4096, 4096, 8192, 8192]


MIXED_TOLERANCE = {"bf16": 0.01, "fp16": 0.005}
"""Largest relative loss difference to the fp32 run allowed at any of 60 steps (stated in docs/training-step.md)."""


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_mixed_precision_gpt_tracks_fp32(policy, tmp_path):
    common = [*TINY_GPT, "trainer.steps=60", "optimizer.schedule=constant", "trainer.checkpoint_every=1000"]

    def losses(extra, name):
        config = load_config(None, [*common, *extra, f"trainer.run_dir={tmp_path / name}"])
        result = train(config, echo=lambda _: None)
        return np.array([result.losses[s] for s in range(1, 61)])

    reference = losses([], "fp32")
    mixed = losses([f"precision.policy={policy}"], policy)
    assert reference[-1] < reference[0] - 1.0
    relative = np.abs(mixed - reference) / reference
    print(f"{policy}: max relative loss difference to fp32 over 60 steps {relative.max():.4f}")
    assert relative.max() < MIXED_TOLERANCE[policy], f"max relative difference {relative.max():.4f}"
