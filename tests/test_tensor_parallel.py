"""Tensor and sequence parallelism (mesh.tensor, parallel.sequence_parallel) against one device: loss and every
gradient leaf, a run that tracks it, resumes on another mesh.tensor, the collectives XLA inserts, and the configs
that cannot compose refused in one line."""

import re

import jax
import numpy as np
import pytest
from conftest import TINY_GPT, token_batch
from test_config import cli_error

from xlatrain.config import load_config
from xlatrain.mesh import check_tensor_groups_inside_processes
from xlatrain.program import build_program
from xlatrain.trainer import train

TP_GPT = [*TINY_GPT, "model.width=64", "model.heads=8", "batch.global_size=16", "optimizer.schedule=constant"]
LLAMA = ["model.name=llama"]

CASES = {  # (data, stage, tensor) x sequence parallel x strategy, pairwise rather than their full product
    "d1t8": ["mesh.data=1", "mesh.tensor=8"],
    "d2t4-sp": ["mesh.tensor=4", "parallel.sequence_parallel=true"],
    "d4t2-fsdp-mlp-over-both-accumulated": ["mesh.tensor=2", "parallel.strategy=fsdp", "batch.microbatches=2",
                                            "parallel.logical_rules.mlp=[tensor,data]"],
    "llama-d2t4-gqa-kv-kept-whole-sp": [*LLAMA, "model.kv_heads=2", "mesh.tensor=4",
                                        "parallel.sequence_parallel=true"],
    "llama-d4t2-kv-split-tied-fsdp": [*LLAMA, "model.kv_heads=4", "mesh.tensor=2", "model.tie_embeddings=true",
                                      "parallel.strategy=fsdp"],
    "llama-d2t4-qk-norm-projection-fsdp": [*LLAMA, "model.kv_heads=4", "model.qk_norm=projection", "mesh.tensor=4",
                                           "parallel.strategy=fsdp"],
}
SHARD_MAP = ["parallel.mode=shard_map"]
PER_DEVICE_CASES = {  # the tensor group inside a per-device program: its collectives written out
    "shard_map-d4t2-accumulated": [*SHARD_MAP, "mesh.tensor=2", "batch.microbatches=2"],
    "shard_map-d2t4-sp-custom": [*SHARD_MAP, "mesh.tensor=4", "parallel.sequence_parallel=true",
                                 "collectives.impl=custom"],
    "shard_map-llama-d2t4-gqa-kv-kept-whole-sp-zero1": [*LLAMA, "model.kv_heads=2", *SHARD_MAP, "mesh.tensor=4",
                                                        "parallel.sequence_parallel=true", "parallel.strategy=zero1"],
    "1f1b-d2s2t2": ["mesh.stage=2", "mesh.tensor=2"],
    "shard_map-llama-d2t4-mixed-windows-gemma": [*LLAMA, "model.kv_heads=4", *SHARD_MAP, "mesh.tensor=4",
                                                 "parallel.sequence_parallel=true", "model.qk_norm=head",
                                                 "model.norm_plus_one=true", "model.sandwich_norms=true",
                                                 "model.embed_scale=true", "model.mlp_activation=gelu_tanh",
                                                 "model.sliding_window=8", "model.rope_theta_sliding=10000",
                                                 "model.layer_types=[sliding,full]"],
    "1f1b-llama-d2s2t2-qk-norm-head-sp": [*LLAMA, "model.qk_norm=head", "mesh.stage=2", "mesh.tensor=2",
                                          "parallel.sequence_parallel=true"],
    "interleaved-d2s2t2-sp-custom-zero1": ["mesh.stage=2", "mesh.tensor=2", "model.layers=4",
                                           "parallel.pipeline.schedule=interleaved",
                                           "parallel.pipeline.virtual_stages=2", "parallel.sequence_parallel=true",
                                           "collectives.impl=custom", "parallel.strategy=zero1"],
    "llama-gpipe-d2s2t2-remat-full-fsdp-tied": [*LLAMA, "model.kv_heads=2", "model.tie_embeddings=true",
                                                "mesh.stage=2", "mesh.tensor=2", "parallel.pipeline.schedule=gpipe",
                                                "parallel.pipeline.remat=full", "parallel.strategy=fsdp"],
    "llama-zbv-d1s4t2-gqa-kv-kept-whole": [*LLAMA, "model.kv_heads=1", "mesh.data=1", "mesh.stage=4", "mesh.tensor=2",
                                           "model.layers=8", "parallel.pipeline.schedule=zbv",
                                           "parallel.pipeline.microbatches=4"],
}


