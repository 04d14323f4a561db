"""Logical-axis rules -> PartitionSpecs for parameters and optimizer state (replicated, ZeRO-1, FSDP)."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def logical_spec(names: tuple[str | None, ...], shape: tuple[int, ...], rules: Mapping[str, str | None],
                 mesh: Mesh) -> P:
    """Shard each dimension whose logical name maps to a mesh axis that divides it; each axis once."""
    used, spec = set(), []
    for name, size in zip(names, shape, strict=True):
        axis = rules.get(name) if name is not None else None
        usable = axis in mesh.shape and axis not in used and mesh.shape[axis] > 1 and size % mesh.shape[axis] == 0
        spec.append(axis if usable else None)
        if usable:
            used.add(axis)
    return P(*spec)


def param_specs(abstract_params: Any, logical_axes: Any, sharded: bool, rules: Mapping[str, str | None],
                mesh: Mesh) -> Any:
    if not sharded:
        return jax.tree.map(lambda _: P(), abstract_params)
    return jax.tree.map(lambda leaf, names: logical_spec(names, leaf.shape, rules, mesh),
                        abstract_params, logical_axes, is_leaf=_is_axes)


def optimizer_specs(tx: optax.GradientTransformation, abstract_opt_state: Any, abstract_params: Any,
                    logical_axes: Any, sharded: bool, rules: Mapping[str, str | None], mesh: Mesh) -> Any:
    """Param-shaped optimizer leaves (moments) follow the param's logical axes (see specs_following_params);
    the rest is replicated."""
    if not sharded:
        return jax.tree.map(lambda _: P(), abstract_opt_state)
    wanted = param_specs(abstract_params, logical_axes, True, rules, mesh)
    return specs_following_params(tx, abstract_opt_state, abstract_params, wanted)


def specs_following_params(tx: optax.GradientTransformation, abstract_opt_state: Any, abstract_params: Any,
                           wanted: Any) -> Any:
    """Optimizer leaves shaped like their param take the param's spec `wanted`. A leaf that shares the param's
    leading dimensions up to the last one the spec splits (Adafactor's factored moments of stacked layers, kept
    per layer) takes that part of the spec; the rest is replicated. A parameter the optimizer is masked off
    (optax.masked: a frozen one) has no state, and no spec."""

    def for_leaf(leaf, spec, param):
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        shape = getattr(leaf, "shape", None)
        if shape == param.shape:
            return spec
        split = len(spec) - next((i for i, name in enumerate(reversed(spec)) if name is not None), len(spec))
        return P(*spec[:split]) if shape is not None and tuple(shape[:split]) == param.shape[:split] else P()

    return optax.tree_map_params(tx, for_leaf, abstract_opt_state, wanted, abstract_params,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, (P, optax.MaskedNode)))


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)
