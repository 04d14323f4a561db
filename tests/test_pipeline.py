"""Pipelines: a pipelined step's loss and gradients equal the unpipelined model's, for GPipe, 1F1B and
interleaved schedules, over data x stage meshes, with accumulation and in bf16, recomputing each chunk's
forward (remat: full) or keeping its residuals (remat: none); training tracks the unpipelined run; with
remat: none the step does the unpipelined model's work (XLA FLOPs); 1F1B holds p microbatches of activations
and residuals where GPipe holds m (XLA memory analysis); plans, slot programs and layouts are checked on their
own; every misconfiguration is a config error."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from conftest import REPO, TINY_GPT, run_cli, token_batch, xla_flags
from jax.sharding import PartitionSpec as P
from xlatrain.lowering.inspect import collectives, peak_memory_bytes
from xlatrain.lowering.pipeline.gradients import run_when
from xlatrain.lowering.step import SplitTrees

from xlatrain.cli import main
from xlatrain.commands.lower import amp_order_problems, pipeline_report
from xlatrain.compat.jaxprs import evaluate, without_exact_roundings
from xlatrain.config import load_config
from xlatrain.data.loader import make_global
from xlatrain.errors import UserError
from xlatrain.mesh import eval_batch_sharding, train_batch_sharding
from xlatrain.models.blocks import BlockParts
from xlatrain.pipeline.layout import StageLayout
from xlatrain.pipeline.partition import ModelCosts, PieceCost, auto_partition
from xlatrain.pipeline.schedule import build, chunk_at
from xlatrain.pipeline.slots import Branch, slot_program
from xlatrain.program import build_program
from xlatrain.sizes import readable_bytes
from xlatrain.trainer import train

PIPELINE = ["parallel.mode=shard_map", "model.width=16", "data.seq_len=16", "batch.global_size=32"]


def program_for(overrides, devices=None):
    return build_program(load_config(None, [*TINY_GPT, *PIPELINE, *overrides]), devices)


def relative_errors(reference, pipelined):
    """Per leaf, the largest difference relative to the largest reference value."""
    return jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                                           / max(float(np.max(np.abs(np.asarray(a)))), 1e-12)), reference, pipelined)


@functools.cache
def reference_gradients(overrides: tuple[str, ...], microbatches: int) -> tuple:
    """The same model unpipelined on one device, accumulating gradients over the same `microbatches`: its
    gradients and sums, computed once for every remat of a case."""
    plain = [o for o in overrides if not o.startswith(("mesh.", "parallel.", "collectives.", "batch.microbatches"))]
    reference = program_for([*plain, "parallel.mode=jit", "mesh.data=1", f"batch.microbatches={microbatches}"],
                            jax.devices()[:1])
    return jax.device_get(reference.gradients(reference.create_state(), token_batch(reference)))


CASES = {
    "p2-1f1b-m=p": ["mesh.stage=2", "parallel.pipeline.microbatches=2"],
    "p2-gpipe-m=2p": ["mesh.stage=2", "parallel.pipeline.schedule=gpipe", "parallel.pipeline.microbatches=4"],
    "p2-1f1b-m3-accumulate-uneven": ["mesh.stage=2", "parallel.pipeline.microbatches=3", "batch.global_size=48",
                                     "batch.microbatches=2", "model.layers=5", "parallel.pipeline.partition=[3,2]"],
    "p4-1f1b-m=p-dp2": ["mesh.stage=4", "model.layers=4", "parallel.pipeline.microbatches=4"],
    "p4-gpipe-m=2p-dp2": ["mesh.stage=4", "model.layers=4", "parallel.pipeline.schedule=gpipe",
                          "parallel.pipeline.microbatches=8"],
    "p4-1f1b-m2-fewer-than-p-dp2": ["mesh.stage=4", "model.layers=4", "parallel.pipeline.microbatches=2"],
    "p2-gpipe-m1": ["mesh.stage=2", "parallel.pipeline.schedule=gpipe", "parallel.pipeline.microbatches=1"],
    "p4-1f1b-m5-dp2-auto-uneven": ["mesh.stage=4", "model.layers=6", "parallel.pipeline.microbatches=5",
                                   "batch.global_size=40"],
    "p4-interleaved-v2-dp2": ["mesh.stage=4", "model.layers=8", "parallel.pipeline.schedule=interleaved",
                              "parallel.pipeline.microbatches=4"],
    "p2-interleaved-v2-custom-collectives": ["mesh.stage=2", "model.layers=4", "parallel.pipeline.schedule=interleaved",
                                             "parallel.pipeline.microbatches=4", "collectives.impl=custom"],
    "p4-1f1b-bf16-dp2": ["mesh.stage=4", "model.layers=4", "precision.policy=bf16"],
    "p2-gpipe-fp16-dp4": ["mesh.stage=2", "parallel.pipeline.schedule=gpipe", "precision.policy=fp16"],
}


FAST_CASE = "p2-1f1b-m=p"
"""Not marked slow, so the jax 0.12 smoke run in CI executes a pipeline too."""


@pytest.mark.parametrize("overrides, remat", [
    pytest.param(o, remat, id=f"{remat}-{name}", marks=() if name == FAST_CASE else pytest.mark.slow)
    for (name, o), remat in zip(CASES.items(), ["full", "none"] * len(CASES))])
def test_pipelined_loss_and_gradients_equal_the_unpipelined_model(overrides, remat, devices):
    """Each case under one remat, the two alternating over the cases."""
    hlo = assert_gradients_equal_the_unpipelined_model(overrides, [f"parallel.pipeline.remat={remat}"])[1]
    if not any(o.startswith("precision.") for o in overrides):  # float32 residuals: no rounding copies them
        assert "reduce-precision(" not in hlo


@pytest.mark.parametrize("dtype, kept", [(jnp.float32, 0), (jnp.bfloat16, 2)])
def test_roundings_of_residuals_to_their_own_precision_are_dropped_where_they_are_identities(dtype, kept):
    """jax's remat rounds each residual that the forward also uses to its dtype's precision, against excess
    precision (a bfloat16 value computed in float32 inside an XLA fusion); a float32 value has none to lose."""
    def forward(w, x):
        h = x @ w
        return jnp.sum(jnp.tanh(h @ w) * h)

    x, w = (jax.random.normal(jax.random.PRNGKey(i), (8, 8), dtype) for i in range(2))

    def value_and_pullback(w, x):
        y, pullback = jax.vjp(jax.checkpoint(forward, policy=jax.checkpoint_policies.dots_saveable), w, x)
        return y, pullback(jnp.ones_like(y))

    traced = jax.make_jaxpr(value_and_pullback)(w, x)
    stripped = without_exact_roundings(traced)

    def roundings(closed):
        return sum(eqn.primitive.name == "reduce_precision" for eqn in closed.jaxpr.eqns)

    assert (roundings(traced), roundings(stripped)) == (2, kept)
    for want, got in zip(jax.tree.leaves(value_and_pullback(w, x)), evaluate(stripped, [w, x]), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


ZERO_BUBBLE_CASES = {
    ("zb1p", "p2-m=p"): ["mesh.stage=2", "parallel.pipeline.microbatches=2"],
    ("zb1p", "p4-m5-dp2-auto-uneven"): CASES["p4-1f1b-m5-dp2-auto-uneven"],
    ("zb1p", "p4-bf16-dp2"): CASES["p4-1f1b-bf16-dp2"],
    ("zb1p", "p2-fp16-scanned-custom-collectives"): ["mesh.stage=2", "model.layers=4", "precision.policy=fp16",
                                                     "model.scan_layers=true", "collectives.impl=custom"],
    # a V needs two chunks per stage: 2p blocks or more
    ("zbv", "p2-m=p"): ["mesh.stage=2", "model.layers=4", "parallel.pipeline.microbatches=2"],
    ("zbv", "p2-m3-accumulate-uneven"): ["mesh.stage=2", "parallel.pipeline.microbatches=3",
                                         "batch.global_size=48", "batch.microbatches=2", "model.layers=5",
                                         "parallel.pipeline.partition=[1,2,1,1]"],
    ("zbv", "p4-m5-dp2-auto-uneven"): ["mesh.stage=4", "model.layers=9", "parallel.pipeline.microbatches=5",
                                       "batch.global_size=40"],
    ("zbv", "p2-fp16-custom-collectives"): ["mesh.stage=2", "model.layers=4", "precision.policy=fp16",
                                            "collectives.impl=custom"],
}


@pytest.mark.parametrize("schedule,overrides", [
    pytest.param(schedule, o, id=f"{schedule}-{name}", marks=() if name == "p2-m=p" else pytest.mark.slow)
    for (schedule, name), o in ZERO_BUBBLE_CASES.items()])
def test_zero_bubble_loss_and_gradients_equal_the_unpipelined_model(schedule, overrides, devices):
    """zb1p and zbv: each backward as B (input gradient) and W (weight gradients) in their own slots; zbv's
    chunks placed in a V, its second arm sending activations back towards stage 0."""
    program, hlo = assert_gradients_equal_the_unpipelined_model(overrides, [f"parallel.pipeline.schedule={schedule}",
                                                                            "parallel.pipeline.remat=none"])
    assert program.pipeline.slots.stash_buffers > 0
    assert all(f"/{scope}/" in hlo for scope in ("weight", "weight_last", "backward", "backward_last"))


@pytest.mark.parametrize("schedule,remat", [
    pytest.param(s, r, id=f"{s}-{r}", marks=() if s == "zbv" else pytest.mark.slow)
    for s, r in (("gpipe", "full"), ("1f1b", "full"), ("interleaved", "none"), ("zb1p", "none"), ("zbv", "none"))])
def test_every_schedule_keeps_the_amp_order(schedule, remat, devices):
    """fp16 through a pipeline: the compiled step unscales the gradients summed over the stages and replicas,
    checks them for overflow, then clips and updates (the order the HLO check in lowering/hlo_graph.py reads)."""
    program = program_for(["mesh.stage=2", "model.layers=4", "precision.policy=fp16",
                           "parallel.pipeline.microbatches=4", f"parallel.pipeline.schedule={schedule}",
                           f"parallel.pipeline.remat={remat}"])
    assert amp_order_problems(program) == []


def test_one_data_replica_keeps_the_amp_order_and_the_check_catches_stages_deciding_alone(devices, monkeypatch):
    """A pipeline over one data replica: each stage updates from its own gradients, whose sum of squares the
    stages add up (SplitTrees.norm) before the finite check and the clip; no gradient goes through a
    collective over the one-device `data` axis. Negative control: stages that take the norm of their own
    gradients only would each decide on their own whether to skip the step and how far to clip."""
    overrides = ["mesh.stage=2", "mesh.data=1", "model.layers=4", "precision.policy=fp16",
                 "parallel.pipeline.microbatches=4"]
    program = program_for(overrides, devices[:2])
    hlo = program.train_step.first.compiled.as_text()
    assert not re.search(r"/sync/(reduce_scatter|all_gather)", hlo)
    assert amp_order_problems(program) == []
    monkeypatch.setattr(SplitTrees, "norm", lambda self, tree: optax.tree.norm(tree))
    problems = amp_order_problems(program_for(overrides, devices[:2]))
    assert problems == ["the finite check depends on the batch without passing a cross-replica reduction"]


@pytest.mark.slow
def test_dropout_masks_are_derived_inside_each_action_alike_for_every_schedule_and_remat(devices):
    """A chunk's dropout keys come from the microbatch's index and the chunk's first layer inside its action: a
    forward's recomputation (1f1b, remat: full) and a B and W (zb1p) draw the forward's masks, so their gradients
    agree; without dropout the step computes no keys at all (they once took a threefry hash every slot)."""
    stages = ["mesh.stage=2", "model.layers=2", "parallel.pipeline.microbatches=2"]
    zb1p = ["parallel.pipeline.schedule=zb1p", "parallel.pipeline.remat=none"]

    def gradients(overrides):
        program = program_for([*stages, *overrides])
        state, batch = program.create_state(), token_batch(program)
        compiled = program.compiled_gradients(state, batch)
        grads = compiled(state, batch)[0]
        return compiled.as_text(), jax.device_get(program.pipeline.layout.layer_params(grads))

    with_dropout, recomputed = gradients(["model.dropout=0.3", "parallel.pipeline.remat=full"])
    split = gradients(["model.dropout=0.3", *zb1p])[1]
    without, no_dropout = gradients(zb1p)
    assert max(jax.tree.leaves(relative_errors(recomputed, split))) < 1e-5
    assert max(jax.tree.leaves(relative_errors(no_dropout, split))) > 1e-2
    assert "threefry" in with_dropout and "threefry" not in without


def assert_gradients_equal_the_unpipelined_model(overrides, pipeline_overrides, low_precision_tolerance=1e-2):
    """The pipelined program, and the HLO of its compiled gradients. In bf16 or fp16, pipelined and unpipelined
    gradients differ by their roundings, within `low_precision_tolerance` of each leaf's largest value."""
    pipelined = program_for([*overrides, *pipeline_overrides])
    state, batch = pipelined.create_state(), token_batch(pipelined)
    compiled = pipelined.compiled_gradients(state, batch)
    grads, sums = compiled(state, batch)
    d = pipelined.derived
    expected_grads, expected_sums = reference_gradients(tuple(overrides),
                                                        d.data_parallel * d.microbatches * d.pipeline_microbatches)
    tolerance = 1e-5 if pipelined.policy.compute == np.float32 else low_precision_tolerance
    np.testing.assert_allclose(sums["loss"], expected_sums["loss"], rtol=tolerance)
    assert float(sums["weight"]) == float(expected_sums["weight"]) == 16 * pipelined.derived.global_batch
    errors = relative_errors(expected_grads, pipelined.pipeline.layout.layer_params(grads))
    assert max(jax.tree.leaves(errors)) < tolerance, errors
    assert all(float(np.max(np.abs(np.asarray(g)))) > 0 for g in jax.tree.leaves(grads))
    return pipelined, compiled.as_text()


