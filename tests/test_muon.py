"""Muon (optimizer.name=muon): the leaves it orthogonalises, its math against optax's, and where it runs: one
device's result under fsdp, tensor, both and a pipeline, each device orthogonalising its own matrices."""

import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DIGITS_MLP, TINY_GPT, token_batch
from optax.contrib import MuonDimensionNumbers
from test_config import cli_error

from xlatrain.commands.lower import muon_report
from xlatrain.config import load_config
from xlatrain.data.spec import DataSpec
from xlatrain.muon import muon_labels
from xlatrain.optim import build_optimizer
from xlatrain.program import build_model, build_program
from xlatrain.state import with_shardings
from xlatrain.trainer import train

MUON = [*TINY_GPT, "model.name=llama", "model.width=64", "model.heads=4", "batch.global_size=16",
        "optimizer.name=muon", "optimizer.lr=0.01", "optimizer.adam_lr=0.001", "optimizer.eps=1e-6",
        "optimizer.schedule=constant", "optimizer.weight_decay=0.1"]
"""A Llama: the GPT's key bias gets no gradient but rounding's, which AdamW (the biases' group) turns into steps
of a full learning rate, so one device's and a mesh's params differ there whatever the matrices' optimizer; AdamW's
epsilon at 1e-6 likewise keeps the rounding of a head row's tiny gradients from being magnified."""
TOKENS = DataSpec((16,), np.dtype(np.int32), (16,), np.dtype(np.int32), 256)
STEPS = 10


def hidden_matrices(*overrides):
    config = load_config(None, ["model.layers=3", "model.width=32", "model.heads=4", "data.seq_len=16", *overrides])
    params = jax.eval_shape(build_model(config, TOKENS, jnp.float32, 1, None).init, jax.random.PRNGKey(0))[0]
    labels = jax.tree_util.tree_flatten_with_path(muon_labels(params))[0]
    return {jax.tree_util.keystr(path, simple=True, separator="."): label for path, label in labels
            if label == "muon"}


def test_muon_orthogonalises_exactly_the_hidden_matrices():
    assert set(hidden_matrices()) == {f"blocks.{name}.kernel" for name in ("qkv", "attn_out", "mlp_in", "mlp_out")}
    llama = {f"{stack}.{name}.kernel" for stack in ("blocks", "dense_blocks")
             for name in ("q", "k", "v", "attn_out", "gate", "up", "down")}
    moe = {*llama - {f"blocks.{name}.kernel" for name in ("gate", "up", "down")},
           *{f"blocks.moe.{name}" for name in ("gate", "up", "down")},
           *{f"blocks.moe.shared.{name}.kernel" for name in ("gate", "up", "down")}}
    assert set(hidden_matrices("model.name=llama", "model.moe.experts=4", "model.moe.shared_hidden=32",
                               "model.moe.dense_layers_first=1")) == moe  # the router is AdamW's


@pytest.mark.parametrize("rms_match", [None, 0.2])
def test_the_muon_group_is_optaxs_muon_and_the_rest_xlatrains_adamw(rms_match):
    """Stacked layers' matrices (the GPT's qkv as q, k and v; experts each their own) against optax.contrib.muon
    given their dimension numbers, with Keller Jordan's update scale and Moonlight's; embeddings, biases and the
    router against AdamW with its own rate and decay."""
    config = load_config(None, ["optimizer.name=muon", "optimizer.weight_decay=0.1", "optimizer.adam_lr=0.003",
                                "optimizer.adam_weight_decay=0.01", "optimizer.lr=0.02",
                                f"optimizer.rms_match={'null' if rms_match is None else rms_match}"])
    rng = np.random.default_rng(0)

    def draw():
        shapes = {"blocks": {"qkv": {"kernel": (2, 8, 3, 16), "bias": (2, 16)},
                             "moe": {"up": (2, 4, 8, 6), "router": {"kernel": (2, 8, 4)}}},
                  "embed": {"embedding": (20, 8)}}
        return jax.tree.map(lambda shape: jnp.asarray(rng.normal(size=shape), jnp.float32), shapes,
                            is_leaf=lambda x: isinstance(x, tuple))

    ours = build_optimizer(config.optimizer, optax.constant_schedule(0.02), block_axes=1)
    dims = {"blocks": {"qkv": {"kernel": MuonDimensionNumbers(1, 3), "bias": None},
                       "moe": {"up": MuonDimensionNumbers(2, 3), "router": {"kernel": None}}},
            "embed": {"embedding": None}}
    muon = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims, weight_decay=0.1, consistent_rms=rms_match)
    decayed = {"blocks": {"qkv": {"kernel": False, "bias": False}, "moe": {"up": False, "router": {"kernel": True}}},
               "embed": {"embedding": True}}
    adamw = optax.adamw(0.003, weight_decay=0.01, mask=decayed)
    params = draw()
    states = ours.init(params), muon.init(params), adamw.init(params)
    for step in range(3):
        grads = draw()
        updates, ours_state = ours.update(grads, states[0], params)
        expected, muon_state = muon.update(grads, states[1], params)
        adam_expected, adam_state = adamw.update(grads, states[2], params)
        states = ours_state, muon_state, adam_state
        for leaf, label, from_muon, from_adamw in zip(*map(jax.tree.leaves, (
                updates, muon_labels(params), expected, adam_expected)), strict=True):
            np.testing.assert_allclose(leaf, from_muon if label == "muon" else from_adamw, rtol=1e-5, atol=1e-7,
                                       err_msg=f"a {label} leaf, step {step}")


