"""Order-sensitive uint32 checksums of arrays, computed on the devices: the same-on-every-replica check after init
and the integrity check of every checkpoint both compare these."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from xlatrain.compat.multihost import gather_to_host


def fingerprint(x: jax.Array) -> jax.Array:
    """A uint32 checksum of x's bits that changes when any element, or the order of elements, changes."""
    flat = jnp.ravel(x)
    if flat.dtype == jnp.bool_:
        bits = flat.astype(jnp.uint32)
    elif flat.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(flat, jnp.uint32).ravel()
    else:
        bits = jax.lax.bitcast_convert_type(flat, jnp.dtype(f"uint{8 * flat.dtype.itemsize}")).astype(jnp.uint32)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


def tree_fingerprints(tree: Any) -> dict[str, int]:
    """{leaf path: checksum of the whole (global) leaf}, computed where the leaves live; independent of how the
    leaves are sharded, so a checkpoint restored onto another mesh checks against the same values."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        return {}
    sums = jax.jit(lambda *xs: jnp.stack([fingerprint(x) for x in xs]))(*(leaf for _, leaf in leaves))
    values = gather_to_host(sums)
    return {jax.tree_util.keystr(path): int(v) for (path, _), v in zip(leaves, values, strict=True)}
