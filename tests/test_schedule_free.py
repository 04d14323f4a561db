"""Schedule-free AdamW (optimizer.name=schedule_free_adamw): its steps against hand-computed ones, the trained
point y in checkpoints, and the average x where a run is evaluated, exported and sampled."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_GPT, token_batch
from test_config import cli_error

from xlatrain.commands.trained import from_run
from xlatrain.config import load_config
from xlatrain.mesh import eval_batch_sharding
from xlatrain.optim import build_optimizer, evaluated_params
from xlatrain.program import build_program
from xlatrain.run.checkpoints import Checkpoints
from xlatrain.state import with_shardings
from xlatrain.trainer import train

SCHEDULE_FREE = [*TINY_GPT, "optimizer.name=schedule_free_adamw", "optimizer.schedule=constant", "optimizer.lr=0.01",
                 "batch.global_size=8", "mesh.data=1"]


def test_two_steps_and_the_average_equal_hand_computed_ones():
    """Step 1 moves z by -lr sign(g) and y = x = z; step 2 weights z1 and z2 by their rates squared (c = 1/2) and
    y interpolates x and z by b1."""
    config = load_config(None, ["optimizer.name=schedule_free_adamw", "optimizer.schedule=constant",
                                "optimizer.weight_decay=0"])
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    tx = build_optimizer(config.optimizer, optax.constant_schedule(lr))
    y, grads = jnp.asarray([1.0, -2.0]), [jnp.asarray([0.5, -0.25]), jnp.asarray([-1.0, 0.75])]
    state = tx.init(y)
    for g in grads:
        updates, state = tx.update(g, state, y)
        y = optax.apply_updates(y, updates)
    z1 = np.array([1.0, -2.0]) - lr * np.sign(np.asarray(grads[0]))
    v2 = b2 * (1 - b2) * np.asarray(grads[0]) ** 2 + (1 - b2) * np.asarray(grads[1]) ** 2
    z2 = z1 - lr * np.asarray(grads[1]) / (np.sqrt(v2 / (1 - b2 ** 2)) + eps)
    x2 = 0.5 * z1 + 0.5 * z2
    np.testing.assert_allclose(y, b1 * x2 + (1 - b1) * z2, rtol=1e-6)
    np.testing.assert_allclose(evaluated_params(state, y), x2, rtol=1e-5)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, devices):
    run = tmp_path_factory.mktemp("schedule-free") / "run"
    train(load_config(None, [*SCHEDULE_FREE, "trainer.steps=3", f"trainer.run_dir={run}"]), devices=devices[:1],
          echo=lambda _: None)
    return run


def test_export_and_sample_read_the_average_and_a_resume_the_trained_point(trained_run, devices):
    """from_run (export --hf, sample) gives x; the checkpoint keeps y and z."""
    config = load_config(None, [*SCHEDULE_FREE, "trainer.steps=3", f"trainer.run_dir={trained_run}"])
    program = build_program(config, devices[:1])
    checkpoints = Checkpoints(trained_run / "checkpoints", 3)
    state = checkpoints.restore(3, with_shardings(program.abstract_state, program.specs, program.mesh)).state
    checkpoints.close()
    decoder = from_run(trained_run, 3, "sample")[0]
    average = evaluated_params(state.opt_state, state.params)
    for ours, x, y in zip(*map(jax.tree.leaves, (decoder.params, average, state.params)), strict=True):
        np.testing.assert_array_equal(ours, x)
    assert not all(np.array_equal(x, y) for x, y in zip(*map(jax.tree.leaves, (average, state.params))))


def test_a_schedule_free_run_resumes_exactly(trained_run, tmp_path, devices):
    straight = train(load_config(None, [*SCHEDULE_FREE, "trainer.steps=4", f"trainer.run_dir={tmp_path}"]),
                     devices=devices[:1], echo=lambda _: None)
    resumed = train(load_config(None, [*SCHEDULE_FREE, "trainer.steps=4", f"trainer.run_dir={trained_run}"]),
                    devices=devices[:1], echo=lambda _: None)
    assert resumed.start_step == 3 and resumed.losses[4] == straight.losses[4]


def test_the_evaluation_in_the_loop_reads_the_average(devices):
    """Evaluating (y, z) equals evaluating the point whose average is x itself (y = z = x), not y."""
    program = build_program(load_config(None, SCHEDULE_FREE), devices[:1])
    state, batch = program.create_state(), token_batch(program)
    for _ in range(2):
        state, _ = program.train_step(state, batch)
    rows = [program.dataset.eval[i] for i in range(program.derived.global_batch)]
    held_out = jax.device_put({k: np.stack([r[k] for r in rows]) for k in rows[0]}, eval_batch_sharding(program.mesh))

    def evaluated(params, z):
        return float(program.eval_step(state.replace(params=params, opt_state=state.opt_state._replace(z=z)),
                                       held_out)["eval_loss"])

    average = evaluated_params(state.opt_state, state.params)
    at_average = evaluated(average, average)  # (x - (1 - b1) x) / b1: x to float32 rounding
    assert float(program.eval_step(state, held_out)["eval_loss"]) == pytest.approx(at_average, rel=1e-6)
    assert evaluated(state.params, state.params) != pytest.approx(at_average, rel=1e-4)


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.schedule=cosine"], "optimizer.name=schedule_free_adamw replaces the decay schedule"),
    (["model.lora.rank=2", "model.name=llama", "mesh.data=8"],
     "optimizer.name=schedule_free_adamw is not built for frozen"),
])
def test_what_schedule_free_cannot_do_is_one_line(overrides, message, capsys, tmp_path):
    overrides = [*SCHEDULE_FREE, *overrides] if "cosine" not in overrides[0] else [
        *(o for o in SCHEDULE_FREE if "schedule=" not in o), *overrides]
    assert message in cli_error(capsys, "train", *overrides, f"trainer.run_dir={tmp_path}")
