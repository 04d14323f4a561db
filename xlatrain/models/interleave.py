"""Layers of two kinds from two stacks, run in one order: an MoE decoder's dense layers first and then every n-th
layer with experts (model.moe.dense_layers_first, interleave).

Each stack holds its kind's layers [its layers, ...] in their order. They run as the leading layers of the first
kind, then groups (the first kind's layers before each of the second's, then that one), then the trailing layers
of the first kind, each a scan (or unrolled, as the model's layers are), so that a program traces each kind of layer
once however many layers there are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from xlatrain.models.blocks import unstack_layers

LayerFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]
"""(one layer's params, x, its inputs) -> (x, its outputs); the inputs and outputs are pytrees (None: none)."""


@dataclass(frozen=True)
class Interleaving:
    layers: int
    second: tuple[int, ...]
    """The numbers of the second kind's layers, evenly spaced (at least one)."""

    @property
    def first(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.layers) if i not in self.second)

    @property
    def between(self) -> int:
        """The first kind's layers in each group, before its layer of the second kind."""
        return self.second[1] - self.second[0] - 1 if len(self.second) > 1 else 0

    @property
    def leading(self) -> int:
        return self.second[0] - self.between

    def __post_init__(self):
        gaps = set(np.diff(self.second).tolist())
        if not self.second or len(gaps) > 1:
            raise ValueError(f"layers {self.second} of {self.layers} are not evenly spaced")


def interleaving_of(layers: int, second: tuple[int, ...]) -> Interleaving | None:
    """The order of `layers` layers of which those numbered `second` are of the second kind; None where every layer
    is of one kind."""
    return Interleaving(layers, second) if 0 < len(second) < layers else None


def run_interleaved(order: Interleaving, first: LayerFn, second: LayerFn, params_first: Any, params_second: Any,
                    x: jax.Array, inputs_L: Any, scan: bool) -> tuple[jax.Array, Any, Any]:
    """(x, the first kind's outputs stacked in their stack's order, the second's) of x through every layer in
    order; `inputs_L`: each layer's inputs, stacked [layers, ...] in the layers' order."""
    lead, between, groups = order.leading, order.between, len(order.second)
    dense_in_groups = lead + groups * between

    def inputs_of(numbers) -> Any:
        return jax.tree.map(lambda a: a[np.asarray(numbers, np.int32)], inputs_L)

    def group(params, x, inputs):
        (dense_params, layer_params), (dense_inputs, layer_inputs) = params, inputs
        x, dense_out = _run(first, dense_params, x, dense_inputs, between, scan) if between else (x, None)
        x, out = second(layer_params, x, layer_inputs)
        return x, (dense_out, out)

    def first_kind(start: int, stop: int, x: jax.Array) -> tuple[jax.Array, Any]:
        if start == stop:
            return x, None
        params = jax.tree.map(lambda a: a[start:stop], params_first)
        return _run(first, params, x, inputs_of(order.first[start:stop]), stop - start, scan)

    x, lead_out = first_kind(0, lead, x)
    group_dense = jax.tree.map(lambda a: a[lead:dense_in_groups].reshape(groups, between, *a.shape[1:]),
                               params_first)
    group_inputs = (jax.tree.map(lambda a: a.reshape(groups, between, *a.shape[1:]),
                                 inputs_of(order.first[lead:dense_in_groups])), inputs_of(order.second))
    x, (grouped_out, second_out) = _run(group, (group_dense, params_second), x, group_inputs, groups, scan)
    x, trail_out = first_kind(dense_in_groups, len(order.first), x)
    grouped_out = None if grouped_out is None else jax.tree.map(
        lambda a: a.reshape(groups * between, *a.shape[2:]), grouped_out)
    pieces = [out for out in (lead_out, grouped_out, trail_out) if out is not None]
    first_out = jax.tree.map(lambda *a: jnp.concatenate(a), *pieces) if pieces else None
    return x, first_out, second_out


def in_layer_order(order: Interleaving, first_out: Any, second_out: Any) -> Any:
    """Per-layer outputs of both kinds [layers, ...] in the layers' order."""
    back = np.argsort(np.asarray(order.first + order.second))
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b])[back], first_out, second_out)


def _run(fn: LayerFn, params_N: Any, x: jax.Array, inputs_N: Any, count: int, scan: bool) -> tuple[jax.Array, Any]:
    """x through `count` layers of one kind, their outputs stacked (None when they have none)."""
    if scan:
        return jax.lax.scan(lambda x, layer: fn(layer[0], x, layer[1]), x, (params_N, inputs_N))
    found = []
    for index, params in enumerate(unstack_layers(params_N, count)):
        x, out = fn(params, x, jax.tree.map(lambda a: a[index], inputs_N))
        found.append(out)
    return x, None if found[0] is None else jax.tree.map(lambda *o: jnp.stack(o), *found)
