"""Model FLOPs of a training step, counted on its jaxpr rather than taken from XLA's cost analysis, which
counts the body of a loop once (scanned layers, accumulation microbatches and pipeline slots would vanish).

What is counted is what MFU conventionally counts: the multiply-adds of the matrix multiplications and
convolutions (2 FLOPs each) of one forward and backward over the global batch, each loop's body times its
trip count. Attention counts as it runs: the dense attention of XLA's implementation computes every
query-key product and masks the future, so a causal attention costs as much as a full one, except where
xlatrain.models.attention cuts it into query blocks (on CPU), whose products are counted as any others; cuDNN's fused
attention (xlatrain's on GPUs in bf16/f16) skips the masked products, so there a causal attention counts its
unmasked query-key pairs only, with two products over them forward and four backward (the forward that its
backward recomputes is not model work). Elementwise work (norms, activations, the optimizer) is left out, as in
the 6 x params x tokens rule of thumb. A Mixture of Experts counts the experts each token chose (its active
parameters): the program traced for the count runs them as grouped matmuls (xlatrain/program.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from jax.extend import core as jex_core

from xlatrain.compat.jaxprs import without_dead_code


class UncountedLoop(Exception):
    """The program has a while loop: its trip count, so its FLOPs, cannot be read from the jaxpr."""


def dot_general_flops(eqn: Any) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (lhs_contract, rhs_contract), (lhs_batch, _) = eqn.params["dimension_numbers"]
    contracted = math.prod(lhs[d] for d in lhs_contract)
    batch = math.prod(lhs[d] for d in lhs_batch)
    lhs_free = math.prod(lhs) // (contracted * batch)
    rhs_free = math.prod(rhs) // (contracted * batch)
    return 2.0 * batch * lhs_free * rhs_free * contracted


def ragged_dot_flops(eqn: Any) -> float:
    """A grouped matmul (jax.lax.ragged_dot and its gradients): each of the lhs's rows meets one group's matrix,
    2 x the lhs's elements x the rhs's free size per group."""
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (_, rhs_contract), _ = numbers.dot_dimension_numbers
    rhs_free = math.prod(rhs) // math.prod(rhs[d] for d in (*rhs_contract, *numbers.rhs_group_dimensions))
    return 2.0 * math.prod(lhs) * rhs_free


def dense_weight_tangent_flops(eqn: Any) -> float:
    """x @ dw, a dense layer's weight tangent in forward mode (xlatrain/models/linear.py); operands (dw, x)."""
    weight_tangent, x = (v.aval.shape for v in eqn.invars)
    return 2.0 * math.prod(x) * weight_tangent[1]


def conv_flops(eqn: Any) -> float:
    """2 x output elements x the kernel's spatial size x its input features per group."""
    kernel = eqn.invars[1].aval.shape
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
    per_output = kernel[spec[1]] * math.prod(kernel[d] for d in spec[2:])
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * per_output


def attended_pairs(queries: int, keys: int, causal: bool, window: int | None) -> int:
    """Query-key pairs a fused attention computes: all of them, or under a causal mask those of each query with
    itself and the keys before it (the last `window` of them when a sliding window is set)."""
    if not causal:
        return queries * keys
    reach = np.minimum(np.arange(1, queries + 1), keys)
    return int(np.minimum(reach, window).sum() if window else reach.sum())


def fused_attention_flops(eqn: Any, products: int) -> float:
    """cuDNN's fused attention (jax's dot_product_attention_fwd/_bwd): `products` matrix products over the
    attended pairs, each as deep as the head dimension of its operands (query-key: the key's; with values:
    the value's)."""
    query, key, value = (v.aval.shape for v in eqn.invars[:3])
    heads_first = eqn.params["layout"] == 1  # jax's AttentionLayout.BNTH; BTNH (0) otherwise
    batch, heads = (query[0], query[1]) if heads_first else (query[0], query[2])
    queries, keys = (query[2], key[2]) if heads_first else (query[1], key[1])
    mask = eqn.params["mask_type"]
    causal = "CAUSAL" in getattr(mask, "name", str(mask))
    pairs = attended_pairs(queries, keys, causal, eqn.params.get("sliding_window_length"))
    depth = (key[-1] + value[-1]) * products / 2  # half the products pair query and key, half go with values
    return 2.0 * batch * heads * pairs * depth


COUNTED: dict[str, Callable[[Any], float]] = {
    "dot_general": dot_general_flops, "conv_general_dilated": conv_flops, "ragged_dot_general": ragged_dot_flops,
    "dot_product_attention_fwd": lambda eqn: fused_attention_flops(eqn, products=2),
    "dot_product_attention_bwd": lambda eqn: fused_attention_flops(eqn, products=4),
    "xlatrain_dense_weight_tangent": dense_weight_tangent_flops}


def jaxpr_flops(jaxpr: Any) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in COUNTED:
            total += COUNTED[name](eqn)
        elif name == "scan":
            total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":  # one branch runs: the dearest bounds it
            total += max(jaxpr_flops(branch.jaxpr) for branch in eqn.params["branches"])
        elif name == "while":
            raise UncountedLoop("a while loop's trip count is unknown to the jaxpr")
        else:
            total += sum(jaxpr_flops(sub) for sub in _sub_jaxprs(eqn.params))
    return total


def _sub_jaxprs(params: dict) -> list[Any]:
    """The jaxprs a call-like equation runs once (pjit, custom_jvp/vjp, remat, shard_map, ...)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jex_core.Jaxpr):
                found.append(item)
    return found


def step_flops(fn: Callable, *abstract_args: Any) -> float:
    """Model FLOPs of fn(*abstract_args), traced (nothing is compiled or run). Products no output needs are not
    counted, as XLA drops them."""
    return jaxpr_flops(without_dead_code(jax.make_jaxpr(fn)(*abstract_args).jaxpr))
