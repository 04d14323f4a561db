"""PyTorch models through torchax: eager parity, every parallel mode, precision, BatchNorm statistics,
exact resume, weights in and out, and one clear error for each kind of bad input."""

import copy
import importlib.util
import os
import re
import sys
import warnings

import jax
import numpy as np
import pytest
from conftest import COMPILE_FASTER, REPO, run_cli
from test_user_errors import assert_one_line_error

torch = pytest.importorskip("torch", reason="PyTorch (the [torch] extra) is not installed; offline, torch 2.13.0 "
                                            "exists for Python 3.11 only")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax (the [torch] extra) is not installed", allow_module_level=True)

from xlatrain.commands.export import export_torch_state_dict  # noqa: E402
from xlatrain.commands.lower import amp_order_problems  # noqa: E402
from xlatrain.commands.torch_parity import host_batches, optimizer_spec, run_torch_parity  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.errors import UserError  # noqa: E402
from xlatrain.program import build_program  # noqa: E402
from xlatrain.torch_bridge.eager import train as torch_train  # noqa: E402
from xlatrain.trainer import train  # noqa: E402

EXAMPLES = REPO / "examples" / "torch_model"
sys.path[:0] = [str(EXAMPLES)]
PYTHONPATH = os.pathsep.join([str(EXAMPLES), str(REPO / "tests")])

QUIET = ["trainer.progress=false", "trainer.eval_every=1000", "trainer.log_every=1"]
TORCH_GPT = ["model.name=torch", "model.target=tiny_gpt:TinyGPT", "model.kwargs.width=32", "model.kwargs.layers=2",
             "model.kwargs.heads=2", "model.kwargs.max_len=32", "data.seq_len=32", "data.max_bytes=400000",
             "batch.global_size=16", *QUIET]
TORCH_CNN = ["model.name=torch", "model.target=conv_net:ConvNet", "model.kwargs.channels=8",
             "model.kwargs.dropout=0.0", "data.source=digits", "batch.global_size=32", *QUIET]


def config_for(overrides, run_dir=None):
    return load_config(None, [*overrides, *([f"trainer.run_dir={run_dir}"] if run_dir else [])])


def run(overrides, tmp_path, name, devices=None):
    return train(config_for(overrides, tmp_path / name), devices=devices, echo=lambda _: None)


def trajectory(result):
    return np.array([result.losses[s] for s in sorted(result.losses)])


@pytest.mark.parametrize("overrides", [TORCH_GPT, TORCH_CNN], ids=["gpt", "batchnorm-cnn"])
def test_forward_equals_torch_eager_in_train_and_eval_mode(overrides, devices):
    program = build_program(config_for(overrides), devices[:1])
    params, buffers = program.model.init(jax.random.PRNGKey(0))
    inputs = host_batches(program.config, 1)[0]["inputs"][:8]
    eager = copy.deepcopy(program.model.torch.module)
    with torch.no_grad():
        eager.eval()
        expected_eval = eager(torch.from_numpy(inputs)).numpy()
        eager.train()
        expected_train = eager(torch.from_numpy(inputs)).numpy()
    ours_eval = program.model.apply(params, inputs, None, buffers)
    ours_train, new_buffers = program.model.run(params, buffers, inputs, jax.random.PRNGKey(1))
    np.testing.assert_allclose(ours_eval, expected_eval, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours_train, expected_train, rtol=1e-5, atol=1e-5)
    for name, value in eager.named_buffers():  # BatchNorm's running statistics after one training forward
        np.testing.assert_allclose(new_buffers[name], value.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [["optimizer.name=sgd", "optimizer.lr=0.05"],
                                       ["optimizer.name=adamw", "optimizer.weight_decay=0.1",
                                        "optimizer.warmup_steps=5"]], ids=["sgd", "adamw"])
def test_twenty_steps_track_torch_eager(optimizer):
    report = run_torch_parity(config_for([*TORCH_GPT, *optimizer, "batch.microbatches=2"]), "torch", 20, 1e-4)
    assert report.first is None, report.summary()