def evaluated(program) -> tuple[dict, object]:
    """The eval step's metrics on the first held-out batch, and its compiled program."""
    rows = [program.dataset.eval[i] for i in range(program.derived.global_batch)]
    batch = jax.device_put({k: np.stack([r[k] for r in rows]) for k in ("inputs", "targets")},
                           eval_batch_sharding(program.mesh))
    return jax.device_get(program.eval_step(program.create_state(), batch)), program.eval_step.first.compiled


EVAL_CASES = {name: CASES[name] for name in (FAST_CASE, "p4-interleaved-v2-dp2", "p4-1f1b-m5-dp2-auto-uneven",
                                              "p4-1f1b-bf16-dp2")}
EVAL_CASES["p2-zbv-m3"] = ["mesh.stage=2", "model.layers=4", "parallel.pipeline.schedule=zbv",
                           "parallel.pipeline.remat=none", "parallel.pipeline.microbatches=3", "batch.global_size=48"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == FAST_CASE else pytest.mark.slow)
                                  for n in EVAL_CASES])
def test_pipelined_evaluation_equals_the_unpipelined_model_and_moves_only_activations(name, devices):
    """Each stage runs its own chunks forward: what crosses devices is one microbatch's activation per slot
    (collective-permute) and the loss sums (all-reduce), never a block's params."""
    pipelined = program_for(EVAL_CASES[name])
    metrics, compiled = evaluated(pipelined)
    plain = [o for o in EVAL_CASES[name] if not o.startswith(("mesh.", "parallel.", "batch.microbatches"))]
    expected, _ = evaluated(program_for([*plain, "parallel.mode=jit", "mesh.data=1"], jax.devices()[:1]))
    tolerance = 1e-5 if pipelined.policy.compute == np.float32 else 1e-2
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=tolerance)
    moved = {c["kind"]: c for c in collectives(compiled.as_text())}
    assert set(moved) == {"collective-permute", "all-reduce"}, moved
    permutes = moved["collective-permute"]
    activation = pipelined.pipeline.costs.boundary_bytes
    elements = activation // np.dtype(pipelined.policy.compute).itemsize
    assert permutes["bytes"] / permutes["count"] in (activation, 4 * elements)  # XLA:CPU widens bf16 to f32 to send
    assert moved["all-reduce"]["bytes"] <= 2 * 3 * 4  # three float32 sums, over the stages and the replicas


