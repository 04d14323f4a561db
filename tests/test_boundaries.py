"""Step boundaries: fused steps equal single steps, closures see exactly their step's values, and no
implicit device-to-host transfer happens between boundaries."""

import numpy as np
import optax
import pytest
from conftest import DIGITS_MLP

from xlatrain.config import load_config
from xlatrain.errors import UserError
from xlatrain.run.metrics import read_metrics
from xlatrain.trainer import train

COMMON = [*DIGITS_MLP, "trainer.steps=16", "optimizer.schedule=constant", "trainer.eval_every=6",
          "trainer.checkpoint_every=8", "trainer.log_every=3"]


def run(overrides, run_dir, hooks=()):
    config = load_config(None, [*COMMON, *overrides, f"trainer.run_dir={run_dir}"])
    return train(config, echo=lambda _: None, hooks=hooks)


def test_fused_steps_equal_single_steps_and_keep_every_steps_metrics(tmp_path):
    single = run([], tmp_path / "k1")
    fused = run(["trainer.steps_per_sync=4"], tmp_path / "k4")
    assert fused.losses == single.losses and sorted(fused.losses) == list(range(1, 17))
    assert fused.summary.boundaries == 4 and single.summary.boundaries == 16
    logged = [r["step"] for r in read_metrics(tmp_path / "k4" / "metrics.jsonl") if "loss" in r]
    assert logged == [3, 6, 9, 12, 15, 16]
    # eval runs at the first boundary at or after each multiple of eval_every: 6 -> 8, 12 -> 12, 16
    assert sorted(fused.eval_losses) == [8, 12, 16] and sorted(single.eval_losses) == [6, 12, 16]
    assert fused.compile_log.count("fused_train_step") == 1


def test_fused_run_resumes_exactly(tmp_path):
    straight = run(["trainer.steps_per_sync=4"], tmp_path / "straight")
    first = run(["trainer.steps_per_sync=4", "trainer.steps=8"], tmp_path / "resumed")
    resumed = run(["trainer.steps_per_sync=4"], tmp_path / "resumed")
    assert first.final_step == 8 and resumed.start_step == 8
    assert {**first.losses, **resumed.losses} == straight.losses


@pytest.mark.parametrize("steps_per_sync", [1, 4])
def test_closures_receive_the_values_of_the_step_they_were_registered_for(steps_per_sync, tmp_path):
    seen = []

    def hook(boundary):
        def check(step, loss, params, fused_loss):
            seen.append((boundary.step, int(step), np.asarray(loss), float(optax.tree.norm(params)), fused_loss))

        boundary.add_step_closure(check, boundary.state.step, boundary.metrics["loss"], boundary.state.params,
                                  boundary.metrics["param_norm"])

    result = run([f"trainer.steps_per_sync={steps_per_sync}"], tmp_path / "closures", hooks=[hook])
    assert [s[0] for s in seen] == list(range(steps_per_sync, 17, steps_per_sync))
    for boundary_step, state_step, losses, norm, param_norms in seen:
        assert state_step == boundary_step
        first = boundary_step - steps_per_sync + 1
        assert np.atleast_1d(losses).tolist() == [result.losses[s] for s in range(first, boundary_step + 1)]
        np.testing.assert_allclose(norm, np.atleast_1d(param_norms)[-1], rtol=1e-6)


def test_reading_a_device_value_between_boundaries_is_an_error_that_says_what_to_do(tmp_path):
    def careless(boundary):
        float(boundary.metrics["loss"])  # an implicit device-to-host transfer: a hidden sync

    with pytest.raises(UserError, match=r"careless read a device value .*add_step_closure"):
        run(["trainer.steps=2", "trainer.checkpoint_every=100"], tmp_path / "careless", hooks=[careless])


def test_steps_must_fill_whole_boundaries():
    with pytest.raises(UserError, match=r"trainer.steps=10 must be a multiple of trainer.steps_per_sync=4"):
        load_config(None, ["trainer.steps=10", "trainer.steps_per_sync=4"])
