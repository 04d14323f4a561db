"""reduce_scatter: participant r gets block r (along axis 0) of the sum / mean of everyone's buffer.
Reference: `lax.psum_scatter(x, axis, tiled=True)`. Its transpose is all_gather (tiled)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from xlatrain.custom_calls._collective import (
    REDUCTIONS,
    axis_location,
    check_reduction,
    collective_primitive,
    primitive,
    timeout_ms,
)


def reduce_scatter(
    x: jax.Array, axis_name: str, reduction: str = "sum", *, timeout_s: float | None = None
) -> jax.Array:
    """x: [n * k, ...] -> [k, ...] for n participants; axis 0 must divide evenly, as in lax.psum_scatter."""
    check_reduction("reduce_scatter", reduction, ("sum", "mean"))
    participants, where = axis_location(axis_name)
    if x.ndim == 0 or x.shape[0] % participants:
        raise ValueError(
            f"reduce_scatter: axis 0 of shape {x.shape} does not split over {participants} "
            f"participants of axis {axis_name!r}; pad it to a multiple of {participants}"
        )
    return _reduce_scatter_p.bind(
        x, where, reduction=reduction, participants=participants, axis_name=axis_name, timeout_ms=timeout_ms(timeout_s)
    )


def reference(x: jax.Array, axis_name: str, reduction: str = "sum") -> jax.Array:
    out = jax.lax.psum_scatter(x, axis_name, tiled=True)
    return out / jax.lax.axis_size(axis_name) if reduction == "mean" else out


def _abstract_eval(x, where, *, participants, **_):
    return x.update(shape=(x.shape[0] // participants, *x.shape[1:]))


def _batch(x, bdim, where, **params):
    x = jnp.moveaxis(x, bdim, 1)  # the scattered axis stays first
    return _reduce_scatter_p.bind(x, where, **params), 1


def _transpose(ct, where, *, reduction, participants, timeout_ms, axis_name):
    gathered = primitive("all_gather").bind(ct, where, participants=participants, axis_name=axis_name,
                                            timeout_ms=timeout_ms)
    gathered = gathered.reshape(participants * ct.shape[0], *ct.shape[1:])
    return gathered / participants if reduction == "mean" else gathered


_reduce_scatter_p = collective_primitive(
    "reduce_scatter",
    abstract_eval=_abstract_eval,
    batch=_batch,
    transpose=_transpose,
    attributes=lambda reduction, participants, timeout_ms: {
        "reduction": np.int32(REDUCTIONS[reduction]),
        "participants": np.int64(participants),
        "timeout_ms": np.int64(timeout_ms),
    },
)