@pytest.mark.slow
@pytest.mark.parametrize("schedule,remat,stages,strategy", [
    ("1f1b", "full", 4, "replicated"), ("1f1b", "none", 4, "zero1"), ("zb1p", "none", 4, "fsdp"),
    ("zbv", "none", 2, "replicated")])
def test_pipelined_training_tracks_the_unpipelined_run_and_resumes(tmp_path, schedule, remat, stages, strategy,
                                                                   devices):
    common = [*TINY_GPT, *PIPELINE, "model.layers=4", "optimizer.schedule=constant", "trainer.eval_every=30",
              "trainer.checkpoint_every=15", "optimizer.weight_decay=0.1"]
    plain = train(load_config(None, [*common, "mesh.data=1", "parallel.mode=jit", "trainer.steps=30",
                                     f"trainer.run_dir={tmp_path / 'plain'}"]),
                  devices=devices[:1], echo=lambda _: None)
    pipelined = [*common, f"mesh.stage={stages}", "parallel.pipeline.microbatches=4",
                 f"parallel.pipeline.remat={remat}", f"parallel.pipeline.schedule={schedule}",
                 f"parallel.strategy={strategy}", f"trainer.run_dir={tmp_path / 'pipe'}"]
    first = train(load_config(None, [*pipelined, "trainer.steps=15"]), echo=lambda _: None)
    second = train(load_config(None, [*pipelined, "trainer.steps=30"]), echo=lambda _: None)
    assert second.start_step == 15
    losses = {**first.losses, **second.losses}
    trajectory = np.array([losses[s] for s in range(1, 31)])
    expected = np.array([plain.losses[s] for s in range(1, 31)])
    assert expected[-1] < expected[0] - 0.5
    np.testing.assert_allclose(trajectory, expected, rtol=2e-4)
    np.testing.assert_allclose(second.eval_losses[30], plain.eval_losses[30], rtol=2e-4)


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_zero1_and_fsdp_split_each_stages_state_over_data_and_train_like_replicated(strategy, devices):
    """Inside a pipeline (stage 2 x data 4), ZeRO-1 splits the blocks' momentum over `stage` and `data` and the
    rest's over `data`; each replica updates its share and the shares are gathered. FSDP stores the params
    split the same way and gathers them for the train and eval steps. Three steps give the replicated
    pipeline's losses, parameters and eval loss. (SGD with momentum: Adam would blow the rounding noise of
    gradients that are zero in exact arithmetic, such as the attention keys' bias, up to whole updates.)"""
    results = {}
    for name in ("replicated", strategy):
        program = program_for(["mesh.stage=2", f"parallel.strategy={name}", "optimizer.name=sgd",
                               "optimizer.lr=0.1", "optimizer.schedule=constant"])
        state, batch, losses = program.create_state(), token_batch(program), []
        for _ in range(3):
            state, metrics = program.train_step(state, batch)
            losses.append(float(metrics["loss"]))
        results[name] = (losses, jax.device_get(state.params), program.specs, float(evaluated(program)[0]["eval_loss"]))

    def split_over_data(specs):
        return [spec for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)) if "data" in spec]

    losses, params, specs, eval_loss = results[strategy]
    split = split_over_data(specs.opt_state)
    assert any(spec[:2] == (None, "stage") for spec in split) and any("stage" not in spec for spec in split)
    assert bool(split_over_data(specs.params)) == (strategy == "fsdp")
    assert split_over_data(results["replicated"][2]) == []
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, results["replicated"][0], rtol=1e-6)
    assert eval_loss == pytest.approx(results["replicated"][3], rel=1e-6)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(results["replicated"][1])):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy", ["replicated", "zero1", "fsdp"])
