"""LoRA (Hu et al., PEFT's layout): a projection W x + b becomes W x + b + (alpha / r) B A dropout(x), W and b frozen,
A [in, r] and B [r, out] trained. The base weights keep their paths (`q/kernel`), so that Hugging Face weights
load into them and a run without adapters reads them alike; the adapters sit beside them (`q/lora_a`,
`q/lora_b`). A is drawn as PEFT draws lora_A (kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B is
zero, so that training starts from the base model.

What trains is every adapter and nothing else: `trains(path)` says it of a parameter's path, and `stop_frozen`
stops the gradient of the rest wherever the model's parameters enter a forward (the whole model, a pipeline's
pieces), so that no backward computes a frozen weight's gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype

from xlatrain.models.axes import axes
from xlatrain.models.linear import dense_dot_general, linear

ADAPTERS = ("lora_a", "lora_b")
"""The names of an adapted projection's trained parameters."""
RANK_AXIS = "lora"
"""The logical name of an adapter's rank dimension, which no rule splits. Inside a tensor group an adapter held whole
gets only each device's part of its gradient (lora_a of a column-parallel projection sees each device's output
columns; lora_b of a row-parallel one each device's input rows), which the group sums."""


@dataclass(frozen=True)
class LoRAShape:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nnx.Linear):
    """nnx.Linear (with dense_dot_general's weight gradient) and a low-rank adapter beside it."""

    def __init__(self, in_features: int, out_features: int, lora: LoRAShape, *, in_axis: str | None,
                 out_axis: str | None, rngs: nnx.Rngs, **kwargs):
        super().__init__(in_features, out_features, dot_general=dense_dot_general, rngs=rngs, **kwargs)
        bound = in_features ** -0.5
        self.lora_a = nnx.Param(jax.random.uniform(rngs.params(), (in_features, lora.rank), jnp.float32, -bound,
                                                   bound), **axes(in_axis, RANK_AXIS))
        self.lora_b = nnx.Param(jnp.zeros((lora.rank, out_features), jnp.float32), **axes(RANK_AXIS, out_axis))
        self.lora_scale, self.lora_dropout = lora.scale, lora.dropout

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        return super().__call__(x) + self.delta(x, key)

    def delta(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """(alpha / r) B A dropout(x): the adapter's part of the output."""
        if key is not None and self.lora_dropout > 0:
            kept = jax.random.bernoulli(key, 1.0 - self.lora_dropout, x.shape)
            x = jnp.where(kept, x / (1.0 - self.lora_dropout), 0).astype(x.dtype)
        x, a, b = promote_dtype((x, self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        low = dense_dot_general(x, a, (((x.ndim - 1,), (0,)), ((), ())))
        return dense_dot_general(low, b, (((low.ndim - 1,), (0,)), ((), ()))) * jnp.asarray(self.lora_scale,
                                                                                            low.dtype)


def projection(in_features: int, out_features: int, name: str, lora: LoRAShape | None, *, in_axis: str | None,
               out_axis: str | None, rngs: nnx.Rngs, **kwargs) -> nnx.Linear:
    """The projection `name` (LoRAConfig's targets' names): a LoRALinear where `lora` adapts it, else linear."""
    metadata = dict(kernel_metadata=axes(in_axis, out_axis), bias_metadata=axes(out_axis))
    if lora is not None and name in lora.targets:
        return LoRALinear(in_features, out_features, lora, in_axis=in_axis, out_axis=out_axis, rngs=rngs,
                          **metadata, **kwargs)
    return linear(in_features, out_features, rngs=rngs, **metadata, **kwargs)


def projected(layer: nnx.Linear, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """layer(x), with the adapter's dropout key where it has one."""
    return layer(x, key) if isinstance(layer, LoRALinear) else layer(x)


def trains(path: tuple) -> bool:
    """Whether a parameter (by its path of keys) trains in a model with adapters: the adapters alone."""
    return bool(path) and str(path[-1]) in ADAPTERS


def stop_frozen(params: Any, trained: Callable[[tuple], bool] | None) -> Any:
    """`params` with the gradient stopped at every leaf that does not train (`trained` of its path; None: all
    train)."""
    if trained is None:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf if trained(keys_of(path)) else jax.lax.stop_gradient(leaf), params)


def keys_of(path: tuple) -> tuple:
    """A jax tree path as the keys (and indices) it names."""
    return tuple(getattr(entry, "key", getattr(entry, "idx", entry)) for entry in path)


def base_of(tree: Any) -> Any:
    """A params-shaped nested dict without the adapters: the base model's parameters."""
    if not isinstance(tree, dict):
        return tree
    return {key: base_of(value) for key, value in tree.items() if key not in ADAPTERS}


def has_adapters(tree: Any) -> bool:
    return isinstance(tree, dict) and any(key in ADAPTERS or has_adapters(value) for key, value in tree.items())


def adapters_of(tree: Any) -> Any:
    """A params-shaped nested dict of the adapters alone."""
    found = {}
    for key, value in tree.items():
        if key in ADAPTERS:
            found[key] = value
        elif isinstance(value, dict) and has_adapters(value):
            found[key] = adapters_of(value)
    return found


def merged(params: Any, scale: float) -> Any:
    """The base parameters with each adapter merged into its kernel: W + (alpha / r) A B, as PEFT's
    merge_and_unload (numpy or jax arrays, stacked layers first)."""
    if not isinstance(params, dict):
        return params
    if "lora_a" in params:
        a, b = params["lora_a"], params["lora_b"]
        delta = (a @ b) * scale
        return {**{k: merged(v, scale) for k, v in params.items() if k not in ADAPTERS},
                "kernel": params["kernel"] + delta.astype(params["kernel"].dtype)}
    return {key: merged(value, scale) for key, value in params.items()}


def joined(*trees: Any) -> Any:
    """Nested dicts as one, a later tree's leaf in place of an earlier one's (a base's and its adapters'; a model's
    own initialisation and what checkpoints give)."""
    found: dict = {}
    for tree in trees:
        for key, value in tree.items():
            found[key] = joined(found[key], value) if key in found and isinstance(value, dict) else value
    return found


def adapters_off(params: Any) -> Any:
    """The params with each adapter's B zero: the model computes its base alone (PEFT's disable_adapter)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.zeros_like(leaf) if keys_of(path)[-1] == "lora_b" else leaf, params)