def gradients_and_losses(overrides, devices, steps=3):
    """The first batch's gradients (in the model's own layout) and loss sum, and the losses of `steps` steps."""
    program = build_program(load_config(None, [*TP_GPT, *overrides]), devices)
    state, batch = program.create_state(), token_batch(program)
    grads, sums = jax.device_get(program.gradients(state, batch))
    if program.pipeline is not None:
        grads = jax.device_get(program.pipeline.layout.layer_params(grads))
    losses = []
    for _ in range(steps):
        state, metrics = program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return program, grads, float(sums["loss"]), losses


def assert_leaves_close(ours, reference, rtol=1e-5):
    """Each leaf within rtol, with an atol of 4e-6 of the leaf's scale (its largest magnitude): float32 sums in
    another order, and their order also follows the CPU's vector width (AVX2 or AVX-512)."""
    for path, expected in jax.tree_util.tree_leaves_with_path(reference):
        got = ours
        for key in path:
            got = got[key.key]
        scale = float(np.max(np.abs(expected))) or 1.0
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=4e-6 * scale, err_msg=jax.tree_util.keystr(path))


QUICK = ("d1t8", "d2t4-sp", "shard_map-d2t4-sp-custom", "1f1b-d2s2t2")


@pytest.mark.parametrize("case", [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow)
                                  for name in {**CASES, **PER_DEVICE_CASES}])
def test_tensor_parallel_loss_and_every_gradient_equal_one_device(case, devices):
    overrides = {**CASES, **PER_DEVICE_CASES}[case]
    model = [o for o in overrides if o.startswith("model.")]
    one, reference, reference_loss, reference_losses = gradients_and_losses([*model, "mesh.data=1"], devices[:1])
    program, grads, loss, losses = gradients_and_losses(overrides, devices)
    (stages, tensor), = re.findall(r"(?:s(\d))?t(\d)", case)
    assert (program.mesh.shape.get("stage", 1), program.mesh.shape["tensor"]) == (int(stages or 1), int(tensor))
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-5)
    assert_leaves_close(grads, reference)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    assert reference_losses[-1] < reference_losses[0]


def test_heads_mlp_and_vocabulary_are_split_megatron_style(devices):
    program = build_program(load_config(None, [*TP_GPT, "mesh.tensor=4"]), devices)
    blocks = program.specs.params["blocks"]
    assert blocks["qkv"]["kernel"] == jax.sharding.PartitionSpec(None, None, None, "tensor")  # [layers, d, 3, heads]
    assert blocks["attn_out"]["kernel"][1] == "tensor" and blocks["mlp_in"]["kernel"][2] == "tensor"
    assert blocks["mlp_out"]["kernel"][1] == "tensor"
    assert program.specs.params["embed"]["embedding"][0] == "tensor"
    assert program.specs.params["head"]["kernel"][1] == "tensor"
    assert all(axis is None for axis in blocks["ln_attn"]["scale"])  # what stays whole: norms, positions, biases out
    adam = program.specs.opt_state[0].mu["blocks"]["qkv"]["kernel"]
    assert adam == blocks["qkv"]["kernel"]  # the replicated strategy's moments follow the params over `tensor`


def test_no_device_holds_the_whole_logits(devices):
    """The vocabulary-parallel cross-entropy: each device's logits are [rows, length, vocab / t]."""
    program = build_program(load_config(None, [*TP_GPT, "mesh.data=1", "mesh.tensor=8"]), devices)
    hlo = program.train_step.first.compiled.as_text()
    vocab, length = program.abstract_state.params["head"]["kernel"].shape[-1], 32
    assert re.search(rf"f32\[\d+,{length},{vocab // 8}\]", hlo)
    assert not re.search(rf"\[\d+,{length},{vocab}\]", hlo)


def test_sequence_parallel_splits_the_activations_between_the_tensor_regions(devices):
    """Per device, XLA's temporaries (the activations and the step's working buffers) fall by the tensor size
    beyond a part that stays whole (bench/tensor_memory.py), more with sequence parallelism than without."""
    def temporaries(tensor, *overrides):
        program = build_program(load_config(None, [*TP_GPT, "mesh.data=1", f"mesh.tensor={tensor}", *overrides]),
                                devices[:tensor])
        return program.train_step.first.compiled.memory_analysis().temp_size_in_bytes

    one, plain = temporaries(1), temporaries(4)
    sequence_parallel = temporaries(4, "parallel.sequence_parallel=true")
    assert sequence_parallel < plain < one


@pytest.mark.slow
@pytest.mark.parametrize("program", [[], ["mesh.stage=2", "parallel.sequence_parallel=true"]],
                         ids=["jit", "pipeline"])
