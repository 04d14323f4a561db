"""Tensor parallelism inside a per-device program (parallel.mode=shard_map, pipelines): each device of a tensor
group holds its part of the split parameters (whole heads, a slice of the MLP's hidden width and of the
vocabulary) and computes on it, and the regions between meet through collectives written out here, Megatron's
operators (arXiv 1909.08053, 2205.05198):

- entering a column-parallel region, the activation is the same on every device; its gradient is each
  device's part, summed over the group (or, with sequence parallelism, it is gathered along the sequence
  and its gradient reduce-scattered back);
- leaving a row-parallel region, each device holds a part of the sum: it is summed over the group (with
  sequence parallelism, reduce-scattered along the sequence), and the gradient goes back as it is (gathered).

The models call these at those places; outside such a program (one device, or parallel.mode=jit, where XLA's
partitioner inserts the collectives from `xlatrain.sharding.constrain`) each returns its input. Which collectives
run (XLA's or xlatrain's custom calls) is the program's choice (lowering/tensor_link.py).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import jax
import jax.numpy as jnp

SEQUENCE_AXIS = 1
"""Activations are [batch, length, ...]: sequence parallelism splits axis 1."""


@dataclass(frozen=True, eq=False)
class TensorGroup:
    """The devices of one tensor group, seen from one of them: its collectives over the `tensor` axis."""

    size: int
    sequence_parallel: bool
    all_reduce: Callable[[jax.Array], jax.Array]
    maximum: Callable[[jax.Array], jax.Array]
    all_gather: Callable[[jax.Array], jax.Array]
    """Concatenates the devices' arrays along axis 0."""
    reduce_scatter: Callable[[jax.Array], jax.Array]
    """Sums the devices' arrays and keeps this device's block of axis 0."""
    index: Callable[[], jax.Array]
    """This device's place in the group."""


_GROUP: ContextVar[TensorGroup | None] = ContextVar("tensor_group", default=None)


@contextlib.contextmanager
def inside_tensor_group(group: TensorGroup | None) -> Iterator[None]:
    """While a per-device step is traced: the models' tensor-parallel regions meet through `group`."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def current_group() -> TensorGroup | None:
    return _GROUP.get()


def enter_region(x_BxLxD: jax.Array) -> jax.Array:
    """The input of a column-parallel matmul (q, k, v; the MLP's first layer; the head): whole on every device."""
    group = _GROUP.get()
    if group is None:
        return x_BxLxD
    return _gather_sequence(group, x_BxLxD) if group.sequence_parallel else _copy_in(group, x_BxLxD)


def leave_region(x_BxLxD: jax.Array) -> jax.Array:
    """A row-parallel matmul's output (attention's output projection, the MLP's last layer, the embedding
    lookup), each device's part of the sum: the sum, or with sequence parallelism this device's part of the
    sequence of it. A bias is added after."""
    group = _GROUP.get()
    if group is None:
        return x_BxLxD
    return _scatter_sequence(group, x_BxLxD) if group.sequence_parallel else _sum_out(group, x_BxLxD)


def sequence_part(x_BxL: jax.Array) -> jax.Array:
    """This device's part of the sequence with sequence parallelism (what it holds between the regions: e.g.
    the positions an embedding adds); `x` as it is otherwise."""
    group = _GROUP.get()
    if group is None or not group.sequence_parallel:
        return x_BxL
    length = x_BxL.shape[SEQUENCE_AXIS] // group.size
    return jax.lax.dynamic_slice_in_dim(x_BxL, group.index() * length, length, axis=SEQUENCE_AXIS)


def dropped(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """nnx.Dropout's result on `x`; with sequence parallelism, this device's part of the mask the whole
    sequence would draw, so that every device drops what one device would."""
    if key is None or rate == 0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = 1.0 - rate
    group = _GROUP.get()
    if group is None or not group.sequence_parallel:
        mask = jax.random.bernoulli(key, keep, x.shape)
    else:
        whole = (*x.shape[:SEQUENCE_AXIS], x.shape[SEQUENCE_AXIS] * group.size, *x.shape[SEQUENCE_AXIS + 1:])
        mask = sequence_part(jax.random.bernoulli(key, keep, whole))
    return jax.lax.select(mask, x / keep, jnp.zeros_like(x))


def group_total(x: jax.Array) -> jax.Array:
    """The sum of the devices' parts (e.g. of a vocabulary-parallel softmax's terms); its gradient reaches each
    part as it is."""
    group = _GROUP.get()
    return x if group is None else _sum_out(group, x)


def group_maximum(x: jax.Array) -> jax.Array:
    """The largest of the devices' values, without a gradient."""
    group = _GROUP.get()
    return x if group is None else jax.lax.stop_gradient(group.maximum(jax.lax.stop_gradient(x)))


def part_offset(local_size: int) -> jax.Array | int:
    """Where this device's part of a split dimension starts (e.g. its first vocabulary id)."""
    group = _GROUP.get()
    return 0 if group is None else group.index() * local_size


def kv_heads_for_local_queries(x_BxLxGxK: jax.Array, kv_heads: int) -> jax.Array:
    """Grouped-query attention with fewer key/value heads than the group has devices: each device computes them
    all (their weights are whole) and keeps the one its query heads read. Its weights' gradients are then each
    device's part, which the program sums over the group (lowering/tensor_link.py)."""
    group = _GROUP.get()
    if group is None or x_BxLxGxK.shape[2] != kv_heads or kv_heads >= group.size:
        return x_BxLxGxK
    return jax.lax.dynamic_slice_in_dim(x_BxLxGxK, group.index() * kv_heads // group.size, 1, axis=2)


def _operator(forward: Callable[[TensorGroup, jax.Array], jax.Array],
              backward: Callable[[TensorGroup, jax.Array], jax.Array]) -> Callable:
    """(group, x) -> forward(group, x), whose gradient is backward(group, cotangent)."""

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def operator(group: TensorGroup, x: jax.Array) -> jax.Array:
        return forward(group, x)

    operator.defvjp(lambda group, x: (forward(group, x), None), lambda group, _, ct: (backward(group, ct),))
    return operator


def _along_sequence(collective: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """An axis-0 collective applied along the sequence axis."""
    return jnp.moveaxis(collective(jnp.moveaxis(x, SEQUENCE_AXIS, 0)), 0, SEQUENCE_AXIS)


_copy_in = _operator(lambda group, x: x, lambda group, ct: group.all_reduce(ct))
_sum_out = _operator(lambda group, x: group.all_reduce(x), lambda group, ct: ct)
_gather_sequence = _operator(lambda group, x: _along_sequence(group.all_gather, x),
                             lambda group, ct: _along_sequence(group.reduce_scatter, ct))
_scatter_sequence = _operator(lambda group, x: _along_sequence(group.reduce_scatter, x),
                              lambda group, ct: _along_sequence(group.all_gather, ct))
