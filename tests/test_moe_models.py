"""Mixture-of-Experts decoders (model.moe): Mixtral, Qwen3-MoE, OLMoE and Qwen2-MoE checkpoints give transformers'
logits and export back with transformers' own keys; the auxiliary loss and its gradients equal transformers' Mixtral
with output_router_logits; data-parallel replicas (one program and per device, with gradient accumulation) equal one
device, balancing bias included; shared experts and the capacity equal hand-written references; FLOPs count the
active parameters; bad MoE configs and checkpoints are one line."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_GPT, run_cli, token_batch
from flax import nnx
from hf_models import VOCAB, hugging_face_model, logits_of, made_once, saved
from test_user_errors import assert_one_line_error

from xlatrain.cli import main
from xlatrain.commands.trained import from_hugging_face, from_run
from xlatrain.config import load_config
from xlatrain.config.hugging_face import hugging_face_config
from xlatrain.errors import UserError
from xlatrain.models.experts import MoEMLP, MoEShape
from xlatrain.models.moe import Routing, kept_choices, route, routed_experts
from xlatrain.program import build_program
from xlatrain.trainer import train

MOE = [*TINY_GPT, "model.name=llama", "model.kv_heads=1", "model.moe.experts=4", "model.moe.expert_hidden=32",
       "optimizer.schedule=constant", "batch.global_size=8"]
FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return made_once(tmp_path_factory)


def logits(trained, tokens):
    graphdef, params = trained.module()
    return np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tokens, jnp.int32)).outputs)


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_moe_family_loads_with_transformers_logits(kind, checkpoints):
    reference, directory = checkpoints(kind)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    theirs = logits_of(reference, tokens)
    ours = logits(from_hugging_face(directory, "test"), tokens)[..., :VOCAB]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6 * np.abs(theirs).max())
    if kind == "olmoe":  # clip_qkv bites on these weights
        unclipped = hugging_face_model(kind, clip_qkv=None)
        assert np.max(np.abs(logits_of(unclipped, tokens) - theirs)) > 1e-3


INTERLEAVED = {"qwen3_moe-lead0-between1-trail1": ("qwen3_moe", dict(num_hidden_layers=5, mlp_only_layers=[0],
                                                                     decoder_sparse_step=2)),
               "qwen2_moe-lead1": ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[0]))}
"""Dense layers among the expert layers (Qwen's mlp_only_layers and decoder_sparse_step): layers 1 and 3 of 5 with
experts (groups of a dense layer and an expert one, a dense layer after them); layers 1 and 2 of 3."""


@pytest.mark.parametrize("name", INTERLEAVED)
def test_dense_layers_among_expert_layers_load_and_sample_as_transformers(name, tmp_path):
    from test_hugging_face import generated_by_transformers

    from xlatrain.models.sampling import Sampling, generate

    kind, layers = INTERLEAVED[name]
    reference = hugging_face_model(kind, **layers)
    trained = from_hugging_face(saved(reference, tmp_path), "test")
    moe = trained.model.moe
    assert (moe.dense_layers_first, moe.interleave) == (1, layers.get("decoder_sparse_step", 1))
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    theirs = logits_of(reference, tokens)
    np.testing.assert_allclose(logits(trained, tokens)[..., :VOCAB], theirs, rtol=1e-5,
                               atol=1e-6 * np.abs(theirs).max())
    prompt = np.random.default_rng(1).integers(0, VOCAB, (2, 7))
    expected, margin = generated_by_transformers(reference, prompt, 12)
    assert margin > 1e-4
    graphdef, params = trained.module()
    made = generate(graphdef, params, jnp.asarray(prompt, jnp.int32), jax.random.PRNGKey(0),
                    Sampling(12, temperature=0.0, vocab_used=VOCAB))[0]
    np.testing.assert_array_equal(np.asarray(made), expected)


def mixtral_program(directory, *overrides, devices):
    data = [o for o in TINY_GPT if not o.startswith("model.")]
    return build_program(load_config(None, [*data, f"model.init_from=hf:{directory}", "batch.global_size=4",
                                            "model.moe.aux_loss_weight=0.25", "model.moe.z_loss_weight=0.0",
                                            *overrides]), devices)


def test_the_auxiliary_loss_and_its_gradients_equal_transformers_mixtral_with_router_logits(checkpoints, devices):
    import torch

    reference, directory = checkpoints("mixtral")
    program = mixtral_program(directory, devices=devices[:1])
    state = program.create_state()
    batch = token_batch(program)
    grads, sums = jax.device_get(program.gradients(state, batch))
    inputs = torch.tensor(np.asarray(batch["inputs"][0]), dtype=torch.long)
    targets = torch.tensor(np.asarray(batch["targets"][0]), dtype=torch.long)
    reference.config.router_aux_loss_coef = 0.25
    reference.zero_grad()
    out = reference(inputs, output_router_logits=True)
    cross_entropy = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    (cross_entropy + 0.25 * out.aux_loss).backward()
    np.testing.assert_allclose(sums["router_aux_loss"] / sums["weight"], out.aux_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(sums["loss"] / sums["weight"], cross_entropy.item(), rtol=1e-5)
    for layer in range(2):
        theirs = reference.model.layers[layer].mlp.gate.weight.grad.numpy().T
        ours = grads["blocks"]["moe"]["router"]["kernel"][layer]
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6 * np.abs(theirs).max())


def step_results(overrides, devices, steps=2):
    program = build_program(load_config(None, [*MOE, *overrides]), devices)
    state = program.create_state()
    batch = token_batch(program)
    grads, sums = jax.device_get(program.gradients(state, batch))
    losses = []
    for _ in range(steps):
        state, metrics = program.train_step(state, batch)
        losses.append({k: float(metrics[k]) for k in ("loss", "router_aux_loss", "router_z_loss", "router_cv")})
    return grads, losses, jax.device_get(state.model_state)


def assert_same_steps(ours, reference):
    """(gradients, steps' metrics) within rtol 1e-5 (gradients: atol 1e-6 x each leaf's largest) of the reference's."""
    (grads, losses), (ref_grads, ref_losses) = ours, reference
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    for got, expected in zip(losses, ref_losses, strict=True):
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-5)