def test_a_run_resumes_on_another_tensor_size_as_if_uninterrupted(program, tmp_path, devices):
    """8 devices: t=2 for 4 steps, then t=4, then t=1 (mesh.data takes what is left; sequence parallelism on
    while t > 1); the losses are the uninterrupted run's."""
    common = [*TP_GPT, *program, "trainer.checkpoint_every=4", f"trainer.run_dir={tmp_path / 'elastic'}"]
    for steps, tensor in ((4, 2), (8, 4), (12, 1)):
        result = train(load_config(None, [*common, f"mesh.tensor={tensor}", f"trainer.steps={steps}",
                                          *(["parallel.sequence_parallel=false"] if tensor == 1 else [])]),
                       echo=lambda _: None)
        assert result.final_step == steps
    from xlatrain.run.metrics import read_metrics

    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "elastic" / "metrics.jsonl") if "loss" in r}
    straight = train(load_config(None, [*TP_GPT, *[o for o in program if "sequence" not in o], "trainer.steps=12",
                                        f"trainer.run_dir={tmp_path / 'straight'}"]), echo=lambda _: None).losses
    np.testing.assert_allclose([resumed[s] for s in range(1, 13)], [straight[s] for s in range(1, 13)], rtol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["model.heads=6", "model.width=48", "mesh.tensor=4"],
     "mesh.tensor=4 splits attention heads over the tensor axis, and model.heads=6 does not divide by 4"),
    ([*LLAMA, "model.heads=12", "model.width=96", "model.kv_heads=6", "mesh.tensor=4", "model.mlp_hidden=128"],
     "mesh.tensor=4 splits key/value heads over the tensor axis, and model.kv_heads=6 does not divide by 4"),
    ([*LLAMA, "model.heads=8", "model.width=64", "model.mlp_hidden=100", "mesh.tensor=8"],
     "model.mlp_hidden=100 does not divide by 8"),
    (["mesh.tensor=2", "parallel.mode=pmap"], "parallel.mode=pmap maps the step over `data` alone"),
    (["mesh.tensor=2", "mesh.stage=2", "optimizer.name=adafactor"],
     "with parallel.mode=shard_map (chosen by parallel.mode=auto for a pipeline"),
    (["mesh.tensor=2", "parallel.mode=shard_map", "optimizer.name=adafactor"], "adafactor's factored moments read"),
    (["mesh.tensor=2", "parallel.mode=shard_map", "parallel.logical_rules.mlp=data"],
     "parallel.logical_rules.mlp leaves `tensor` out, and a per-device program"),
    (["mesh.tensor=2", "parallel.mode=shard_map", "parallel.logical_rules.embed=tensor"],
     "parallel.logical_rules.embed maps to `tensor`, which a per-device program"),
    ([*LLAMA, "model.heads=12", "model.width=96", "model.kv_heads=4", "model.mlp_hidden=192", "mesh.tensor=6",
      "parallel.mode=shard_map"], "that needs mesh.tensor to be a multiple of 4"),
    ([*LLAMA, "model.qk_norm=projection", "mesh.tensor=2", "parallel.mode=shard_map"],
     "model.qk_norm=projection normalises over every head of the projection, which a per-device program"),
    (["parallel.sequence_parallel=true"], "set mesh.tensor to 2 or more"),
    (["parallel.logical_rules.heads=stage"], "mesh axes that do not exist"),
])
def test_what_tensor_parallelism_cannot_split_is_one_line(overrides, message, capsys):
    assert message in cli_error(capsys, "config", *TINY_GPT, *overrides)


def test_a_per_device_program_splits_only_the_built_in_decoders(capsys):
    assert "model.name=mlp does not; use mesh.stage=1" in cli_error(
        capsys, "config", "model.name=mlp", "data.source=digits", "mesh.tensor=2", "parallel.mode=shard_map")


def test_a_torch_module_is_not_split_over_tensor(capsys, tmp_path):
    np.savez(tmp_path / "arrays.npz", inputs=np.zeros((8, 4), np.float32), targets=np.zeros(8, np.int32))
    assert "a torch module's parameters name none" in cli_error(
        capsys, "config", "model.name=torch", "model.target=torch.nn:Linear", "data.source=arrays",
        f"data.path={tmp_path / 'arrays.npz'}", "mesh.tensor=2")