def test_adafactor_in_a_pipeline_trains_like_the_unpipelined_model(strategy, devices):
    """Adafactor's factored moments and update clipping are per layer (xlatrain/optim.py's `layerwise`), so each
    stage updates its own layers, padding block included, as the unpipelined model does; the factored moments
    of the blocks are split over the stages. zero1 and fsdp split the blocks over `data` by whole layers (stage 2
    x data 4, 4 blocks per chunk) and leave the rest whole. The attention keys' bias is left out of the
    comparison: its gradient is zero in exact arithmetic, and Adafactor scales that rounding noise up to whole
    updates (it does not change the loss)."""
    common = ["model.layers=7", "optimizer.name=adafactor", "optimizer.min_dim_size_to_factor=8",
              "optimizer.lr=0.01", "optimizer.schedule=constant", "optimizer.weight_decay=0.1"]
    results = {}
    for name, overrides, on in [("plain", ["parallel.mode=jit", "mesh.data=1"], devices[:1]),
                                ("pipelined", ["mesh.stage=2", "parallel.pipeline.partition=[4,3]",
                                               "parallel.pipeline.remat=none", f"parallel.strategy={strategy}"],
                                 devices)]:
        program = program_for([*common, *overrides], on)
        state, batch, losses = program.create_state(), token_batch(program), []
        for _ in range(4):
            state, metrics = program.train_step(state, batch)
            losses.append(float(metrics["loss"]))
        params = jax.device_get(state.params)
        results[name] = losses, program.pipeline.layout.layer_params(params) if program.pipeline else params
    moments, blocks_split = program.specs.opt_state[0][0].v_row, P(None, "stage", "data")
    assert moments["blocks"]["qkv"]["kernel"] == (P(None, "stage") if strategy == "replicated" else blocks_split)
    assert moments["head"]["kernel"] == P() and program.specs.params["head"]["kernel"] == P()
    assert (program.specs.params["blocks"]["qkv"]["kernel"] == blocks_split) == (strategy == "fsdp")
    assert results["plain"][0][-1] < results["plain"][0][0] - 1.0
    np.testing.assert_allclose(results["pipelined"][0], results["plain"][0], rtol=5e-5)
    errors = relative_errors(results["plain"][1], results["pipelined"][1])
    del errors["blocks"]["qkv"]["bias"]
    assert max(jax.tree.leaves(errors)) < 3e-3, errors


@pytest.mark.slow
def test_the_auto_partition_is_saved_at_the_first_start_and_kept_on_resume(tmp_path, monkeypatch, devices):
    common = [*TINY_GPT, *PIPELINE, "mesh.stage=4", "model.layers=6", "parallel.pipeline.microbatches=4",
              "batch.global_size=16", "trainer.checkpoint_every=2", "trainer.eval_every=100",
              f"trainer.run_dir={tmp_path}"]
    train(load_config(None, [*common, "trainer.steps=2"]), echo=lambda _: None)
    saved_path = tmp_path / "config.yaml"
    saved = yaml.safe_load(saved_path.read_text())
    chosen = saved["derived"]["pipeline_partition"]
    assert saved["parallel"]["pipeline"]["partition"] == "auto" and sum(chosen) == 6 and len(chosen) == 4
    # Were the partition chosen again (another version's costs), the checkpoint's blocks would land on other stages.
    other = (1, 1, 2, 2) if chosen != [1, 1, 2, 2] else (2, 2, 1, 1)
    monkeypatch.setattr("xlatrain.pipeline.plan.auto_partition", lambda costs, chunks: other)
    lines = []
    resumed = train(load_config(None, [*common, "trainer.steps=4"]), echo=lines.append)
    assert resumed.start_step == 2 and sorted(resumed.losses) == [3, 4]
    assert any(f"auto (chosen at the run's first start): blocks per chunk {chosen}" in line for line in lines), lines
    assert yaml.safe_load(saved_path.read_text())["derived"]["pipeline_partition"] == chosen
    saved["derived"]["pipeline_partition"] = [3, 3]
    saved_path.write_text(yaml.safe_dump(saved))
    with pytest.raises(UserError, match=r"derived.pipeline_partition=\[3, 3\].* restore the file"):
        train(load_config(None, [*common, "trainer.steps=6"]), echo=lambda _: None)