def batch_in_order(program, order):
    """The first global batch's rows in `order`, split into the program's microbatches and placed."""
    from xlatrain.data.loader import make_global, split_microbatches
    from xlatrain.mesh import train_batch_sharding

    rows = [program.dataset.train[i] for i in order]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    return make_global(split_microbatches(batch, program.derived.microbatches), train_batch_sharding(program.mesh),
                       1, 1)


def gradient_results(overrides, devices, order=range(8)):
    """A step's gradients (in the model's layout) and its sums of the loss, the router's losses and its loads."""
    program = build_program(load_config(None, [*MOE, "model.moe.aux_loss_weight=0.1", "model.moe.z_loss_weight=0.01",
                                               *overrides]), devices)
    grads, sums = jax.device_get(program.gradients(program.create_state(), batch_in_order(program, order)))
    if program.pipeline is not None:
        grads = jax.device_get(program.pipeline.layout.layer_params(grads))
    return grads, [{k: sums[k] for k in ("loss", "router_aux_loss", "router_z_loss", "router_load")}]


PER_DEVICE = ["mesh.data=2", "parallel.mode=shard_map", "collectives.impl=custom"]


@pytest.mark.parametrize("layout", [["mesh.data=4"], PER_DEVICE], ids=["jit-d4", "shard_map-custom-d2"])
def test_data_parallel_replicas_with_accumulation_equal_one_device(layout, devices):
    """Each microbatch's auxiliary loss is over the global microbatch (the loads summed over the replicas), and the
    balancing bias moves by the whole step's load: 4 or 2 replicas of 2 microbatches train as one device of 2."""
    common = ["batch.microbatches=2", "model.moe.bias_rate=0.01", "model.moe.z_loss_weight=0.01",
              "model.moe.aux_loss_weight=0.1"]
    ref_grads, ref_losses, ref_state = step_results([*common, "mesh.data=1"], devices[:1])
    count = 4 if "mesh.data=4" in layout else 2
    grads, losses, state = step_results([*common, *layout], devices[:count])
    assert_same_steps((grads, losses), (ref_grads, ref_losses))
    np.testing.assert_array_equal(state["blocks"]["moe"]["bias"], ref_state["blocks"]["moe"]["bias"])
    assert np.any(state["blocks"]["moe"]["bias"] != 0)


