"""How the devices of a context group meet inside a per-device program (parallel.mode=shard_map, pipelines): the
collectives its attention uses (xlatrain/models/context.py), XLA's or xlatrain's custom calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlatrain.mesh import CONTEXT
from xlatrain.models.context import ContextAttention, ContextGroup, next_in_ring, xla_context_group


def context_group(size: int, kind: ContextAttention, impl: str, timeout_s: float) -> ContextGroup:
    if impl != "custom":
        return xla_context_group(size, kind)
    from xlatrain import custom_calls as ops

    ring = next_in_ring(size)

    def shift(tree):
        return jax.tree.map(lambda x: ops.ppermute(x, CONTEXT, ring, timeout_s=timeout_s), tree)

    def gather(x):
        return jnp.moveaxis(ops.all_gather(jnp.moveaxis(x, 1, 0), CONTEXT, tiled=True, timeout_s=timeout_s), 0, 1)

    return ContextGroup(size, kind, shift, gather, index=lambda: jax.lax.axis_index(CONTEXT))
