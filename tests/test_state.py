"""Abstract init into shardings, logical-axis rules, and the identical-replicas check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DIGITS_MLP, TINY_GPT, token_batch
from jax.sharding import PartitionSpec as P

from xlatrain.config import load_config
from xlatrain.errors import UserError
from xlatrain.mesh import build_mesh
from xlatrain.program import build_program
from xlatrain.sharding import logical_spec
from xlatrain.state import verify_replicas_identical


def test_logical_rules_shard_the_first_divisible_axis(devices):
    mesh = build_mesh(load_config(None))
    rules = {"vocab": ("data",), "embed": ("data",)}
    assert logical_spec(("vocab", "embed"), (256, 64), rules, mesh) == P("data", None)
    assert logical_spec(("vocab", "embed"), (10, 64), rules, mesh) == P(None, "data")
    assert logical_spec(("vocab", None), (10, 64), rules, mesh) == P(None, None)


def test_a_logical_name_splits_over_each_listed_axis_that_divides_what_is_left(devices):
    mesh = build_mesh(load_config(None, ["mesh.data=2", "mesh.tensor=4"]))
    assert dict(mesh.shape) == {"data": 2, "tensor": 4}
    rules = {"mlp": ("tensor", "data"), "embed": ("data",), "heads": ("data", "tensor")}
    assert logical_spec(("embed", "mlp"), (64, 256), rules, mesh) == P("data", "tensor")
    assert logical_spec(("mlp", "embed"), (256, 64), rules, mesh) == P(("tensor", "data"), None)
    assert logical_spec(("mlp", "embed"), (12, 64), rules, mesh) == P("tensor", "data")  # 12 / 4 = 3: no data
    assert logical_spec(("heads",), (8,), rules, mesh) == P(("data", "tensor"))


@pytest.mark.parametrize("strategy, params_sharded, moments_sharded", [
    ("replicated", False, False), ("zero1", False, True), ("fsdp", True, True)])
def test_strategies_place_params_and_optimizer_state(strategy, params_sharded, moments_sharded, devices):
    program = build_program(load_config(None, [*TINY_GPT, f"parallel.strategy={strategy}"]))
    state = program.create_state()
    kernel = state.params["head"]["kernel"]
    adam = state.opt_state[0]
    assert (kernel.sharding.spec != P(None, None) and kernel.sharding.spec != P()) == params_sharded
    assert (adam.mu["head"]["kernel"].sharding.spec not in (P(), P(None, None))) == moments_sharded
    assert adam.count.sharding.is_fully_replicated and len(adam.count.sharding.device_set) == 8
    assert state.step.sharding.is_fully_replicated


def test_adafactor_factored_moments_follow_their_params_split_and_train_like_replicated(devices):
    """A factored moment shares its param's leading dimensions up to the split one: [layers, rows] of a
    [layers, rows, columns] kernel split along its rows is split likewise; one missing the split dimension is
    replicated. ZeRO-1 and FSDP (parallel.mode=jit) give the replicated run's losses."""
    losses = {}
    for strategy in ("replicated", "zero1", "fsdp"):
        program = build_program(load_config(None, [*TINY_GPT, "optimizer.name=adafactor", "parallel.mode=jit",
                                                   "optimizer.min_dim_size_to_factor=8",
                                                   f"parallel.strategy={strategy}"]))
        moments = program.specs.opt_state[0][0]
        if strategy == "fsdp":
            assert program.specs.params["blocks"]["mlp_in"]["kernel"] == P(None, "data", None)
            assert moments.v_row["blocks"]["mlp_in"]["kernel"] == P(None, "data")
            assert moments.v_col["blocks"]["mlp_in"]["kernel"] == P()
        state, batch = program.create_state(), token_batch(program)
        losses[strategy] = []
        for _ in range(3):
            state, metrics = program.train_step(state, batch)
            losses[strategy].append(float(metrics["loss"]))
    for strategy in ("zero1", "fsdp"):  # fp32; sharded sums add in another order (1.8e-6 apart on an AVX2 host)
        np.testing.assert_allclose(losses[strategy], losses["replicated"], rtol=1e-5)


def test_init_never_builds_the_whole_state_on_one_device(devices):
    program = build_program(load_config(None, [*TINY_GPT, "parallel.strategy=fsdp"]))
    kernel = program.create_state().params["embed"]["embedding"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(256 // 8, 32)}


def test_a_replica_that_differs_is_an_error(devices):
    program = build_program(load_config(None, TINY_GPT))
    state = program.create_state()
    verify_replicas_identical(state, program.specs, program.mesh)
    bias = state.params["head"]["bias"]
    shards = [s.data for s in bias.addressable_shards]
    shards[5] = jax.device_put(shards[5] + 1.0, shards[5].devices().pop())
    tampered = jax.make_array_from_single_device_arrays(bias.shape, bias.sharding, shards)
    state.params["head"]["bias"] = tampered
    with pytest.raises(UserError, match=r"\['head'\]\['bias'\] differs on .*5"):
        verify_replicas_identical(state, program.specs, program.mesh)


def test_same_seed_same_params_other_seed_other_params(devices):
    def first_kernel(seed):
        return np.asarray(build_program(load_config(None, [*TINY_GPT, f"seed={seed}"])).create_state()
                          .params["head"]["kernel"])

    once = first_kernel(1)
    np.testing.assert_array_equal(once, first_kernel(1))
    assert not np.array_equal(once, first_kernel(2))
    assert jnp.all(jnp.isfinite(once))


def test_a_checkpoint_written_before_model_state_existed_restores(tmp_path, devices):
    import dataclasses

    from xlatrain.run.checkpoints import Checkpoints
    from xlatrain.state import with_shardings

    program = build_program(load_config(None, [*DIGITS_MLP, "mesh.data=1"]), devices[:1])
    state = program.create_state()
    old_layout = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "model_state"}
    checkpoints = Checkpoints(tmp_path / "checkpoints", 3)
    checkpoints.save(5, old_layout, {"position": 7})
    restored, data, _ = checkpoints.restore(5, with_shardings(program.abstract_state, program.specs, program.mesh))
    checkpoints.close()
    assert data == {"position": 7} and restored.model_state == {}
    np.testing.assert_array_equal(jax.tree.leaves(restored.params)[0], jax.tree.leaves(state.params)[0])
