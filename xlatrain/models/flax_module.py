"""A flax nnx.Module as xlatrain's model interface: its nnx.Params are the parameters, its `ModelState` variables
(an MoE router's balancing bias) the model state."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
from flax import nnx

from xlatrain.errors import UserError
from xlatrain.models.axes import logical_axes_of
from xlatrain.models.blocks import (
    BlockParts,
    BlockStack,
    takes_documents,
    with_documents,
)
from xlatrain.models.interface import Documents, ModelDef
from xlatrain.models.lora import keys_of, stop_frozen, trains


class ModelState(nnx.Variable):
    """A module's value that trains outside the optimizer (the step updates it), kept in the train state's
    model_state."""


def takes_rngs(module: nnx.Module) -> bool:
    """Whether the module's __call__ accepts a dropout key as `rngs=` (see the model contract)."""
    return "rngs" in inspect.signature(type(module).__call__).parameters


def flax_model(factory: Callable[[nnx.Rngs], nnx.Module]) -> ModelDef:
    """The model's static structure and parameter axis names, without allocating anything."""
    abstract = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    graphdef, params, state, rest = nnx.split(abstract, nnx.Param, ModelState, ...)
    if jax.tree.leaves(rest):
        kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(rest)})
        raise UserError(f"model: only nnx.Param variables are supported as model state; found {kinds}. "
                        "Keep running statistics out of the module (e.g. use LayerNorm instead of BatchNorm)")
    flat = dict(nnx.to_flat_state(params))
    pure = nnx.to_pure_dict(params)
    axes = jax.tree_util.tree_map_with_path(
        lambda path, _: logical_axes_of(flat[keys_of(path)]), pure)
    uses_rngs = takes_rngs(abstract)
    trained = trains if getattr(abstract, "adapted", False) else None
    frozen = None if trained is None else jax.tree_util.tree_map_with_path(
        lambda path, _: not trained(keys_of(path)), pure)
    parts = BlockParts(abstract, trained) if isinstance(abstract, BlockStack) else None
    documents_taken = parts.takes_documents if parts else takes_documents(type(abstract).__call__)

    def init(key: jax.Array) -> tuple[Any, dict]:
        _, params, model_state = nnx.split(factory(nnx.Rngs(key)), nnx.Param, ModelState)
        return nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)

    def run(params: Any, model_state: dict, inputs: jax.Array, key: jax.Array | None,
            documents: Documents | None = None) -> tuple[jax.Array, dict]:
        params = stop_frozen(params, trained)
        module = with_documents(nnx.merge(graphdef, params, with_values(state, model_state)), documents)
        return (module(inputs, rngs=key) if uses_rngs else module(inputs)), model_state

    return ModelDef(axes, init, run, blocks=parts, takes_documents=documents_taken, frozen=frozen)


def with_values(state: nnx.State, values: dict) -> nnx.State:
    """A copy of `state` holding `values` (its pure dict)."""
    copy = jax.tree.map(lambda leaf: leaf, state)
    nnx.replace_by_pure_dict(copy, values)
    return copy
