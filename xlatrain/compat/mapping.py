"""How a per-device program is mapped over devices: `jax.shard_map` (its replication check renamed
between releases) and `jax.pmap`."""

from __future__ import annotations

from typing import Any, Callable

import jax


def shard_map(fn: Callable, mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any,
              check: bool = False) -> Callable:
    """jax.shard_map; `check` is replication/varying-axis checking (check_vma, formerly check_rep)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)


def pmap_over_rows(fn: Callable, axis_name: str, devices: list, rows_axis: int) -> Callable:
    """fn(state, batch) through jax.pmap: state broadcast to every device, the batch's `rows_axis` split
    into one block per device (in `devices` order, so blocks stay where the batch sharding put them),
    outputs taken from the (identical) replicas. Callable inside jit."""
    n = len(devices)
    mapped = jax.pmap(fn, axis_name=axis_name, in_axes=(None, rows_axis), out_axes=None, devices=devices)

    def split_rows(x: jax.Array) -> jax.Array:
        return x.reshape(*x.shape[:rows_axis], n, x.shape[rows_axis] // n, *x.shape[rows_axis + 1:])

    return lambda state, batch: mapped(state, jax.tree.map(split_rows, batch))