def test_the_balancing_bias_moves_each_step_by_its_rate_against_the_experts_load(devices):
    program = build_program(load_config(None, [*MOE, "model.moe.bias_rate=0.01", "model.moe.aux_loss_weight=0"]),
                            devices[:1])
    state = program.create_state()
    batch = token_batch(program)
    first = jax.tree.map(lambda x: x[0], batch)
    reported = program.model.run(state.params, state.model_state, first["inputs"], None, None)[0]
    load = np.asarray(reported.reports.load)  # [layers, experts]
    new = jax.device_get(program.train_step(state, batch)[0].model_state)["blocks"]["moe"]["bias"]
    expected = 0.01 * np.sign(load.mean(axis=-1, keepdims=True) - load)
    np.testing.assert_allclose(new, expected, rtol=1e-6)
    # and the bias moves the choice, not the weights: a biased expert is chosen by score + bias
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    chosen = route(logits, 2, "sigmoid", bias_E=jnp.asarray([0.0, 0.0, 0.0, 5.0]))
    by_expert = dict(zip(np.asarray(chosen.experts)[0].tolist(), np.asarray(chosen.weights)[0].tolist()))
    scores = jax.nn.sigmoid(jnp.asarray([2.0, -1.0]))
    assert sorted(by_expert) == [0, 3]
    np.testing.assert_allclose([by_expert[0], by_expert[3]], scores / jnp.sum(scores), rtol=1e-6)


