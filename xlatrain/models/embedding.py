"""A token embedding whose table gradient is summed in float32, and on GPUs in sorted token order.

The gradient of a lookup adds each token's output gradient into its row of the table. jnp.take's own gradient
does that in the compute dtype: under the bf16 policy every occurrence of a token is rounded into a bf16 row.
In a profile of GPT-2 small's bf16 step on an H200 (byte tokens: 256 rows take every add), that scatter, fused
with its input, took 27 ms of the step's 119 ms of kernels; as a float32 sum of the gradients sorted by token it
took 0.09 ms (bench/README.md). Alone, outside the step, an unsorted float32 scatter measured faster than
the sorted sum (0.15 against 0.23 ms; bench/results/gpu.json, parts_ms): the sort is kept, on GPUs only, for what
was measured in the step.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from xlatrain.tensor_group import current_group, leave_region, part_offset


def scatter_rows(grads_NxD: jax.Array, ids_N: jax.Array, rows: int) -> jax.Array:
    """[rows, D] float32: the sum of the gradients of each id, added in the order they come."""
    return jax.ops.segment_sum(grads_NxD.astype(jnp.float32), ids_N, rows)


def sorted_rows(grads_NxD: jax.Array, ids_N: jax.Array, rows: int) -> jax.Array:
    """scatter_rows, with the gradients first sorted by id (stably: each row still adds in the order they come)."""
    order = jnp.argsort(ids_N, stable=True)
    return jax.ops.segment_sum(grads_NxD[order].astype(jnp.float32), ids_N[order], rows, indices_are_sorted=True)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table_VxD: jax.Array, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """table[ids] in `dtype`."""
    return jnp.take(table_VxD, ids, axis=0).astype(dtype)


def _lookup_forward(table_VxD, ids, dtype):
    # The table's row count and dtype, as an empty array: residuals are arrays.
    return lookup(table_VxD, ids, dtype), (ids, jnp.zeros((table_VxD.shape[0], 0), table_VxD.dtype))


def _lookup_backward(_dtype, saved, grads):
    ids, table_like = saved
    rows = table_like.shape[0]
    flat_grads, flat_ids = grads.reshape(-1, grads.shape[-1]), ids.reshape(-1)
    table_grads = jax.lax.platform_dependent(flat_grads, flat_ids, cuda=lambda g, i: sorted_rows(g, i, rows),
                                             default=lambda g, i: scatter_rows(g, i, rows))
    return table_grads.astype(table_like.dtype), None


lookup.defvjp(_lookup_forward, _lookup_backward)


class TokenEmbed(nnx.Embed):
    """nnx.Embed, with `lookup`'s gradient. Inside a tensor group each device holds a part of the vocabulary,
    looks up the ids in it (zero for the others) and the parts are summed (xlatrain/tensor_group.py)."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("token ids must be integers")
        table = self.embedding[...]
        if current_group() is None:
            return lookup(table, inputs, self.dtype or table.dtype)
        local = inputs - part_offset(table.shape[0])
        held = (local >= 0) & (local < table.shape[0])
        rows = lookup(table, jnp.where(held, local, 0), self.dtype or table.dtype)
        return leave_region(jnp.where(held[..., None], rows, jnp.zeros((), rows.dtype)))