@pytest.mark.slow
def test_1f1b_holds_p_microbatches_of_activations_and_residuals_where_gpipe_holds_m(devices):
    """XLA's memory analysis of the compiled steps: GPipe holds 12 more microbatches than 1F1B (m=16, p=4), of
    input activations (remat: full), or of input activations and residuals (remat: none). Sequences of 64 make
    a microbatch's activations large beside the step's other temporaries, whose buffer assignment XLA may
    share differently between the two schedules (by a few KiB with blocks unrolled and sequences of 16)."""
    common = ["mesh.stage=4", "model.layers=4", "parallel.pipeline.microbatches=16", "batch.global_size=128",
              "parallel.pipeline.partition=[1,1,1,1]", "data.seq_len=64"]
    reports = {}
    for schedule, remat in itertools.product(("gpipe", "1f1b"), ("full", "none")):
        program = program_for([*common, f"parallel.pipeline.schedule={schedule}", f"parallel.pipeline.remat={remat}"])
        reports[schedule, remat] = pipeline_report(program, program.train_step.first.compiled)
    for remat in ("full", "none"):
        assert reports["1f1b", remat]["activation_buffers"] == 4 and reports["gpipe", remat]["activation_buffers"] == 16
    assert reports["1f1b", "none"]["residual_buffers"] == 4 and reports["gpipe", "none"]["residual_buffers"] == 16
    activations = reports["1f1b", "full"]["activation_bytes_per_microbatch"]
    assert activations == 4 * 64 * 16 * 4  # rows x seq_len x width x float32
    residuals = reports["1f1b", "none"]["residual_bytes_per_microbatch"]
    assert residuals > 10 * activations  # a block's VJP keeps many activation-sized values, and the logits
    for remat, per_microbatch in (("full", activations), ("none", activations + residuals)):
        saved = reports["gpipe", remat]["temp_bytes"] - reports["1f1b", remat]["temp_bytes"]
        assert saved == pytest.approx((16 - 4) * per_microbatch, rel=0.05), remat

    # zb1p holds what 1F1B holds, and B's stash for the W's it defers (stage s defers up to s of them)
    program = program_for([*common, "parallel.pipeline.schedule=zb1p", "parallel.pipeline.remat=none"])
    zb = pipeline_report(program, program.train_step.first.compiled)
    assert (zb["activation_buffers"], zb["residual_buffers"]) == (4, 4), zb
    assert 1 <= zb["stash_buffers"] <= 4, zb
    stash = zb["stash_bytes_per_microbatch"]
    assert activations < stash < residuals
    extra = zb["temp_bytes"] - reports["1f1b", "none"]["temp_bytes"]
    # the stash pool (buffers + a scratch one) and, measured, about as much again (4.08 MB over 1F1B's here
    # against a 2.5 MB pool)
    assert 0 < extra <= 2 * (zb["stash_buffers"] + 1) * stash, (extra, stash, zb["stash_buffers"])


def test_remat_auto_keeps_residuals_only_when_xlas_memory_analysis_of_the_step_fits_the_budget(devices):
    """auto compiles the step keeping residuals, and trains with that very executable when it fits: one
    compilation. Under a budget a byte too small it compiles the recomputing step too, which needs less."""
    auto = ["mesh.stage=2", "parallel.pipeline.microbatches=2", "parallel.pipeline.remat=auto"]
    roomy = program_for(auto)
    assert roomy.remat.remat == "none" and "within a CPU device's share of the host's" in roomy.remat.reason
    assert roomy.train_step is roomy._train_step_for("none") and len(roomy.compile_book.records) == 1
    hlo = roomy.train_step.first.compiled.as_text()  # the slots' scopes, which a profile's trace shows
    assert all(f"/{scope}/" in hlo for scope in ("pipeline_slot", "forward_first", "forward_last", "backward_last"))
    needed = peak_memory_bytes(roomy.train_step.first.compiled)
    tight = program_for([*auto, f"parallel.pipeline.memory_budget_bytes={needed - 1}"])
    assert tight.remat.remat == "full", tight.remat
    assert (f"needs {readable_bytes(needed)} = {needed:,} bytes per device by XLA's memory analysis of the step, "
            f"more than parallel.pipeline.memory_budget_bytes ({readable_bytes(needed - 1)} = {needed - 1:,} bytes)"
            ) in tight.remat.reason
    assert len(tight.compile_book.records) == 1  # the measurement; the train step is not compiled yet
    assert peak_memory_bytes(tight.train_step.first.compiled) < needed and len(tight.compile_book.records) == 2
    report = pipeline_report(tight, tight.train_step.first.compiled)
    assert (report["remat"], report["residual_buffers"], report["remat_reason"]) == ("full", 0, tight.remat.reason)