def test_a_vocabulary_the_tensor_size_does_not_divide_names_the_parameter(devices):
    from xlatrain.errors import UserError

    with pytest.raises(UserError, match=r"mesh.tensor=8 does not divide embed.embedding \(vocab: 260\) \(model"
                                        r".vocab_multiple rounds"):
        build_program(load_config(None, [*TP_GPT, "model.vocab=260", "mesh.tensor=8"]), devices)
    with pytest.raises(UserError, match="mesh.tensor=2 splits no parameter of model.name=mlp"):
        build_program(load_config(None, ["model.name=mlp", "data.source=digits", "mesh.tensor=2"]), devices)


def test_a_tensor_group_stays_inside_one_process():
    class Device:
        def __init__(self, process_index):
            self.process_index = process_index

    check_tensor_groups_inside_processes([Device(p) for p in (0, 0, 1, 1)], 2)
    from xlatrain.errors import UserError

    with pytest.raises(UserError, match=r"processes hold \[3\] devices each"):
        check_tensor_groups_inside_processes([Device(p) for p in (0, 0, 0, 1, 1, 1)], 2)


def test_gqa_with_fewer_kv_heads_than_the_tensor_size_is_said_in_xlatrain_config(capsys):
    from xlatrain.cli import main

    assert main(["config", *TINY_GPT, *LLAMA, "model.heads=8", "model.width=64", "model.kv_heads=2",
                 "mesh.tensor=4", "mesh.cpu_devices=8"]) == 0
    shown = capsys.readouterr().out
    assert "tensor_whole:\n  - kv_heads" in shown


def test_a_run_saved_before_the_qkv_kernel_was_split_by_projection_resumes_as_if_uninterrupted(tmp_path, devices):
    """Older versions saved the GPT's qkv kernel as [layers, width, 3 x width] and its bias as [layers, 3 x width]
    (Adam's moments alike), and a config without mesh.tensor whose logical rules name `data` alone: resumed with
    the defaults, the run reshapes them and goes on with the losses of a run never stopped."""
    import yaml

    from xlatrain.run.checkpoints import Checkpoints

    common = [*TINY_GPT, "optimizer.schedule=constant", "trainer.checkpoint_every=2"]
    straight = train(load_config(None, [*common, "trainer.steps=4", f"trainer.run_dir={tmp_path / 'straight'}"]),
                     echo=lambda _: None).losses
    run_dir = tmp_path / "older"
    config = load_config(None, [*common, "trainer.steps=2", f"trainer.run_dir={run_dir}"])
    train(config, echo=lambda _: None)

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["mesh"]["tensor"], saved["parallel"]["sequence_parallel"]
    saved["parallel"]["logical_rules"] = {name: "data" for name in saved["parallel"]["logical_rules"]}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    program = build_program(config)
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=3)
    restored = checkpoints.restore(2, jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), program.abstract_state,
        program.state_shardings))

    def merged(path, leaf):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        return leaf.reshape(*leaf.shape[:-2], -1) if keys[-2:] in (["qkv", "kernel"], ["qkv", "bias"]) else leaf

    older = jax.tree_util.tree_map_with_path(merged, restored.state)
    assert older.params["blocks"]["qkv"]["kernel"].shape == (2, 32, 96)
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "2")
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=3)
    checkpoints.save(2, older, restored.data, restored.trained_on)
    checkpoints.wait_until_written()
    checkpoints.close()

    resumed = train(load_config(None, [*common, "trainer.steps=4", f"trainer.run_dir={run_dir}"]), echo=lambda _: None)
    assert resumed.start_step == 2
    assert [resumed.losses[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]


def test_lower_splits_memory_per_device_and_names_each_collectives_mesh_axes(devices):
    """Parameters and optimizer state per device fall to 1/T beyond what stays whole (norms, positions, the biases
    after the row-parallel matmuls); the gradient sync is the reduction over `data`, the tensor group's are over
    `tensor`, and only the former counts for the AMP order."""
    from xlatrain.lowering.hlo_graph import ONE_DATA_REPLICA

    from xlatrain.commands.lower import lower_report

    def report(data, tensor):
        program = build_program(load_config(None, [*TP_GPT, f"mesh.data={data}", f"mesh.tensor={tensor}"]),
                                devices[:data * tensor])
        return program, lower_report(program, program.train_step.first.compiled)

    one, whole = report(1, 1)
    program, split = report(2, 4)
    kept = sum(leaf.size * 4 for leaf, spec in zip(jax.tree.leaves(program.abstract_state.params),
                                                   jax.tree.leaves(program.specs.params, is_leaf=lambda x: isinstance(
                                                       x, jax.sharding.PartitionSpec)), strict=True)
               if "tensor" not in spec)
    total = whole["memory"]["params_bytes"]
    assert split["memory"]["params_bytes"] == kept + (total - kept) // 4 and kept < 0.05 * total
    assert split["memory"]["optimizer_bytes"] == 2 * split["memory"]["params_bytes"] + 8  # Adam's mu, nu; a count
    kinds = {(c["kind"], c["over"]) for c in split["collectives"]}
    assert ("all-reduce", "data") in kinds and ("all-reduce", "tensor") in kinds
    assert split["amp_order"] == []
    _, tensor_only = report(1, 8)
    assert tensor_only["amp_order"] == [ONE_DATA_REPLICA]  # the forward's tensor all-reduces sync no gradients


@pytest.mark.parametrize("attributes, groups, spanned", [
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", [[0, 4], [1, 5], [2, 6], [3, 7]], ("data",)),
    ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]], ("tensor",)),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]], ("data",)),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}", [[0, 1, 2, 3], [4, 5, 6, 7]], ("tensor",)),
    ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]], ("tensor",)),
    ("replica_groups=[1,8]<=[8]", [list(range(8))], ("data", "tensor")),
])
def test_replica_groups_are_read_in_each_of_xlas_forms(attributes, groups, spanned):
    from xlatrain.lowering.inspect import axes_spanned, replica_groups

    assert replica_groups(attributes + ", use_global_device_ids=true") == groups
    assert axes_spanned(groups, {"data": 2, "tensor": 4}) == spanned


