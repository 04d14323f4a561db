"""How the devices of a tensor group meet inside a per-device program: the collectives the models' regions use
(XLA's or xlatrain's custom calls, xlatrain/tensor_group.py), and which gradients are each device's part of
the sum, to be summed over the group before the replicas meet."""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from xlatrain.mesh import TENSOR
from xlatrain.sharding import dim_over
from xlatrain.tensor_group import TensorGroup

Tree = Any


def tensor_group(size: int, sequence_parallel: bool, impl: str, timeout_s: float) -> TensorGroup:
    if impl == "custom":
        from xlatrain import custom_calls as ops

        return TensorGroup(size, sequence_parallel,
                           all_reduce=lambda x: ops.all_reduce(x, TENSOR, timeout_s=timeout_s),
                           maximum=lambda x: ops.all_reduce(x, TENSOR, "max", timeout_s=timeout_s),
                           all_gather=lambda x: ops.all_gather(x, TENSOR, tiled=True, timeout_s=timeout_s),
                           reduce_scatter=lambda x: ops.reduce_scatter(x, TENSOR, timeout_s=timeout_s),
                           index=lambda: jax.lax.axis_index(TENSOR))
    return TensorGroup(size, sequence_parallel,
                       all_reduce=lambda x: jax.lax.psum(x, TENSOR), maximum=lambda x: jax.lax.pmax(x, TENSOR),
                       all_gather=lambda x: jax.lax.all_gather(x, TENSOR, tiled=True),
                       reduce_scatter=lambda x: jax.lax.psum_scatter(x, TENSOR, tiled=True),
                       index=lambda: jax.lax.axis_index(TENSOR))


def split_over_tensor(spec: P) -> bool:
    return dim_over(spec, TENSOR) is not None


def partial_gradients(specs: Tree, logical_axes: Tree, whole_names: tuple[str, ...], sequence_parallel: bool,
                      ) -> Tree:
    """Per param, whether each device of a tensor group computes only its part of the gradient: a parameter held
    whole that the regions use on each device's part of something (the key/value projections of
    `whole_names` that each device takes its heads of; with sequence parallelism every whole parameter, used
    on each device's part of the sequence). `specs`: the params' specs, in the model's layout or the stage
    layout (whose extra leading axes carry no logical name)."""

    def partial(spec: P, names: tuple) -> bool:
        return not split_over_tensor(spec) and (sequence_parallel or any(name in whole_names for name in names))

    return jax.tree.map(partial, specs, logical_axes, is_leaf=lambda x: isinstance(x, P))


def summed_over_tensor(group: TensorGroup, partial: Tree) -> Callable[[Tree], Tree]:
    """gradients -> the gradients with each device's parts summed over the group where `partial` says so."""
    return lambda grads: jax.tree.map(lambda g, p: group.all_reduce(g) if p else g, grads, partial)
