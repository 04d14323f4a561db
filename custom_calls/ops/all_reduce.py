"""all_reduce: every participant gets the sum / mean / max / min of everyone's buffer.
Reference: `lax.psum`, `lax.pmean`, `lax.pmax`, `lax.pmin`. Sum and mean are linear and their own
transposes; max and min are not differentiable (as in lax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from xlatrain.custom_calls._collective import (
    REDUCTIONS,
    axis_location,
    check_reduction,
    collective_primitive,
    timeout_ms,
)


def all_reduce(x: jax.Array, axis_name: str, reduction: str = "sum", *, timeout_s: float | None = None) -> jax.Array:
    check_reduction("all_reduce", reduction, tuple(REDUCTIONS))
    if reduction == "mean" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"all_reduce: mean of integers is not defined ({x.dtype}); use reduction='sum'")
    participants, where = axis_location(axis_name)
    return _all_reduce_p.bind(
        x, where, reduction=reduction, participants=participants, axis_name=axis_name, timeout_ms=timeout_ms(timeout_s)
    )


def reference(x: jax.Array, axis_name: str, reduction: str = "sum") -> jax.Array:
    return {"sum": jax.lax.psum, "mean": jax.lax.pmean, "max": jax.lax.pmax, "min": jax.lax.pmin}[reduction](
        x, axis_name
    )


def _transpose(ct, where, **params):
    return _all_reduce_p.bind(ct, where, **params)


_all_reduce_p = collective_primitive(
    "all_reduce",
    abstract_eval=lambda x, where, **_: x,
    batch=lambda x, bdim, where, **params: (_all_reduce_p.bind(x, where, **params), bdim),
    transpose=_transpose,
    differentiable=lambda reduction, **_: reduction in ("sum", "mean"),
    attributes=lambda reduction, participants, timeout_ms: {
        "reduction": np.int32(REDUCTIONS[reduction]),
        "participants": np.int64(participants),
        "timeout_ms": np.int64(timeout_ms),
    },
)