@pytest.mark.parametrize("gated", [False, True], ids=["deepseek", "qwen2_moe"])
def test_shared_experts_equal_a_hand_written_reference(gated):
    shape = MoEShape(experts=4, top_k=2, hidden=16, shared_hidden=24, shared_gate=gated, formulation="sorted")
    layer = MoEMLP(8, shape, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    got, _ = layer(x)
    tokens = x.reshape(-1, 8)
    routing = route(tokens @ layer.router.kernel[...], 2)
    routed = routed_experts(tokens, routing, layer.gate[...], layer.up[...], layer.down[...])
    s = layer.shared
    shared = (jax.nn.silu(tokens @ s.gate.kernel[...]) * (tokens @ s.up.kernel[...])) @ s.down.kernel[...]
    if gated:
        shared = jax.nn.sigmoid(tokens @ layer.shared_gate.kernel[...]) * shared
    np.testing.assert_allclose(np.asarray(got).reshape(-1, 8), routed + shared, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("formulation", ["sorted", "dense", "padded", "blocked"])
def test_a_capacity_drops_the_choices_past_it_first_choices_before_second(formulation):
    x = jax.random.normal(jax.random.key(2), (12, 8))
    gate, up = (jax.random.normal(k, (4, 8, 16)) / 3 for k in jax.random.split(jax.random.key(3)))
    down = jax.random.normal(jax.random.key(4), (4, 16, 8)) / 4
    routing = route(jax.random.normal(jax.random.key(5), (12, 4)) * 3, 2)
    capacity = 4
    got = routed_experts(x, routing, gate, up, down, formulation, capacity)
    expected = np.zeros((12, 8), np.float32)
    taken = np.zeros(4, int)
    experts, weights = np.asarray(routing.experts), np.asarray(routing.weights)
    for choice in range(2):  # every token's first choice before any second
        for token in range(12):
            e = experts[token, choice]
            if taken[e] < capacity:
                taken[e] += 1
                hidden = jax.nn.silu(x[token] @ gate[e]) * (x[token] @ up[e])
                expected[token] += weights[token, choice] * np.asarray(hidden @ down[e])
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)
    assert int(np.sum(~np.asarray(kept_choices(routing.experts, 4, capacity)))) == 24 - int(taken.sum()) > 0
    dropless = Routing(routing.experts, routing.weights, routing.probabilities)
    assert np.max(np.abs(np.asarray(routed_experts(x, dropless, gate, up, down, formulation)) - expected)) > 1e-3


def test_moe_flops_count_the_active_parameters(devices):
    """A token runs through top_k experts: the MoE model's FLOPs are a dense model's whose MLP is top_k experts
    wide, plus the router's three products (forward, and its two gradients) per layer."""
    moe = build_program(load_config(None, [*MOE, "model.moe.top_k=2"]), devices[:1])
    dense = build_program(load_config(None, [*MOE[:-4], "model.mlp_hidden=64", "optimizer.schedule=constant",
                                             "batch.global_size=8"]), devices[:1])
    tokens = 8 * 32
    router = 3 * 2 * tokens * 32 * 4 * 2  # products x 2 x tokens x width x experts x layers
    assert moe.measured.model_flops_per_step == dense.measured.model_flops_per_step + router


@pytest.mark.parametrize("family, model", [
    ("MixtralForCausalLM", []),
    ("Qwen2MoeForCausalLM", ["model.qkv_bias=true", "model.moe.shared_hidden=48", "model.moe.shared_gate=true",
                             "model.moe.normalise=false"]),
    ("OlmoeForCausalLM", ["model.qk_norm=projection", "model.clip_qkv=2.0", "model.kv_heads=2"]),
    ("Qwen3MoeForCausalLM", ["model.qk_norm=head", "model.kv_heads=2", "model.layers=3",
                             "model.moe.dense_layers_first=1"])],
    ids=["mixtral", "qwen2_moe", "olmoe", "qwen3_moe-dense-first"])
def test_an_exported_moe_run_has_transformers_own_keys_and_logits(family, model, tmp_path, devices):
    import transformers

    run_dir = tmp_path / "run"
    train(load_config(None, [*MOE, *model, "trainer.steps=2", f"trainer.run_dir={run_dir}"]), devices=devices[:1],
          echo=lambda _: None)
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--hf", str(out)]) == 0
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not found for found in info.values()) and type(loaded).__name__ == family, info
    again = tmp_path / "again"
    loaded.save_pretrained(again)
    from safetensors import safe_open

    def keys(directory):
        with safe_open(str(directory / "model.safetensors"), "np") as f:
            return set(f.keys())

    assert keys(out) == keys(again)
    if "model.moe.dense_layers_first=1" in model:
        assert loaded.config.mlp_only_layers == [0]
        logged = next(line for line in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                      if "loss" in line)
        assert {"router_cv_layer1", "router_cv_layer2"} <= set(logged) and "router_cv_layer0" not in logged
    tokens = np.random.default_rng(0).integers(0, 256, (2, 32))
    trained = from_run(run_dir, None, "test")[0]
    np.testing.assert_allclose(logits_of(loaded.eval(), tokens), logits(trained, tokens), rtol=1e-5, atol=1e-5)


def test_greedy_sampling_of_a_moe_checkpoint_equals_transformers_generate(checkpoints):
    from test_hugging_face import generated_by_transformers

    from xlatrain.models.sampling import Sampling, generate

    reference, directory = checkpoints("qwen2_moe")
    graphdef, params = from_hugging_face(directory, "test").module()
    prompt = np.random.default_rng(1).integers(0, VOCAB, (2, 7))
    expected, margin = generated_by_transformers(reference, prompt, 16)
    assert margin > 1e-4
    tokens, made = generate(graphdef, params, jnp.asarray(prompt, jnp.int32), jax.random.PRNGKey(0),
                            Sampling(16, temperature=0.0, vocab_used=VOCAB))
    np.testing.assert_array_equal(np.asarray(tokens), expected)


def one_line_error(capsys, *args: str) -> str:
    """`xlatrain ARGS` in this process: exit 2 and one line."""
    capsys.readouterr()  # what came before
    assert main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xlatrain"), lines
    return lines[0]


