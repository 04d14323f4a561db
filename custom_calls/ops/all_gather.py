"""all_gather: every participant gets everyone's buffer, stacked on a new axis 0 ([n, ...]) or, with
`tiled=True`, concatenated along axis 0. Reference: `lax.all_gather`. Its transpose is reduce_scatter."""

from __future__ import annotations

import jax
import numpy as np
from xlatrain.custom_calls._collective import axis_location, collective_primitive, primitive, timeout_ms


def all_gather(x: jax.Array, axis_name: str, *, tiled: bool = False, timeout_s: float | None = None) -> jax.Array:
    participants, where = axis_location(axis_name)
    out = _all_gather_p.bind(x, where, participants=participants, axis_name=axis_name, timeout_ms=timeout_ms(timeout_s))
    if tiled:
        if x.ndim == 0:
            raise ValueError("all_gather(tiled=True) needs an input with at least one axis")
        return out.reshape(participants * x.shape[0], *x.shape[1:])
    return out


def reference(x: jax.Array, axis_name: str, *, tiled: bool = False) -> jax.Array:
    return jax.lax.all_gather(x, axis_name, tiled=tiled)


def _batch(x, bdim, where, **params):
    return _all_gather_p.bind(x, where, **params), bdim + 1


def _transpose(ct, where, *, participants, timeout_ms, axis_name):
    flat = ct.reshape(-1)  # block r of the flat cotangent is ct[r], which belongs to participant r
    summed = primitive("reduce_scatter").bind(
        flat, where, reduction="sum", participants=participants, axis_name=axis_name, timeout_ms=timeout_ms
    )
    return summed.reshape(ct.shape[1:])


_all_gather_p = collective_primitive(
    "all_gather",
    abstract_eval=lambda x, where, *, participants, **_: x.update(shape=(participants, *x.shape)),
    batch=_batch,
    transpose=_transpose,
    attributes=lambda participants, timeout_ms: {
        "participants": np.int64(participants),
        "timeout_ms": np.int64(timeout_ms),
    },
)
