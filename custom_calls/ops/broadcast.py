"""broadcast: every participant gets participant `root`'s buffer. Reference: `lax.all_gather(x)[root]`
(XLA has no broadcast collective). Its transpose sums the cotangents onto the root."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from xlatrain.custom_calls._collective import axis_location, collective_primitive, timeout_ms


def broadcast(x: jax.Array, axis_name: str, root: int = 0, *, timeout_s: float | None = None) -> jax.Array:
    participants, where = axis_location(axis_name)
    if not 0 <= root < participants:
        raise ValueError(f"broadcast: root={root} is not a participant of axis {axis_name!r} (0..{participants - 1})")
    return _broadcast_p.bind(
        x, where, root=int(root), participants=participants, axis_name=axis_name, timeout_ms=timeout_ms(timeout_s)
    )


def reference(x: jax.Array, axis_name: str, root: int = 0) -> jax.Array:
    return jax.lax.all_gather(x, axis_name)[root]


def _transpose(ct, where, *, root, participants, timeout_ms, axis_name):
    from xlatrain.custom_calls.ops.all_reduce import _all_reduce_p

    total = _all_reduce_p.bind(
        ct, where, reduction="sum", participants=participants, axis_name=axis_name, timeout_ms=timeout_ms
    )
    return jnp.where(where[0] == root, total, jnp.zeros_like(total))


_broadcast_p = collective_primitive(
    "broadcast",
    abstract_eval=lambda x, where, **_: x,
    batch=lambda x, bdim, where, **params: (_broadcast_p.bind(x, where, **params), bdim),
    transpose=_transpose,
    attributes=lambda root, participants, timeout_ms: {
        "root": np.int64(root),
        "participants": np.int64(participants),
        "timeout_ms": np.int64(timeout_ms),
    },
)
