"""Mixture-of-Experts routing and experts (xlatrain/models/moe.py) against transformers' Mixtral block and its
load-balancing loss, the four formulations of the experts' matmuls against each other, and expert parallelism's
all-to-all dispatch against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xlatrain.compat.mapping import shard_map
from xlatrain.models.moe import (
    ExpertGroup,
    expert_parallel_experts,
    load_balancing_loss,
    route,
    routed_experts,
    router_z_loss,
)

TOKENS, WIDTH, HIDDEN, EXPERTS, TOP_K = 24, 16, 32, 4, 2


@pytest.fixture(scope="module")
def weights():
    keys = jax.random.split(jax.random.key(0), 5)
    return {"x": jax.random.normal(keys[0], (TOKENS, WIDTH)),
            "router": jax.random.normal(keys[1], (WIDTH, EXPERTS)),
            "gate": jax.random.normal(keys[2], (EXPERTS, WIDTH, HIDDEN)) / 4,
            "up": jax.random.normal(keys[3], (EXPERTS, WIDTH, HIDDEN)) / 4,
            "down": jax.random.normal(keys[4], (EXPERTS, HIDDEN, WIDTH)) / 6}


def moe(w, formulation):
    routing = route(w["x"] @ w["router"], TOP_K)
    return routed_experts(w["x"], routing, w["gate"], w["up"], w["down"], formulation)


@pytest.mark.parametrize("formulation", ["sorted", "dense", "padded", "blocked"])
def test_each_formulation_equals_transformers_mixtral_block(formulation, weights):
    torch = pytest.importorskip("torch")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=WIDTH, intermediate_size=HIDDEN, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K)
    block = MixtralSparseMoeBlock(config).eval()
    w = {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
    with torch.no_grad():
        block.gate.weight.copy_(w["router"].T)
        block.experts.gate_up_proj.copy_(torch.cat([w["gate"], w["up"]], dim=-1).transpose(1, 2))
        block.experts.down_proj.copy_(w["down"].transpose(1, 2))
        expected = block(w["x"][None])
    expected = (expected[0] if isinstance(expected, tuple) else expected)[0].numpy()
    got = np.asarray(moe(weights, formulation))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("blocks_looped", [False, True])
def test_the_formulations_have_the_same_gradients(blocks_looped, weights, monkeypatch):
    """`blocked` runs its blocks at once or, where they are large, in a loop (LOOPED_BLOCK_PRODUCTS)."""
    import xlatrain.models.moe as moe_module

    monkeypatch.setattr(moe_module, "LOOPED_BLOCK_PRODUCTS", 0 if blocks_looped else 2**62)

    def loss(w, formulation):
        return jnp.sum(jnp.sin(moe(w, formulation)))

    grads = {f: jax.grad(loss)(weights, f) for f in ("sorted", "dense", "padded", "blocked")}
    for formulation in ("dense", "padded", "blocked"):
        for name in weights:
            reference = np.asarray(grads["sorted"][name])
            np.testing.assert_allclose(grads[formulation][name], reference, rtol=1e-5,
                                       atol=1e-6 * np.abs(reference).max(), err_msg=f"{formulation}: {name}")


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers_over_every_layer(masked, weights):
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers = [np.asarray(jax.random.normal(jax.random.key(i), (TOKENS, EXPERTS))) for i in range(2)]
    mask = (np.arange(TOKENS) % 5 != 0).astype(np.float32)
    expected = float(load_balancing_loss_func(tuple(torch.from_numpy(x) for x in layers), EXPERTS, TOP_K,
                                              torch.from_numpy(mask)[None] if masked else None))
    routings = [route(jnp.asarray(x), TOP_K) for x in layers]
    got = load_balancing_loss(jnp.concatenate([r.probabilities for r in routings]),
                              jnp.concatenate([r.experts for r in routings]),
                              jnp.tile(jnp.asarray(mask), 2) if masked else None)
    np.testing.assert_allclose(float(got), expected, rtol=1e-6)


def test_a_sigmoid_router_bias_moves_the_choice_not_the_weights():
    """DeepSeek-V3's balancing bias: experts are chosen by score + bias, weighted by their scores normalised."""
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    plain = route(logits, 2, "sigmoid")
    biased = route(logits, 2, "sigmoid", bias_E=jnp.asarray([0.0, 0.0, 5.0, 0.0]))
    scores = 1 / (1 + np.exp(-np.asarray([2.0, 1.0, 0.0])))
    assert plain.experts.tolist() == [[0, 1]] and biased.experts.tolist() == [[2, 0]]
    np.testing.assert_allclose(biased.weights[0], scores[[2, 0]] / scores[[2, 0]].sum(), rtol=1e-6)


def test_router_z_loss_is_the_mean_squared_log_sum_exp():
    logits = np.asarray([[0.0, 1.0], [2.0, -1.0]], np.float32)
    expected = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(float(router_z_loss(jnp.asarray(logits))), expected, rtol=1e-6)


@pytest.mark.parametrize("size, impl", [(2, "xla"), (4, "xla"), (4, "custom")])
def test_expert_parallel_experts_equal_one_device_with_their_gradients(size, impl, weights, devices):
    """Tokens and experts split over `size` devices: each routes its tokens, the assignments go to their experts'
    devices by all-to-all (XLA's, or xlatrain's custom call) and come back; outputs and every gradient equal the
    experts run on one device."""
    from xlatrain.custom_calls import all_to_all

    exchange = {"xla": lambda b: jax.lax.all_to_all(b, "expert", 0, 0, tiled=True),
                "custom": lambda b: all_to_all(b, "expert", 0, 0, tiled=True)}[impl]

    def layer(w):
        routing = route(w["x"] @ w["router"][0], TOP_K)
        return expert_parallel_experts(w["x"], routing, w["gate"], w["up"], w["down"], ExpertGroup(size, exchange))

    # the router a copy per device, its gradient summed outside: no XLA collective beside xlatrain's in the program
    # (XLA:CPU's blocking all-reduce and the custom calls could wait for each other in different orders)
    parallel = shard_map(layer, Mesh(np.array(devices[:size]), ("expert",)), (P("expert"),), P("expert"))
    copies = {**weights, "router": jnp.broadcast_to(weights["router"], (size, *weights["router"].shape))}

    def loss(run):
        return lambda w: jnp.sum(jnp.sin(run(w)))

    np.testing.assert_allclose(jax.jit(parallel)(copies), moe(weights, "sorted"), rtol=1e-5, atol=1e-6)
    expected = jax.grad(loss(lambda w: moe(w, "sorted")))(weights)
    got = jax.jit(jax.grad(loss(parallel)))(copies)
    got["router"] = got["router"].sum(0)
    for name, reference in expected.items():
        np.testing.assert_allclose(got[name], reference, rtol=1e-5, atol=1e-6 * np.abs(reference).max(),
                                   err_msg=name)