SPLIT_PROGRAMS = pytest.mark.parametrize("splitting", [
    ["mesh.tensor=4", "parallel.sequence_parallel=true"],
    ["mesh.stage=2", "mesh.tensor=2", "parallel.sequence_parallel=true", "collectives.impl=custom"]],
    ids=["jit-d2t4-sp", "pipeline-d2s2t2-sp-custom"])


@pytest.mark.parametrize("split", [[*SHARD_MAP, "mesh.tensor=4", "parallel.sequence_parallel=true"],
                                   pytest.param(["mesh.stage=2", "mesh.tensor=2"], marks=pytest.mark.slow)],
                         ids=["shard_map-d2t4-sp", "pipeline-d2s2t2"])
def test_the_amp_order_holds_with_a_tensor_group_inside_a_per_device_program(split, devices):
    """fp16 with its dynamic loss scale: the gradient sync over `data` (and a pipeline's sums over `stage`) carry
    the order; the tensor group's own reductions do not count for it."""
    from xlatrain.commands.lower import amp_order_problems

    program = build_program(load_config(None, [*TP_GPT, *split, "precision.policy=fp16"]), devices)
    assert program.mesh.shape["tensor"] > 1 and amp_order_problems(program) == []


@pytest.mark.slow
@SPLIT_PROGRAMS
def test_loss_scaling_and_fused_steps_compose_with_tensor_parallelism(splitting, tmp_path, devices):
    """fp16 with its dynamic loss scale, two steps per call: the tensor-parallel run tracks one device's (their
    roundings differ in 16 bits) with the same loss scales."""
    common = [*TP_GPT, "precision.policy=fp16", "trainer.steps=6", "trainer.steps_per_sync=2"]

    def run(name, overrides, on):
        return train(load_config(None, [*common, *overrides, f"trainer.run_dir={tmp_path / name}"]), devices=on,
                     echo=lambda _: None)

    one = run("one", ["mesh.data=1"], devices[:1])
    split = run("split", splitting, devices)
    steps = range(1, 7)
    np.testing.assert_allclose([split.losses[s] for s in steps], [one.losses[s] for s in steps], rtol=1e-2)
    from xlatrain.run.metrics import read_metrics

    def scales(name):
        return [r["loss_scale"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss_scale" in r]

    assert scales("split") == scales("one") and scales("one")


@pytest.mark.slow
@SPLIT_PROGRAMS
def test_a_thirty_step_tensor_and_sequence_parallel_run_tracks_one_device(splitting, tmp_path, devices):
    """data 2 x tensor 4 with sequence parallelism, or a pipeline's data 2 x stage 2 x tensor 2, against one
    device: 30 steps of `xlatrain train` (measured: at most 9.2e-7 apart, relatively, for the first)."""
    def losses(name, overrides, on):
        result = train(load_config(None, [*TP_GPT, "trainer.steps=30", f"trainer.run_dir={tmp_path / name}",
                                          *overrides]), devices=on, echo=lambda _: None)
        return [result.losses[s] for s in range(1, 31)]

    one = losses("one", ["mesh.data=1"], devices[:1])
    split = losses("split", splitting, devices)
    assert one[-1] < one[0] - 2
    np.testing.assert_allclose(split, one, rtol=1e-5)