HF_CAUSAL_LM = ["model.name=torch", "model.target=hf_causal_lm:CausalLM", "model.kwargs.vocab_size=256",
                "model.kwargs.bos_token_id=0", "model.kwargs.eos_token_id=0", "data.seq_len=32",
                "data.max_bytes=400000", "batch.global_size=16", *QUIET]
HF_MODELS = {
    "gpt2": ["model.kwargs.model_type=gpt2", "model.kwargs.n_embd=32", "model.kwargs.n_layer=2",
             "model.kwargs.n_head=2", "model.kwargs.n_positions=32", "model.kwargs.resid_pdrop=0",
             "model.kwargs.embd_pdrop=0", "model.kwargs.attn_pdrop=0"],
    "llama": ["model.kwargs.model_type=llama", "model.kwargs.hidden_size=32", "model.kwargs.intermediate_size=64",
              "model.kwargs.num_hidden_layers=2", "model.kwargs.num_attention_heads=4",
              "model.kwargs.num_key_value_heads=2", "model.kwargs.max_position_embeddings=32"],
}
"""Tiny Hugging Face models made from their configs (examples/torch_model/hf_causal_lm.py; no hub), bytes as tokens,
without dropout (the two sides would draw different masks); llama with grouped-query attention."""


@pytest.mark.parametrize("model_type", sorted(HF_MODELS))
def test_a_hugging_face_model_trains_through_the_bridge_as_in_torch_eager(model_type):
    pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed")
    report = run_torch_parity(config_for([*HF_CAUSAL_LM, *HF_MODELS[model_type]]), "torch", 5, 1e-5)
    assert report.first is None, report.summary()


FROZEN_HEAD_ONLY = ["model.name=torch", "model.target=torch_models:FrozenFirstLayer", "data.source=digits",
                    "batch.global_size=32", "optimizer.name=adamw", "optimizer.weight_decay=0.1",
                    "optimizer.clip_norm=0.5", *QUIET]


def test_frozen_parameters_stay_as_they_are_and_training_tracks_torch_eager(tmp_path, devices):
    """requires_grad=False: no update, no weight decay, and no share of the clipping norm, as torch.optim over the
    trainable parameters (AdamW with decay and clipping, 20 steps); and no moments kept for it."""
    report = run_torch_parity(config_for(FROZEN_HEAD_ONLY), "torch", 20, 1e-5)
    assert report.first is None, report.summary()
    config = config_for([*FROZEN_HEAD_ONLY, "trainer.steps=5"], tmp_path / "run")
    train(config, devices=devices[:1], echo=lambda _: None)
    path, _ = export_torch_state_dict(tmp_path / "run", tmp_path / "run.pt")
    program = build_program(config, devices[:1])
    trained, initial = torch.load(path), program.model.torch.module.state_dict()
    moments = [leaf.size for leaf in jax.tree.leaves(program.abstract_state.opt_state) if leaf.ndim]
    assert sum(moments) == 2 * (16 * 10 + 10)  # Adam's two moments of the head alone
    assert all(torch.equal(trained[name], initial[name]) for name in ("body.weight", "body.bias"))
    assert not torch.equal(trained["head.weight"], initial["head.weight"])


def test_parameters_without_a_gradient_stay_as_they_are_and_training_tracks_torch_eager(tmp_path, devices):
    """Layers run under torch.no_grad(), a head the forward never calls and a scale read through .detach():
    torch.optim skips a parameter whose .grad is None, weight decay included (optax would decay a parameter
    whose gradient is zero, and torchax alone would differentiate through torch.no_grad())."""
    without = [*FROZEN_HEAD_ONLY, "model.target=torch_models:WithoutGradients"]
    report = run_torch_parity(config_for(without), "torch", 10, 1e-5)
    assert report.first is None, report.summary()
    lines = []
    train(config_for([*without, "trainer.steps=3"], tmp_path / "run"), devices=devices[:1], echo=lines.append)
    assert ("params 2,964 (2,266 without a gradient in the forward: unused, detached or under torch.no_grad())"
            in "\n".join(lines))
    path, _ = export_torch_state_dict(tmp_path / "run", tmp_path / "run.pt")
    trained, initial = torch.load(path), build_program(config_for(without), devices[:1]).model.torch.module.state_dict()
    kept = ("features.", "unused_head.", "scale")
    for name in initial:
        assert torch.equal(trained[name], initial[name]) == name.startswith(kept), name


