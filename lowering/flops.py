"""Model FLOPs of a training step, counted on its jaxpr rather than taken from XLA's cost analysis, which
counts the body of a loop once (scanned layers, accumulation microbatches and pipeline slots would vanish).

What is counted is what MFU conventionally counts: the multiply-adds of the matrix multiplications and
convolutions (2 FLOPs each) of one forward and backward over the global batch, each loop's body times its
trip count. Attention counts as it runs: the dense attention of XLA's implementation computes every
query-key product and masks the future, so a causal attention costs as much as a full one. Elementwise work
(norms, activations, the optimizer) is left out, as in the 6 x params x tokens rule of thumb.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
from jax.extend import core as jex_core


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


def conv_flops(eqn: Any) -> float:
    """2 x output elements x the kernel's spatial size x its input features per group."""
    kernel = eqn.invars[1].aval.shape
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
    per_output = kernel[spec[1]] * math.prod(kernel[d] for d in spec[2:])
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * per_output


COUNTED: dict[str, Callable[[Any], float]] = {"dot_general": dot_general_flops, "conv_general_dilated": conv_flops}


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
    """Model FLOPs of fn(*abstract_args), traced (nothing is compiled or run)."""
    return jaxpr_flops(jax.make_jaxpr(fn)(*abstract_args).jaxpr)
