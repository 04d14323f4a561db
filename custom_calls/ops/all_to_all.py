"""all_to_all: each participant's buffer is cut into `participants` equal blocks along `split_axis`; block j goes to
participant j, which joins the blocks it receives, in participant order, along `concat_axis` (concatenated with
`tiled=True`; otherwise the split axis, of size `participants`, is dropped and the blocks are stacked on a new
axis there). Reference: `lax.all_to_all`. The exchange moves blocks of a [participants, ...] buffer, which is its
own transpose. Expert parallelism sends tokens to their experts' devices and back with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from xlatrain.custom_calls._collective import axis_location, collective_primitive, timeout_ms


def all_to_all(x: jax.Array, axis_name: str, split_axis: int, concat_axis: int, *, tiled: bool = False,
               timeout_s: float | None = None) -> jax.Array:
    participants, where = axis_location(axis_name)
    split_axis, concat_axis = split_axis % x.ndim, concat_axis % (x.ndim if tiled else x.ndim - 1 or 1)
    size = x.shape[split_axis]
    if (size % participants if tiled else size != participants):
        need = "a multiple of" if tiled else "equal to"
        raise ValueError(f"all_to_all: axis {split_axis} of {x.shape} must be {need} the {participants} participants")
    blocks = jnp.moveaxis(x, split_axis, 0)
    blocks = blocks.reshape(participants, size // participants, *blocks.shape[1:])
    received = _all_to_all_p.bind(blocks, where, participants=participants, axis_name=axis_name,
                                  timeout_ms=timeout_ms(timeout_s))
    pieces = jnp.moveaxis(received, 1, split_axis + 1)  # [participants, x's layout with its share of split_axis]
    if not tiled:
        return jnp.moveaxis(jnp.squeeze(pieces, split_axis + 1), 0, concat_axis)
    joined = list(pieces.shape[1:])
    joined[concat_axis] *= participants
    return jnp.moveaxis(pieces, 0, concat_axis).reshape(joined)


def reference(x: jax.Array, axis_name: str, split_axis: int, concat_axis: int, *, tiled: bool = False) -> jax.Array:
    return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)


def _batch(x, bdim, where, **params):
    moved = jnp.moveaxis(x, bdim, 1)  # the blocks stay on axis 0
    return _all_to_all_p.bind(moved, where, **params), 1


_all_to_all_p = collective_primitive(
    "all_to_all",
    abstract_eval=lambda x, where, **_: x,
    batch=_batch,
    transpose=lambda ct, where, **params: _all_to_all_p.bind(ct, where, **params),
    attributes=lambda participants, timeout_ms: {
        "participants": np.int64(participants),
        "timeout_ms": np.int64(timeout_ms),
    },
)