def test_bad_moe_configs_and_checkpoints_are_one_line(checkpoints, tmp_path, capsys):
    base = ["model.name=llama", "model.layers=2", "model.width=32", "model.heads=2"]
    for overrides, expected in [
            (["model.moe.experts=4", "model.moe.top_k=5"], "model.moe.top_k=5 is more than model.moe.experts=4"),
            (["model.moe.experts=4", "model.moe.capacity_factor=0"], "model.moe.capacity_factor"),
            (["model.name=gpt", "model.moe.experts=4"], "model.moe"),
            (["model.moe.experts=4", "model.moe.bias_rate=0.1", "mesh.stage=2"],
             "model.moe.bias_rate with mesh.stage=2"),
            (["model.moe.experts=4", "model.layers=4", "model.moe.interleave=2", "mesh.stage=2"],
             "a pipeline cuts one stack of layers"),
            (["model.moe.experts=4", "model.moe.dense_layers_first=2"], "leave none of model.layers=2 with experts")]:
        args = [o for o in base if not o.startswith("model.name") or "model.name=gpt" not in overrides]
        assert expected in one_line_error(capsys, "config", *args, *overrides)
    _, directory = checkpoints("mixtral")
    for experts, expected in [(3, "an expert past the 3 experts its config.json gives"),
                              (5, "with as many experts as its config.json gives")]:
        copy = tmp_path / f"experts{experts}"
        shutil.copytree(directory, copy)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "num_local_experts": experts}))
        assert expected in one_line_error(capsys, "sample", f"hf:{copy}", "--prompt", "x", "--max-new-tokens", "1")
    qwen = tmp_path / "qwen"
    saved(hugging_face_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]), qwen)
    assert "mlp_only_layers=[1] are not the first layers" in one_line_error(capsys, "sample", f"hf:{qwen}",
                                                                            "--prompt", "x")
    dense_mixtral = load_config(None, [*MOE, "model.moe.dense_layers_first=1"]).model
    with pytest.raises(UserError, match="mixtral has experts in every layer"):
        hugging_face_config(dense_mixtral, 256, 64)
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    (deepseek / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert "multi-head latent attention" in one_line_error(capsys, "sample", f"hf:{deepseek}", "--prompt", "x")
    # and from the command line, in a process of its own
    assert_one_line_error(run_cli("config", *base, "model.moe.experts=6", "mesh.expert=4", "mesh.cpu_devices=4"),
                          "mesh.expert=4 splits model.moe.experts=6 experts into equal groups")


def test_a_run_with_a_balancing_bias_samples_with_its_bias(tmp_path, devices, capsys):
    run_dir = tmp_path / "run"
    train(load_config(None, [*MOE, "model.moe.bias_rate=0.5", "model.moe.score=sigmoid", "trainer.steps=3",
                             f"trainer.run_dir={run_dir}"]), devices=devices[:1], echo=lambda _: None)
    trained = from_run(run_dir, None, "test")[0]
    bias = trained.model_state["blocks"]["moe"]["bias"]
    assert np.all(np.isin(np.abs(np.asarray(bias)), [0.5, 1.5]))  # three steps of 0.5, each up or down
    tokens = np.random.default_rng(0).integers(0, 256, (2, 32))
    unbiased = dataclasses.replace(trained, model_state=jax.tree.map(jnp.zeros_like, trained.model_state))
    assert np.max(np.abs(logits(trained, tokens) - logits(unbiased, tokens))) > 1e-4
    assert main(["sample", str(run_dir), "--prompt", "def ", "--max-new-tokens", "4"]) == 0


@pytest.fixture(scope="module")
def one_device_step(devices):
    """One device's gradients and two steps' metrics of the MoE model (dropless, and with a capacity)."""
    found = {}

    def results(capacity: bool):
        if capacity not in found:
            found[capacity] = step_results(["model.moe.capacity_factor=1.0"] if capacity else [], devices[:1])
        return found[capacity]

    return results


def test_dense_layers_among_expert_layers_train_expert_parallel_as_one_device(devices):
    """Per device with xlatrain's collectives: the dense layers' gradients are summed over `expert` with the rest
    of the replicas' params, the expert layers' own experts' are each device's."""
    overrides = ["model.layers=3", "model.moe.dense_layers_first=1"]
    reference = gradient_results(overrides, devices[:1])
    assert reference[0]["dense_blocks"]["gate"]["kernel"].shape[0] == 1
    assert reference[0]["blocks"]["moe"]["gate"].shape[0] == 2
    assert_same_steps(gradient_results([*overrides, "mesh.expert=2", *PER_DEVICE[1:]], devices[:2]), reference)


EXPERT_LAYOUTS = {"e2-t2": ["mesh.expert=2", "mesh.tensor=2"],
                  "e2-d2-fsdp": ["mesh.expert=2", "mesh.data=2", "parallel.strategy=fsdp"],
                  "e2-c2": ["mesh.expert=2", "mesh.context=2"], "e2-capacity": ["mesh.expert=2"],
                  "e2-per-device": ["mesh.expert=2", "parallel.mode=shard_map"],
                  "e2-d2-custom": ["mesh.expert=2", "mesh.data=2", *PER_DEVICE[1:]],
                  "e4-custom-capacity": ["mesh.expert=4", *PER_DEVICE[1:]]}
"""One global program (XLA's partitioner and its all-to-all inside each MoE region), and per-device programs with
XLA's collectives or, under collectives.impl=custom, xlatrain's all_to_all, all_gather and all_reduce."""


@pytest.mark.parametrize("name", EXPERT_LAYOUTS)
def test_expert_parallelism_equals_one_device(name, one_device_step, devices):
    """Each device routes its share of a replica's rows to the devices holding its experts (an all-to-all) and back;
    gradients, losses and router metrics equal one device's, the experts split over `expert` alone or with each
    expert's MLP over `tensor`, the params over `data` (fsdp), the sequence over `context`, in one program or per
    device; a capacity counts over the expert group's tokens as one device counts over its own."""
    overrides = EXPERT_LAYOUTS[name]
    capacity = name.endswith("capacity")
    count = int(np.prod([int(o.split("=")[1]) for o in overrides if o.startswith("mesh.")]))
    extra = ["model.moe.capacity_factor=1.0"] if capacity else []
    ref_grads, ref_losses, _ = one_device_step(capacity)
    grads, losses, _ = step_results([*overrides, *extra], devices[:count])
    assert_same_steps((grads, losses), (ref_grads, ref_losses))


def test_the_experts_are_split_over_expert_and_meet_by_all_to_all(devices):
    program = build_program(load_config(None, [*MOE, "mesh.expert=4"]), devices[:4])
    spec = program.specs.params["blocks"]["moe"]["gate"]
    assert tuple(spec)[:2] == (None, "expert")  # [layers, experts, ...]: each device holds one expert
    program.train_step(program.create_state(), token_batch(program))
    assert "all-to-all" in program.train_step.first.compiled.as_text()


def test_a_run_resumed_with_another_expert_split_and_fused_steps_tracks_one_device(tmp_path, devices):
    """The balancing bias too: it moves inside the fused steps' program and resumes from the checkpoint."""
    def losses(run_dir, *overrides, steps):
        train(load_config(None, [*MOE, f"trainer.steps={steps}", f"trainer.run_dir={run_dir}",
                                 "trainer.checkpoint_every=2", "model.moe.bias_rate=0.01", *overrides]),
              devices=devices[:4], echo=lambda _: None)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    reference = losses(tmp_path / "one", "mesh.cpu_devices=1", steps=4)
    split = tmp_path / "split"
    losses(split, "mesh.expert=2", "mesh.data=2", steps=2)
    resumed = losses(split, "mesh.expert=4", "trainer.steps_per_sync=2", steps=4)
    assert sorted(resumed) == list(range(1, 5))
    np.testing.assert_allclose([resumed[s] for s in range(1, 5)], [reference[s] for s in range(1, 5)], rtol=1e-4)
    bias, expected = (from_run(run_dir, None, "test")[0].model_state["blocks"]["moe"]["bias"]
                      for run_dir in (split, tmp_path / "one"))
    np.testing.assert_array_equal(bias, expected)


@pytest.mark.parametrize("formulation", ["sorted", "dense"])
def test_each_formulation_trains_inside_the_replicas_vmap_as_padded_does(formulation, devices):
    """jax batches no ragged_dot: the sorted formulation's grouped matmuls fold the replicas' vmap into their
    groups (models/moe.py: grouped_matmul)."""
    def loss_and_grads(name):
        program = build_program(load_config(None, [*MOE, "mesh.data=2", f"model.moe.formulation={name}"]),
                                devices[:2])
        return jax.device_get(program.gradients(program.create_state(), token_batch(program)))

    (grads, sums), (ref_grads, ref_sums) = loss_and_grads(formulation), loss_and_grads("padded")
    np.testing.assert_allclose(sums["loss"], ref_sums["loss"], rtol=1e-5)
    for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6 * np.abs(theirs).max())