def test_a_zero_bubble_schedule_keeps_residuals_unless_told_otherwise_and_auto_refuses_a_step_that_does_not_fit(
        devices):
    """zb1p and zbv cannot recompute residuals: left unset, remat is none; auto checks that the step fits and,
    where it does not, says so instead of falling back to recomputing."""
    zero_bubble = ["mesh.stage=2", "parallel.pipeline.microbatches=2", "parallel.pipeline.schedule=zb1p"]
    assert load_config(None, [*TINY_GPT, *PIPELINE, *zero_bubble]).parallel.pipeline.remat == "none"
    assert load_config(None, [*TINY_GPT, *PIPELINE, "mesh.stage=2"]).parallel.pipeline.remat == "full"
    assert program_for(zero_bubble).remat.reason == ("parallel.pipeline.remat, zb1p's default: its B and W run from "
                                                     "the kept residuals")
    roomy = program_for([*zero_bubble, "parallel.pipeline.remat=auto"])
    assert roomy.remat.remat == "none" and "within a CPU device's share of the host's" in roomy.remat.reason
    needed = peak_memory_bytes(roomy.train_step.first.compiled)
    tight = program_for([*zero_bubble, "parallel.pipeline.remat=auto",
                         f"parallel.pipeline.memory_budget_bytes={needed - 1}"])
    with pytest.raises(UserError, match=(
            rf"parallel.pipeline.remat=auto: schedule=zb1p cannot recompute its residuals, and keeping residuals "
            rf"needs .* = {needed:,} bytes per device by XLA's memory analysis of the step, more than "
            rf"parallel.pipeline.memory_budget_bytes \(.* = {needed - 1:,} bytes\): cut the batch into more "
            rf"parallel.pipeline.microbatches")):
        tight.remat


def test_run_when_runs_its_action_only_when_active_and_inside_its_loop():
    """A slot's action is a while loop of zero or one trips; XLA must not hoist its work out of the loop, where
    it would run in every slot whether active or not."""
    w = jnp.full((16, 16), 0.5)

    def step(state, active, x):
        return run_when(active, lambda state, x: state + jnp.tanh(x @ w), state, x)

    zeros, x = jnp.zeros((16, 16)), jnp.ones((16, 16))
    np.testing.assert_array_equal(jax.jit(step)(zeros, False, x), zeros)
    np.testing.assert_allclose(jax.jit(step)(zeros, True, x), np.tanh(8.0) * np.ones((16, 16)), rtol=1e-6)
    hlo = jax.jit(step).lower(zeros, True, x).compile().as_text()
    assert "dot_general" not in hlo[hlo.index("ENTRY"):]  # the matmul stays in the loop's body


@pytest.mark.parametrize("schedule,remat", [("zb1p", "none"), ("1f1b", "full")])
def test_a_pipelined_step_traces_the_models_blocks_once_per_kind_of_chunk(schedule, remat, devices, monkeypatch):
    """Each kind of chunk (first, middle, last) is traced with its VJP once; the slots' actions (here up to nine
    kinds of them) evaluate those traced programs instead of running the model's Python again."""
    program = program_for([*ZERO_BUBBLE_CASES["zb1p", "p2-m=p"], f"parallel.pipeline.schedule={schedule}",
                           f"parallel.pipeline.remat={remat}"])
    state, batch = program.create_state(), token_batch(program)
    traced = []
    run = BlockParts.run
    monkeypatch.setattr(BlockParts, "run", lambda self, *args, **kwargs: traced.append(1) or run(self, *args, **kwargs))
    program.compiled_gradients(state, batch)
    assert len(traced) == 3


@pytest.mark.slow
def test_remat_none_does_the_unpipelined_models_work_and_full_recomputes_the_forward(devices):
    """XLA's FLOPs of every action of the table (lowering/pipeline/work.py) against the gradient of the whole
    model over the same microbatches: equal within 5% with remat: none; a forward more (~4/3) with full.
    The GPT is TINY_GPT's width (32), not PIPELINE's 16: remat none rebuilds the elementwise ops between the
    matmuls in the backward, ~1/3 of a forward's FLOPs at width 16 (the ratio is 1.09 there)."""
    ratios = {}
    for schedule, remat in (("1f1b", "none"), ("1f1b", "full"), ("zb1p", "none")):
        program = program_for(["model.width=32", "data.seq_len=32", "mesh.stage=2", "model.layers=3",
                               "parallel.pipeline.microbatches=2", f"parallel.pipeline.remat={remat}",
                               f"parallel.pipeline.schedule={schedule}"])
        ratios[schedule, remat] = program.pipeline.count_work(remat).ratio
    assert ratios["1f1b", "none"] == pytest.approx(1.0, abs=0.05), ratios
    assert ratios["zb1p", "none"] == pytest.approx(1.0, abs=0.05), ratios  # B and W: one backward's work
    assert 1.2 < ratios["1f1b", "full"] < 1.45, ratios


# --- plans, slot programs, layouts and partitions, without compiling a step -------------------------


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 5, 1), ("1f1b", 2, 2, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3), ("zb1p", 4, 8, 1),
                                        ("zb1p", 4, 5, 1), ("zb1p", 2, 2, 1), ("zbv", 4, 8, 2), ("zbv", 2, 3, 2),
                                        ("zbv", 4, 5, 2)])
