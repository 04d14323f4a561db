"""Explicit-SPMD data parallel: parallel.mode=shard_map with balanced fusion buffers over XLA's or
xlatrain's custom collectives equals the default jit mode, keeps the AMP order, and shows in the HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DIGITS_MLP, run_cli, xla_flags
from test_precision import digits_batch, every_shard, on_devices, program_for
from xlatrain.lowering.grad_sync import bucket_bounds, bucketed_sum

from xlatrain.commands.lower import amp_order_problems
from xlatrain.config import load_config
from xlatrain.errors import UserError
from xlatrain.trainer import train

CUSTOM = ["parallel.mode=shard_map", "collectives.impl=custom", "collectives.bucket_bytes=8192"]
MODES = {"jit": [], "shard_map-xla": ["parallel.mode=shard_map", "collectives.bucket_bytes=8192"],
         "shard_map-xla-zero1": ["parallel.mode=shard_map", "parallel.strategy=zero1"],
         "shard_map-custom": CUSTOM, "shard_map-custom-zero1": [*CUSTOM, "parallel.strategy=zero1"],
         "pmap": ["parallel.mode=pmap"], "pmap-custom": ["parallel.mode=pmap", "collectives.impl=custom"]}


def test_buckets_cover_the_buffer_within_the_byte_limit():
    bounds = bucket_bounds(total=10_000, itemsize=4, bucket_bytes=4096, participants=8)
    assert bounds[0] == (0, 1024) and bounds[-1] == (9216, 10_000) and len(bounds) == 10
    assert all(b == a for (_, b), (a, _) in zip(bounds, bounds[1:], strict=False))
    assert bucket_bounds(total=5, itemsize=4, bucket_bytes=1, participants=8) == [(0, 5)]


def test_bucketed_sum_returns_every_leaf_in_place():
    grads = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.arange(5.0), "c": jnp.ones((7,), jnp.float32)}
    seen = []

    def sum_bucket(bucket):  # stands in for reduce-scatter + all-gather over 8 replicas holding the same values
        seen.append(bucket.shape[0])
        return bucket * 8

    out = bucketed_sum(grads, bucket_bytes=16, dtype=jnp.bfloat16, participants=8, sum_bucket=sum_bucket)
    for key in grads:
        np.testing.assert_array_equal(out[key], grads[key] * 8)
        assert out[key].dtype == jnp.float32
    assert seen == [8, 8, 8] and sum(seen) >= 18  # 18 elements in buckets of 8, the last padded


@pytest.mark.slow
def test_every_mode_follows_the_same_loss_trajectory_over_50_steps(tmp_path):
    losses = {}
    for name, overrides in MODES.items():
        config = load_config(None, [*DIGITS_MLP, "trainer.steps=50", f"trainer.run_dir={tmp_path / name}",
                                    "collectives.dtype=bfloat16", "precision.policy=fp16", *overrides])
        result = train(config, echo=lambda _: None)
        losses[name] = np.array([result.losses[s] for s in range(1, 51)])
    assert losses["jit"][-1] < losses["jit"][0] - 0.3
    for name in MODES:
        np.testing.assert_allclose(losses[name], losses["jit"], rtol=2e-3, err_msg=name)


@pytest.mark.parametrize("mode", ["shard_map-xla", "shard_map-custom", "shard_map-custom-zero1", "pmap-custom"])
def test_explicit_modes_keep_the_amp_order_and_skip_an_overflow_everywhere(mode):
    program = program_for(["precision.policy=fp16", *MODES[mode]])
    assert amp_order_problems(program) == []
    batch = digits_batch(program)
    batch["inputs"][11] = np.inf  # one replica's rows
    state = program.create_state()
    before = every_shard(state.params)
    state, metrics = program.train_step(state, on_devices(program, batch))
    assert not bool(metrics["finite"]) and float(state.loss_scale.scale) == float(metrics["loss_scale"]) / 2
    for a, b in zip(before, every_shard(state.params), strict=True):
        np.testing.assert_array_equal(a, b)
    reference = program_for(["precision.policy=fp16"])
    ref_state, ref_metrics = reference.train_step(reference.create_state(), on_devices(reference,
                                                                                        digits_batch(reference)))
    state, metrics = program.train_step(program.create_state(), on_devices(program, digits_batch(program)))
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(ref_metrics["grad_norm"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref_state.params)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lower_shows_the_custom_calls_and_no_xla_all_reduce():
    result = run_cli("lower", *DIGITS_MLP, *CUSTOM, env={"XLA_FLAGS": xla_flags(8)})
    assert result.returncode == 0, result.stderr
    assert "xlatrain reduce_scatter" in result.stdout and "xlatrain all_gather" in result.stdout
    assert "  all-reduce" not in result.stdout and "  reduce-scatter" not in result.stdout
    assert "AMP order          holds" in result.stdout


@pytest.mark.parametrize("overrides,message", [
    (["parallel.mode=jit", "collectives.impl=custom"], "collectives.impl=custom syncs gradients in a per-device "
                                                        "program"),
    (["parallel.mode=shard_map", "parallel.strategy=fsdp"], "parallel.mode=shard_map supports parallel.strategy "
                                                             "replicated or zero1, not 'fsdp'"),
    (["parallel.mode=pmap", "parallel.strategy=zero1"], "parallel.mode=pmap supports"),
    (["parallel.mode=shard_map", "parallel.strategy=zero1", "optimizer.name=adafactor"], "elementwise optimizer"),
])
def test_mode_and_collectives_are_validated(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)