def test_dense_and_expert_layers_unrolled_give_the_scans_gradients():
    """A dense layer, a group of a dense and an expert layer, a trailing dense layer, with dropout: unrolled as
    scanned, each layer with its own dropout key."""
    from xlatrain.data.spec import DataSpec
    from xlatrain.models import model_factory

    found = []
    for scan in (True, False):
        config = load_config(None, [*MOE, "model.layers=4", "model.moe.dense_layers_first=2", "model.moe.interleave=2",
                                    "model.dropout=0.1"]).model
        spec = DataSpec((32,), np.dtype(np.int32), (32,), np.dtype(np.int32), 256)
        module = model_factory(config, spec, jnp.float32, scan_layers=scan)(nnx.Rngs(0))
        assert module.interleaving.second == (3,)
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)

        def loss(params):
            out = nnx.merge(graphdef, params, rest)(jnp.arange(64).reshape(2, 32) % 256, rngs=jax.random.PRNGKey(1))
            return jnp.sum(out.outputs ** 2) + jnp.sum(out.reports.probability)

        found.append(jax.jit(jax.grad(loss))(params))
    for got, expected in zip(jax.tree.leaves(found[1]), jax.tree.leaves(found[0]), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


PIPELINES = {"s2-d2-uneven": (["mesh.stage=2", "mesh.data=2", "model.layers=3"], 2),
             "s2-e2-1f1b": (["mesh.stage=2", "mesh.expert=2"], 2),
             "s2-e2-zbv-custom": (["mesh.stage=2", "mesh.expert=2", "model.layers=4", "parallel.pipeline.schedule=zbv",
                                   "collectives.impl=custom"], 2)}
"""MoE blocks in a pipeline's stages, and the devices that hold a replica's rows apart (over data or expert)."""


@pytest.fixture(scope="module")
def one_device_microbatches(devices):
    """One device's gradients and step metrics with 4 accumulated microbatches, the rows of microbatch j those of
    pipeline microbatch j on each of `holders` devices (a global microbatch is every holder's piece j)."""
    found = {}

    def results(layers: list, holders: int):
        key = (tuple(layers), holders)
        if key not in found:
            rows, pieces = 8, 4
            each = rows // (holders * pieces)
            order = [d * rows // holders + j * each + k for j in range(pieces) for d in range(holders)
                     for k in range(each)]
            found[key] = gradient_results(["batch.microbatches=4", *layers], devices[:1], order)
        return found[key]

    return results


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if "zbv" in n else ()) for n in PIPELINES])
def test_a_pipeline_of_moe_blocks_equals_one_device(name, one_device_microbatches, devices):
    """Every layer's router statistics travel with the activation, and the auxiliary loss's gradient comes back
    with the activation's: the loss, the router's losses and loads and every gradient equal one device accumulating
    the same global microbatches, under 1f1b and zbv, with the replica's rows over data or over an expert group."""
    overrides, holders = PIPELINES[name]
    layers = [o for o in overrides if o.startswith("model.layers")]
    ours = gradient_results([*overrides, "parallel.pipeline.microbatches=4"], devices[:2 * holders])
    assert_same_steps(ours, one_device_microbatches(layers, holders))


def test_a_pipeline_of_moe_blocks_evaluates_as_one_device(devices):
    from test_pipeline import evaluated

    pipelined = evaluated(build_program(load_config(None, [*MOE, "mesh.stage=2"]), devices[:2]))[0]
    expected = evaluated(build_program(load_config(None, MOE), devices[:1]))[0]
    assert set(pipelined) == set(expected)
    for key in expected:
        np.testing.assert_allclose(pipelined[key], expected[key], rtol=1e-5)