def train_losses_and_params(overrides, devices):
    program = build_program(load_config(None, [*MUON, *overrides]), devices)
    state, batch = program.create_state(), token_batch(program)
    losses = []
    for _ in range(STEPS):
        state, metrics = program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    params = state.params if program.pipeline is None else program.pipeline.layout.layer_params(state.params)
    return program, losses, jax.device_get(params)


@pytest.fixture(scope="module")
def one_device(devices):
    return train_losses_and_params(["mesh.data=1"], devices[:1])


DOT = re.compile(r"= f32\[([\d,]+)\]\{[^}]*\} dot\(")


def newton_schulz_elements(program) -> int:
    """The elements of every product one device computes in the compiled optimizer update (Muon's alone has
    products: its Newton-Schulz iterations')."""
    state = with_shardings(program.abstract_state, program.specs, program.mesh)
    hlo = jax.jit(program.tx.update).lower(state.params, state.opt_state, state.params).compile().as_text()
    return sum(math.prod(int(n) for n in dims.split(",")) for dims in DOT.findall(hlo))


def owned_elements(program, owners: int) -> int:
    """What newton_schulz_elements should be when each group of matrices of one shape (either way round) is spread
    over `owners` devices: per matrix and iteration, A = X Xᵀ and A A (short x short), then B X (short x long)."""
    counts = collections.Counter()
    for leaf, label in zip(*map(jax.tree.leaves, (program.abstract_state.params,
                                                   muon_labels(program.abstract_state.params))), strict=True):
        if label == "muon":  # a Llama's [layers, in, out]
            counts[tuple(sorted(leaf.shape[1:]))] += leaf.shape[0]
    return sum(-(-count // owners) * 5 * (2 * short * short + short * long)
               for (short, long), count in counts.items())


@pytest.mark.parametrize("overrides", [
    ["mesh.data=4", "parallel.strategy=fsdp"],
    ["mesh.data=2", "mesh.tensor=2"],
    ["mesh.data=2", "mesh.tensor=2", "parallel.strategy=fsdp"],
    ["mesh.data=1", "mesh.stage=2"],
], ids=["fsdp-d4", "tensor-d2t2", "fsdp-d2t2", "pipeline-s2"])
def test_sharded_and_pipelined_muon_equals_one_devices(overrides, one_device, devices):
    """Ten steps' losses and the params after them; under fsdp and tensor parallelism each device orthogonalises
    its share of the matrices (read from the compiled update), where one device does them all."""
    program, losses, params = train_losses_and_params(overrides, devices[:4 if "mesh.stage=2" not in overrides else 2])
    reference, reference_losses, reference_params = one_device
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(reference_params), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(theirs))))
    assert newton_schulz_elements(reference) == owned_elements(reference, 1)
    if program.pipeline is None:
        owners = program.mesh.size // (1 if "fsdp" in overrides[-1] else program.mesh.shape["data"])
        assert newton_schulz_elements(program) == owned_elements(program, owners)


def test_muon_under_fsdp_moves_less_than_an_all_gather_of_every_matrix(devices):
    """xlatrain lower's report of the update: all-to-alls over `data` alone, fewer bytes per device than the
    matrices whole (what an all-gather of each would bring to every device)."""
    program = build_program(load_config(None, [*MUON, "mesh.data=8", "parallel.strategy=fsdp"]), devices)
    report = muon_report(program)
    assert {(c["kind"], c["over"]) for c in report["collectives"]} == {("all-to-all", "data")}
    assert sum(c["bytes"] for c in report["collectives"]) < 0.6 * report["all_gather_bytes"]


@pytest.mark.parametrize("overrides, message", [
    ([*DIGITS_MLP, "optimizer.name=muon"], "optimizer.name=muon orthogonalises the hidden matrices"),
    ([*MUON, "parallel.mode=shard_map", "parallel.strategy=zero1"], "zero1 runs in parallel.mode=jit"),
    ([*MUON, "mesh.stage=2", "mesh.tensor=2"], "mesh.tensor=2 runs in parallel.mode=jit"),
])
def test_what_muon_cannot_do_is_one_line(overrides, message, capsys, tmp_path):
    assert message in cli_error(capsys, "train", *overrides, f"trainer.run_dir={tmp_path}")


def test_a_muon_run_resumes_exactly(tmp_path, devices):
    def run(directory, steps):
        return train(load_config(None, [*MUON, "mesh.data=1", f"trainer.steps={steps}",
                                        f"trainer.run_dir={directory}"]), devices=devices[:1], echo=lambda _: None)

    straight = run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    resumed = run(tmp_path / "resumed", 4)
    assert resumed.start_step == 2 and {step: resumed.losses[step] for step in (3, 4)} == {
        step: straight.losses[step] for step in (3, 4)}