def test_a_forward_setting_requires_grad_to_what_it_is_trains_as_torch_eager(devices):
    """requires_grad set inside the forward to the value the module already has changes nothing, in PyTorch as
    here (setting another value is refused: test_bad_torch_input_is_one_line_and_exit_2)."""
    kept = [*FROZEN_HEAD_ONLY, "model.target=torch_models:KeepsRequiresGradInForward"]
    report = run_torch_parity(config_for(kept), "torch", 5, 1e-5)
    assert report.first is None, report.summary()


def test_in_place_ops_on_views_and_under_no_grad_train_as_torch_eager():
    """Autograd does not record an in-place op under torch.no_grad(): the gradient passes through it unchanged
    (torchax alone would differentiate it), and the ops after it read the changed values; an in-place op on a view
    changes the tensor viewed (torchax alone changes a copy for zero_ and clamp_)."""
    in_place = [*FROZEN_HEAD_ONLY, "model.target=torch_models:ChangesActivationsInPlace"]
    report = run_torch_parity(config_for(in_place), "torch", 5, 1e-5)
    assert report.first is None, report.summary()


FROZEN_FIRST_BLOCK = [*TORCH_GPT, "model.target=torch_models:tiny_gpt_frozen", "optimizer.name=adamw"]


def test_blocks_frozen_in_some_layers_track_torch_eager_and_refuse_weight_decay(devices):
    """The blocks' parameters are stacked, one leaf per name over every block: a gradient stopped in block 0's
    layers alone, and no decay that could spare only some of a leaf's layers."""
    report = run_torch_parity(config_for([*FROZEN_FIRST_BLOCK, "optimizer.weight_decay=0"]), "torch", 10, 1e-4)
    assert report.first is None, report.summary()
    with pytest.raises(UserError, match=r"freezes \(requires_grad=False\) \['blocks'\]\['.*'\] in some of its "
                                        r"blocks and not in others, and optimizer.weight_decay=0.1"):
        build_program(config_for([*FROZEN_FIRST_BLOCK, "optimizer.weight_decay=0.1"]), devices[:1])


def test_a_pipelined_model_with_frozen_embeddings_equals_the_unpipelined_one(tmp_path, devices):
    """The frozen embeddings run on the first stage; blocks frozen in some layers only cannot be pipelined (every
    block runs through one block's module)."""
    common = [*FROZEN_FIRST_BLOCK, "model.kwargs.frozen_blocks=[]", "model.kwargs.layers=4", "trainer.steps=6"]
    one = run([*common, "mesh.data=1"], tmp_path, "one", devices[:1])
    piped = run([*common, "mesh.stage=2"], tmp_path, "piped")
    np.testing.assert_allclose(trajectory(piped), trajectory(one), rtol=2e-5)
    with pytest.raises(UserError, match=r"cannot be pipelined \(mesh.stage=2\): it freezes \(requires_grad=False\) "
                                        "some of its blocks and not others"):
        build_program(config_for([*FROZEN_FIRST_BLOCK, "model.kwargs.layers=4", "mesh.stage=2"]))


@pytest.mark.parametrize("overrides, why", [
    (["model.target=torch_models:tiny_gpt_frozen", "model.kwargs.everything=true"],
     "all of its parameters are frozen (requires_grad=False) or get no gradient from its forward (unused, "
     "detached or under torch.no_grad()); unfreeze some"),
    (["model.target=torch_models:NoParameters"], "it has no parameters; give it some")])
def test_a_model_with_nothing_to_train_is_refused_as_torch_optim_refuses_it(overrides, why, devices):
    with pytest.raises(UserError) as refused:
        build_program(config_for([*TORCH_GPT, *overrides]), devices[:1])
    assert str(refused.value).endswith(f"has nothing to train: {why}")