def test_slot_program_delivers_every_input_to_its_action(name, p, m, v):
    """Run the slot program symbolically: each buffer holds a tag of what arrived; every action must read
    its own chunk's input activation and incoming gradient; a backward (its W, when split) its forward's
    residuals, and a W the stash of its B. A V's second chunk sends the other way, and its tip keeps the
    hand-off on the last stage."""
    schedule, program = build(name, p, m, v), slot_program(build(name, p, m, v))
    chunks = p * v
    activations = [[None] * (program.activation_buffers + 1) for _ in range(p)]
    cotangents = [[None] * (program.cotangent_buffers + 1) for _ in range(p)]
    residuals = [[None] * (program.residual_buffers + 1) for _ in range(p)]
    stashes = [[None] * (program.stash_buffers + 1) for _ in range(p)]
    branches = {"F": "FORWARD", "B": "BACKWARD", "W": "WEIGHT"}
    for slot, row in enumerate(schedule.table):
        sent_forward, sent_backward = [None] * p, [None] * p
        kept, stashed = [None] * p, [None] * p
        for stage, action in enumerate(row):
            if action is None:
                assert program.branch[slot, stage] == Branch.IDLE
                continue
            c, j = action.chunk, action.microbatch
            part = "_FIRST" if c == 0 else "_LAST" if c == chunks - 1 else ""
            assert program.branch[slot, stage] == Branch[branches[action.kind] + part]
            assert (program.microbatch[slot, stage], program.round[slot, stage]) == (j, c // p)
            assert chunk_at(c // p, stage, p, schedule.placement) == c
            if action.kind in ("B", "W"):
                assert residuals[stage][program.residual_read[slot, stage]] == ("kept", c, j)
            if action.kind == "W":
                assert stashes[stage][program.stash_read[slot, stage]] == ("stash", c, j)
            if action.kind == "F":
                kept[stage] = ("kept", c, j)
            if action.kind == "B" and schedule.splits_backward:
                stashed[stage] = ("stash", c, j)
            if action.kind == "W":
                continue
            if c > 0:
                assert activations[stage][program.activation_read[slot, stage]] == ("x", c, j)
            if action.kind == "B" and c < chunks - 1:
                assert cotangents[stage][program.cotangent_read[slot, stage]] == ("dy", c, j)
            if action.kind == "F" and c < chunks - 1:
                sent_forward[stage] = ("x", c + 1, j)
            if action.kind == "B" and c > 0:
                sent_backward[stage] = ("dy", c - 1, j)
        for stage in range(p):
            if schedule.placement == "v":
                def sent_by(source, sent, round_):
                    ok = 0 <= source < p and program.round[slot, source] == round_
                    return sent[source] if ok and schedule.table[slot][source] is not None else None

                tip = stage == p - 1
                activations[stage][program.activation_write[slot, stage]] = sent_by(stage - 1, sent_forward, 0)
                activations[stage][program.activation_write_reverse[slot, stage]] = sent_by(
                    stage if tip else stage + 1, sent_forward, 0 if tip else 1)
                cotangents[stage][program.cotangent_write[slot, stage]] = sent_by(
                    stage if tip else stage + 1, sent_backward, 1 if tip else 0)
                cotangents[stage][program.cotangent_write_reverse[slot, stage]] = sent_by(stage - 1, sent_backward, 1)
            else:
                source_forward = sent_forward[stage - 1] if stage > 0 or v > 1 else None
                activations[stage][program.activation_write[slot, stage]] = source_forward
                cotangents[stage][program.cotangent_write[slot, stage]] = sent_backward[(stage + 1) % p]
            residuals[stage][program.residual_write[slot, stage]] = kept[stage]
            stashes[stage][program.stash_write[slot, stage]] = stashed[stage]


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (2, 6), (4, 4)])
def test_1f1b_needs_p_activation_buffers_and_gpipe_m(p, m):
    assert slot_program(build("1f1b", p, m)).activation_buffers == p
    assert slot_program(build("gpipe", p, m)).activation_buffers == m


def test_stage_layout_round_trips_and_pads_with_zeros():
    layout = StageLayout(stages=2, virtual_stages=2, partition=(1, 2, 2, 1))
    blocks = np.arange(6 * 3, dtype=np.float32).reshape(6, 3) + 1
    staged = layout.to_stages(blocks)
    assert staged.shape == (2, 2, 2, 3)
    np.testing.assert_array_equal(staged[0, 0, 1], 0)  # chunk 0 holds one block and one padding slot
    np.testing.assert_array_equal(staged[1, 0], blocks[3:5])  # chunk 2 (round 1 on stage 0): blocks 3, 4
    np.testing.assert_array_equal(layout.to_layers(staged), blocks)
    assert "2 padding block slot(s)" in layout.describe()


def test_auto_partition_balances_and_is_optimal():
    block = PieceCost(10.0, 20.0, 100.0, 10.0)
    heavy_head = ModelCosts(PieceCost(1.0, 1.0, 5.0, 1.0), block, PieceCost(25.0, 50.0, 100.0, 20.0), blocks=8,
                            boundary_bytes=16)
    partition = auto_partition(heavy_head, 4)
    assert sum(partition) == 8 and partition[-1] < partition[0]

    def bottleneck(counts):
        chunks = heavy_head.chunks(counts)
        mean_flops = sum(c.flops for c in chunks) / 4
        mean_bytes = sum(c.bytes for c in chunks) / 4
        return max(max(c.flops / mean_flops, c.bytes / mean_bytes) for c in chunks)

    every = [c for c in itertools.product(range(1, 6), repeat=4) if sum(c) == 8]
    assert bottleneck(partition) == pytest.approx(min(bottleneck(c) for c in every))


