"""What every collective shares: where the calling device sits on the axis, and the primitive's rules."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from xlatrain.custom_calls.backend import lowering

from xlatrain.compat.primitives import define_linear_primitive, manual_axes

DEFAULT_TIMEOUT_S = 300.0
"""How long a participant waits for the others before failing (CPU backend)."""


def axis_location(axis_name: str) -> tuple[int, jax.Array]:
    """(participants, int32[rank, group]) for a collective over `axis_name` inside shard_map or pmap. The
    group numbers the other manual mesh axes, so each row of a 2-D mesh meets on its own."""
    manual = dict(manual_axes())
    if axis_name not in manual:
        raise ValueError(f"axis {axis_name!r} is not a manual mesh axis here (manual axes: {sorted(manual)}); "
                         "call xlatrain collectives inside jax.shard_map or jax.pmap over that axis")
    group = jnp.zeros((), jnp.int32)
    for name, size in manual.items():
        if name != axis_name:
            group = group * size + jax.lax.axis_index(name)
    rank = jax.lax.axis_index(axis_name).astype(jnp.int32)
    return manual[axis_name], jnp.stack([rank, group.astype(jnp.int32)])


def timeout_ms(timeout_s: float | None) -> int:
    return int(1000 * (DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s))


_PRIMITIVES: dict[str, object] = {}
"""Each op's primitive, by op name: a transpose rule binds its partner's (all_gather and reduce_scatter transpose to
each other), which is made by the partner's module."""


def collective_primitive(op: str, *, abstract_eval: Callable, batch: Callable, transpose: Callable,
                         attributes: Callable, differentiable: Callable[..., bool] = lambda **_: True) -> object:
    _PRIMITIVES[op] = define_linear_primitive(f"xlatrain_{op}", abstract_eval=abstract_eval, batch=batch,
                                              transpose=transpose, differentiable=differentiable,
                                              lowerings=lowering(op, attributes))
    return _PRIMITIVES[op]


def primitive(op: str) -> object:
    """The primitive of a collective that `xlatrain.custom_calls` has made (importing it makes every op's)."""
    return _PRIMITIVES[op]


REDUCTIONS = {"sum": 0, "mean": 1, "max": 2, "min": 3}
"""Reduction codes shared with custom_calls/csrc/collectives.h."""


def check_reduction(op: str, reduction: str, allowed: tuple[str, ...]) -> None:
    if reduction not in allowed:
        raise ValueError(f"{op}: reduction={reduction!r} is not one of {allowed}")