INT8 = ["model.name=torch", "model.target=torch_models:Int8Scales", "data.source=digits", "batch.global_size=32",
        "optimizer.name=adamw", *QUIET]


def test_an_integer_parameter_is_model_state_that_stays_exact_over_replicas_and_exports(tmp_path, devices):
    """torch cannot train an integer parameter (a quantized weight): it is kept as model state, and the replicas'
    mean of int8 values is taken in int32, so it neither overflows nor changes dtype between steps."""
    report = run_torch_parity(config_for(INT8), "torch", 10, 1e-5)
    assert report.first is None, report.summary()
    one = run([*INT8, "trainer.steps=4", "mesh.data=1"], tmp_path, "one", devices[:1])
    for mode in ("jit", "shard_map"):
        eight = run([*INT8, "trainer.steps=4", f"parallel.mode={mode}"], tmp_path, mode)
        np.testing.assert_allclose(trajectory(eight), trajectory(one), rtol=1e-5, err_msg=mode)
    path, _ = export_torch_state_dict(tmp_path / "shard_map", tmp_path / "eight.pt")
    scale = torch.load(path)["scale"]
    assert scale.dtype == torch.int8 and torch.equal(scale, torch.arange(1, 11, dtype=torch.int8))


def test_int64_in_a_forward_is_int32_without_jaxs_warning(devices):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = build_program(config_for(["model.name=torch", "model.target=torch_models:LongIndices",
                                            "data.source=digits", *QUIET]), devices[:1])
    params, buffers = program.model.init(jax.random.PRNGKey(0))
    images = host_batches(program.config, 1)[0]["inputs"][:4]
    module = program.model.torch.module
    with torch.no_grad():
        expected = module(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(program.model.apply(params, images, None, buffers), expected, rtol=1e-5, atol=1e-6)


def test_batch_norm_statistics_and_weights_equal_torch_after_training(tmp_path, devices):
    # SGD: the conv biases before BatchNorm get gradients that are zero up to rounding, which Adam would amplify.
    overrides = [*TORCH_CNN, "trainer.steps=10", "batch.microbatches=2", "optimizer.name=sgd", "optimizer.lr=0.05"]
    config = config_for(overrides, tmp_path / "cnn")
    train(config, devices=devices[:1], echo=lambda _: None)
    path, step = export_torch_state_dict(tmp_path / "cnn", tmp_path / "cnn.pt")
    ours = torch.load(path)
    program = build_program(config, devices[:1])
    eager = copy.deepcopy(program.model.torch.module)
    torch_train(eager, host_batches(config, 10), 2, "cross_entropy", optimizer_spec(config, 10))
    assert step == 10
    for name, value in eager.state_dict().items():
        if "num_batches_tracked" in name:
            assert int(ours[name]) == int(value) == 20  # two microbatch forwards a step, as in eager PyTorch
        else:
            np.testing.assert_allclose(ours[name].numpy(), value.numpy(), rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("parallel", [
    ["parallel.strategy=fsdp"],
    pytest.param(["parallel.strategy=replicated"], marks=pytest.mark.slow),
    pytest.param(["parallel.mode=shard_map", "parallel.strategy=zero1"], marks=pytest.mark.slow),
    pytest.param(["parallel.mode=pmap"], marks=pytest.mark.slow),
    pytest.param(["parallel.mode=shard_map", "collectives.impl=custom"], marks=pytest.mark.slow),
], ids=["fsdp", "replicated", "zero1-shard_map", "pmap", "custom-collectives"])
def test_eight_devices_equal_one_device(parallel, tmp_path, devices):
    common = [*TORCH_GPT, "trainer.steps=10"]
    one = run([*common, "mesh.data=1"], tmp_path, "one", devices[:1])
    eight = run([*common, *parallel], tmp_path, "eight")
    np.testing.assert_allclose(trajectory(eight), trajectory(one), rtol=2e-4)


def test_fsdp_shards_each_parameter_on_its_largest_divisible_dimension(devices):
    program = build_program(config_for([*TORCH_GPT, "parallel.strategy=fsdp",
                                        "model.shard_dims={'head.*': null}"]), devices)
    specs = program.specs.params
    assert tuple(specs["blocks"]["mlp_in.weight"]) == (None, "data", None)  # [layers, 128, 32]: the larger one
    assert tuple(specs["blocks"]["mlp_in.bias"]) == (None, "data")
    assert tuple(specs["embed.weight"]) == ("data", None)  # [256, 32]
    assert tuple(specs["head.weight"]) == () or all(d is None for d in specs["head.weight"])  # the override


def test_amp_order_holds_in_the_compiled_step_of_a_torch_model(devices):
    program = build_program(config_for([*TORCH_CNN, "precision.policy=fp16"]), devices)
    assert amp_order_problems(program) == []


@pytest.mark.slow
def test_bf16_and_fp16_track_fp32(tmp_path):
    common = [*TORCH_GPT, "trainer.steps=20"]
    fp32 = trajectory(run(common, tmp_path, "fp32"))
    for policy, tolerance in (("bf16", 0.02), ("fp16", 0.01)):
        low = trajectory(run([*common, f"precision.policy={policy}"], tmp_path, policy))
        assert abs(low[-1] - fp32[-1]) / fp32[-1] < tolerance, (policy, low[-1], fp32[-1])


def test_pipelined_torch_model_equals_the_unpipelined_one_and_exports(tmp_path, devices):
    common = [*TORCH_GPT, "model.kwargs.layers=4", "trainer.steps=6"]
    one = run([*common, "mesh.data=1"], tmp_path, "one", devices[:1])
    piped = run([*common, "mesh.stage=4", "parallel.mode=shard_map", "parallel.pipeline.partition=[1,1,1,1]"],
                tmp_path, "piped")
    np.testing.assert_allclose(trajectory(piped), trajectory(one), rtol=2e-4)
    path, _ = export_torch_state_dict(tmp_path / "piped", tmp_path / "piped.pt")
    from tiny_gpt import TinyGPT

    TinyGPT(width=32, layers=4, heads=2, max_len=32).load_state_dict(torch.load(path), strict=True)


def test_resume_with_dropout_and_batch_norm_is_exact(tmp_path):
    common = [*TORCH_CNN, "model.kwargs.dropout=0.2", "optimizer.schedule=constant", "trainer.checkpoint_every=3"]
    straight = run([*common, "trainer.steps=6"], tmp_path, "straight")
    run([*common, "trainer.steps=3"], tmp_path, "resumed")
    second = run([*common, "trainer.steps=6"], tmp_path, "resumed")
    assert second.start_step == 3
    assert [second.losses[s] for s in (4, 5, 6)] == [straight.losses[s] for s in (4, 5, 6)]
    assert second.eval_losses[6] == straight.eval_losses[6]


def test_state_dict_round_trip_is_bitwise(tmp_path, devices):
    from tiny_gpt import TinyGPT

    torch.manual_seed(123)
    source = TinyGPT(width=32, layers=2, heads=2, max_len=32)
    torch.save(source.state_dict(), tmp_path / "pretrained.pt")
    program = build_program(config_for([*TORCH_GPT, f"model.init_from={tmp_path / 'pretrained.pt'}"]), devices[:1])
    state = program.create_state()
    back = program.model.torch.state_dict(*jax.tree.map(np.asarray, (state.params, state.model_state)))
    assert back.keys() == source.state_dict().keys()
    for name, value in source.state_dict().items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name


def test_the_modules_weights_are_arguments_of_the_init_program_not_constants(devices):
    program = build_program(config_for(TORCH_GPT), devices[:1])
    given = program.model.initial_values()
    weight_bytes = sum(v.nbytes for v in jax.tree.leaves(given))
    assert len(jax.jit(program.init).lower(given).as_text()) < weight_bytes / 4
    state = program.create_state()
    np.testing.assert_array_equal(state.params["embed.weight"], given[0]["embed.weight"])


def test_export_writes_a_state_dict_the_module_loads_strictly(tmp_path):
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": PYTHONPATH}
    trained = run_cli("train", *TORCH_CNN, "trainer.steps=2", f"trainer.run_dir={run_dir}", env=env)
    assert trained.returncode == 0, trained.stderr
    exported = run_cli("export", str(run_dir), "--torch", str(tmp_path / "out.pt"), env=env)
    assert exported.returncode == 0, exported.stderr
    assert "step 2" in exported.stdout
    from conv_net import ConvNet

    module = ConvNet(channels=8, dropout=0.0)
    module.load_state_dict(torch.load(tmp_path / "out.pt"), strict=True)
    again = run_cli("export", str(run_dir), "--torch", str(tmp_path / "out.pt"), env=env)
    assert again.returncode == 2 and "exists" in again.stderr


def test_parity_against_torch_holds_the_batchnorm_example_at_its_default_tolerance(capsys):
    """examples/configs/torch_cnn.yaml with dropout off: once, 1.02e-4 at step 12 failed the tolerance of two
    xlatrain runs (1e-4); the tolerance against PyTorch is 2e-3 (docs/models.md)."""
    from xlatrain.cli import main

    assert main(["parity", "examples/configs/torch_cnn.yaml", "--against", "torch", "--a",
                 "model.kwargs.dropout=0", "mesh.data=1"]) == 0
    assert "no divergence over 20 steps (rtol 0.002)" in capsys.readouterr().out


def test_exporting_a_pipelined_run_makes_the_cpu_devices_its_stages_need(tmp_path, devices):
    """In a process of one CPU device (no count in XLA_FLAGS), as `xlatrain train` makes them."""
    run([*TORCH_GPT, "mesh.stage=2", "parallel.pipeline.microbatches=2", "trainer.steps=1"], tmp_path, "piped",
        devices[:2])
    exported = run_cli("export", str(tmp_path / "piped"), "--torch", str(tmp_path / "piped.pt"),
                       env={"PYTHONPATH": PYTHONPATH, "XLA_FLAGS": COMPILE_FASTER})
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "step 1" in exported.stdout and (tmp_path / "piped.pt").is_file()


def test_sampling_and_a_hugging_face_export_refuse_a_torch_run_with_the_reason(tmp_path, devices):
    run([*TORCH_GPT, "trainer.steps=1"], tmp_path, "run", devices[:1])
    for command in (["sample", str(tmp_path / "run"), "--prompt", "x"],
                    ["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]):
        assert_one_line_error(run_cli(*command), "trained a torch module (model.name=torch)", "without a KV cache",
                              "export RUN_DIR --torch OUT.pt")
    assert not (tmp_path / "hf").exists()


def _wrong_state_dict(tmp_path):
    from tiny_gpt import TinyGPT

    path = tmp_path / "other.pt"
    torch.save(TinyGPT(width=16, layers=3, heads=2, max_len=32).state_dict(), path)
    return path


DIGITS = ["model.name=torch", "data.source=digits", *QUIET]
BAD_INPUT = {
    "not a module": ([*DIGITS, "model.target=torch_models:not_a_module"], "returned list, not a torch.nn.Module"),
    "unknown kwarg": ([*TORCH_GPT, "model.kwargs.depth=3"],
                      "model.kwargs.depth is not an argument of 'tiny_gpt:TinyGPT'; it accepts vocab, width, layers"),
    "output shape": ([*DIGITS, "model.target=torch_models:Flat"], "needs logits shaped"),
    "parameter changed in place": ([*DIGITS, "model.target=torch_models:ClampsItsWeight"],
                                   "the forward changes parameter 'fc.weight' in place"),
    "requires_grad changed in the forward": ([*DIGITS, "model.target=torch_models:FreezesItsWeightInForward"],
                                             "the forward sets requires_grad=False on parameter 'fc.weight', which "
                                             "xlatrain reads from the module once"),
    "unlowerable op": ([*DIGITS, "model.target=torch_models:Unlowerable"],
                       "torchax cannot lower an op in module 'pool'"),
    "pipeline with BatchNorm": ([*DIGITS, "model.target=conv_net:ConvNet", "mesh.stage=2", "parallel.mode=shard_map"],
                                "cannot be pipelined (mesh.stage=2): it has no non-empty nn.ModuleList attribute "
                                "'blocks'"),
    "state_dict": ([*TORCH_GPT, "model.init_from=OTHER"],
                   "unexpected keys: blocks.2.ln_attn.weight, blocks.2.ln_attn.bias, blocks.2.qkv.weight"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_torch_input_is_one_line_and_exit_2(case, tmp_path):
    overrides, expected = BAD_INPUT[case]
    overrides = [o.replace("OTHER", str(_wrong_state_dict(tmp_path))) for o in overrides]
    done = run_cli("lower", *overrides, env={"PYTHONPATH": PYTHONPATH})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xlatrain: error: ") and expected in lines[0], done.stderr


@pytest.mark.parametrize("config, overrides, expected", [
    ("examples/configs/torch_gpt.yaml", ["optimizer.name=lion"], "no exact torch.optim equivalent"),
    ("examples/configs/torch_gpt.yaml", ["precision.policy=bf16"], "set precision.policy=fp32"),
    ("examples/configs/digits_mlp.yaml", [], "compares a torch model (model.name=torch), not model.name=mlp"),
], ids=["lion", "bf16", "not-torch"])
def test_parity_refuses_what_torch_cannot_match(config, overrides, expected):
    done = run_cli("parity", config, "--against", "torch", *(["--a", *overrides] if overrides else []),
                   env={"PYTHONPATH": PYTHONPATH})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr


TENSOR_DIMS = ['model.tensor_dims={"blocks.*.qkv.*": column, "blocks.*.attn_out.weight": row, '
               '"blocks.*.mlp_in.*": column, "blocks.*.mlp_out.weight": row, "head.*": column}']


@pytest.mark.parametrize("strategy", ["replicated", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_torch_modules_linears_split_over_tensor_as_model_tensor_dims_says_and_train_as_one_device(strategy,
                                                                                                   devices):
    from conftest import token_batch
    from test_tensor_parallel import assert_leaves_close

    def run(overrides, on):
        program = build_program(load_config(None, [*TORCH_GPT, *overrides]), on)
        state, batch = program.create_state(), token_batch(program)
        grads = jax.device_get(program.gradients(state, batch)[0])
        losses = []
        for _ in range(3):
            state, metrics = program.train_step(state, batch)
            losses.append(float(metrics["loss"]))
        return program, grads, losses

    _, reference, reference_losses = run(["mesh.data=1"], devices[:1])
    program, grads, losses = run(["mesh.tensor=4", f"parallel.strategy={strategy}", *TENSOR_DIMS], devices)
    blocks = program.specs.params["blocks"]
    over_tensor = ("tensor", ("tensor", "data"))  # fsdp splits it over data too
    assert blocks["qkv.weight"][1] in over_tensor and blocks["attn_out.weight"][2] in over_tensor  # [layers, out, in]
    assert "tensor" not in str(blocks["attn_out.bias"])  # after a row-parallel matmul: whole over `tensor`
    assert_leaves_close(grads, reference)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (['model.tensor_dims={"blocks.*.fc9.*": column}', "mesh.tensor=2"],
     "model.tensor_dims['blocks.*.fc9.*'] matches no parameter of 'tiny_gpt:TinyGPT'"),
    ([*TENSOR_DIMS, "mesh.tensor=2", "mesh.stage=2"], "runs a torch module as one whole forward, which has no place"),
    ([*TENSOR_DIMS, "mesh.tensor=2", "collectives.impl=custom"], "(model.tensor_dims splits its linears in "
                                                                 "parallel.mode=jit, where XLA inserts them)"),
    ([*TENSOR_DIMS, "mesh.tensor=8", "model.kwargs.heads=4", "model.kwargs.width=36"],
     "mesh.tensor=8 does not divide blocks.attn_out.weight (tensor_split: 36)"),
    (TENSOR_DIMS, "set mesh.tensor to 2 or more, or drop model.tensor_dims"),
])
def test_what_a_torch_module_cannot_split_over_tensor_is_one_line(overrides, message, devices):
    with pytest.raises(UserError, match=re.escape(message)):
        build_program(load_config(None, [*TORCH_GPT, *overrides]), devices)