def test_pipeline_command_prints_the_plan_and_draws_the_chart(tmp_path, capsys, devices):
    out = tmp_path / "chart.png"
    assert main(["pipeline", *TINY_GPT, *PIPELINE, "mesh.stage=4", "model.layers=8",
                 "parallel.pipeline.schedule=interleaved", "parallel.pipeline.microbatches=4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "interleaved: 4 stages, 4 microbatches of 4 rows, 2 chunks per stage" in printed
    assert "partition        auto: blocks per chunk [1, 1, 1, 1, 1, 1, 1, 1]" in printed
    assert "theory (p-1)/(v*m+p-1) = 27.3%" in printed and "max/mean" in printed
    assert "F0.0" in printed and "B3.1" in printed
    assert re.search(r"remat            full: chunks recompute their forward in the backward; XLA FLOPs per step "
                     r"1\.[23]\dx the unpipelined model's", printed)
    from PIL import Image

    with Image.open(out) as image:
        assert image.format == "PNG"


ERRORS = {
    "partition-count": (["mesh.stage=2", "parallel.pipeline.partition=[1,1,2]"], "must give 2 block counts"),
    "partition-sum": (["mesh.stage=2", "parallel.pipeline.partition=[1,2]"], "add up to model.layers=2"),
    "too-few-blocks": (["mesh.stage=4", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.microbatches=4"],
                       "model.layers=2 blocks cannot fill mesh.stage=4 x virtual_stages=2 = 8 pipeline chunks (one "
                       "block or more each); use fewer stages or virtual stages, or more blocks"),
    "too-few-microbatches": (["mesh.stage=2", "parallel.pipeline.schedule=zb1p", "parallel.pipeline.microbatches=1"],
                             "fewer than mesh.stage=2: schedule=zb1p fills the pipeline's bubble"),
    "interleaved-groups": (["mesh.stage=2", "model.layers=4", "parallel.pipeline.schedule=interleaved",
                            "parallel.pipeline.microbatches=3"], "must be a multiple of 2"),
    "virtual-without-interleaving": (["mesh.stage=2", "parallel.pipeline.virtual_stages=2"],
                                     "applies to schedule=interleaved only"),
    "stage-does-not-divide": (["mesh.stage=3", "model.layers=3"],
                              "mesh.stage=3 needs a multiple of 3 devices but 8 cpu device(s)"),
    "mesh-too-small": (["mesh.stage=2", "mesh.data=2"], "mesh.data=2 x mesh.stage=2 needs 4 devices but 8"),
    "jit-mode": (["mesh.stage=2", "parallel.mode=jit"], "use parallel.mode=auto or shard_map"),
    "pipeline-without-stages": (["parallel.pipeline.schedule=gpipe"], "is set but mesh.stage=1"),
    "budget-without-auto": (["mesh.stage=2", "parallel.pipeline.memory_budget_bytes=1000000"],
                            "memory_budget_bytes is read by remat=auto only, and remat=full is fixed"),
    "batch-split": (["mesh.stage=2", "parallel.pipeline.microbatches=3"], "not divisible by batch.microbatches 1 x "
                    "parallel.pipeline.microbatches 3"),
    "zero-bubble-recomputing": (["mesh.stage=2", "parallel.pipeline.schedule=zb1p", "parallel.pipeline.remat=full"],
                                "schedule=zb1p runs each backward as B and W from the forward's residuals, so it "
                                "cannot recompute them: set parallel.pipeline.remat=none or auto, or leave it unset "
                                "(not full)"),
    "zbv-three-chunks": (["mesh.stage=2", "model.layers=6", "parallel.pipeline.schedule=zbv",
                          "parallel.pipeline.remat=none", "parallel.pipeline.virtual_stages=3"],
                         "schedule=zbv places exactly 2 chunks per stage in a V"),
    "zbv-too-few-blocks": (["mesh.stage=2", "parallel.pipeline.schedule=zbv", "parallel.pipeline.remat=none"],
                           "model.layers=2 blocks cannot fill mesh.stage=2 x 2 chunks per stage (schedule=zbv) = 4 "
                           "pipeline chunks (one block or more each); use fewer stages, or more blocks"),
}


@pytest.mark.parametrize("overrides,message", ERRORS.values(), ids=ERRORS.keys())
def test_pipeline_misconfigurations_are_config_errors(overrides, message, capsys, devices):
    assert main(["pipeline", *TINY_GPT, *PIPELINE, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xlatrain: error: config: ") and message in err and "Traceback" not in err


def test_models_that_are_not_block_stacks_are_refused(capsys):
    assert main(["config", "model.name=mlp", "data.source=digits", "mesh.stage=2", "parallel.mode=shard_map"]) == 2
    assert "model.name=mlp cannot be pipelined (mesh.stage=2): it is not a stack of repeated blocks" in \
        capsys.readouterr().err


def test_a_custom_model_that_is_not_a_block_stack_is_refused_in_a_real_process():
    result = run_cli("train", "model.name=custom", "model.target=flax.nnx:Linear", "data.source=digits",
                     "model.kwargs={in_features: 64, out_features: 10}", "mesh.stage=2", "parallel.mode=shard_map",
                     env={"XLA_FLAGS": xla_flags(8)})
    assert result.returncode == 2, result.stderr
    assert "model.target='flax.nnx:Linear' cannot be pipelined (mesh.stage=2)" in result.stderr
    assert "BlockStack" in result.stderr and "Traceback" not in result.stderr


def test_bring_your_own_block_stack_is_pipelined(devices, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples/custom_model"))
    overrides = ["model.name=custom", "model.target=residual_mlp:ResidualMLP", "data.source=digits",
                 "model.kwargs={in_features: 64, width: 16, depth: 4, classes: 10}", "batch.global_size=32",
                 "parallel.mode=shard_map", "mesh.stage=2", "parallel.pipeline.microbatches=2"]
    pipelined = build_program(load_config(None, overrides))
    assert sum(pipelined.pipeline.layout.partition) == 4
    state = pipelined.create_state()
    batch = {k: np.stack([pipelined.dataset.train[i][k] for i in range(32)]) for k in ("inputs", "targets")}
    grads, sums = pipelined.gradients(state, make_global({k: v[None] for k, v in batch.items()},
                                                         train_batch_sharding(pipelined.mesh), 1, 1))
    reference = build_program(load_config(None, [o for o in overrides if not o.startswith(("mesh", "parallel"))]
                                          + ["mesh.data=1", "batch.microbatches=8"]), devices[:1])
    expected, expected_sums = reference.gradients(
        reference.create_state(), make_global({k: v.reshape(8, 4, *v.shape[1:]) for k, v in batch.items()},
                                              train_batch_sharding(reference.mesh), 1, 1))
    np.testing.assert_allclose(sums["loss"], expected_sums["loss"], rtol=1e-5)
    errors = relative_errors(expected, pipelined.pipeline.layout.layer_params(grads))
    assert max(jax.tree.leaves(errors)) < 1e-5, errors


def test_pipeline_example_config_resolves(capsys, devices):
    assert main(["config", "examples/configs/gpt_pipeline.yaml"]) == 0
    derived = yaml.safe_load(capsys.readouterr().out)["derived"]
    assert derived["stages"] == 4 and derived["data_parallel"] == 2
    assert derived["pipeline_microbatches"] == 8 and derived["pipeline_microbatch_size"] == 2
