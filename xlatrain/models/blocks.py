"""Models made of repeated blocks: `before_blocks` -> L identical blocks -> `after_blocks`.

Such a model runs as one program (its blocks under `lax.scan`, or unrolled) or as a pipeline, where
xlatrain cuts the stacked blocks into chunks and places the chunks on the stages (xlatrain/pipeline).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from xlatrain.models.interface import Documents, Reported
from xlatrain.models.lora import stop_frozen

BLOCKS = "blocks"
"""The attribute (and top-level parameter key) that holds the stacked blocks."""
DENSE_BLOCKS = "dense_blocks"
"""Where an MoE decoder with dense layers among its expert layers keeps the dense ones, stacked likewise
(models/interleave.py); its `blocks` are those with experts."""
STACKS = (BLOCKS, DENSE_BLOCKS)
"""The top-level parameter keys whose leaves stack layers [layers, ...]."""

ApplyLayer = Callable[[Any, jax.Array, "jax.Array | None", "Documents | None", "jax.Array | None"], Any]
"""(one layer's params, x, dropout key, documents, the layer's number) -> x, or (x, the layer's report)."""


class BlockStack(nnx.Module):
    """Base class of a model that can be pipelined. In `__init__` a subclass sets

        self.blocks = stack_blocks(make_block, layers, rngs)   # every param gets a leading [layers] axis
        self.scan_blocks = True                                # optional: False unrolls the layers

    and defines `before_blocks(inputs) -> x` and `after_blocks(x) -> outputs`. A block is an nnx.Module
    called as `block(x, rngs=key) -> x` with the shape and dtype of x unchanged; `key` is a dropout key
    while training (one per layer) and None at evaluation. `before_blocks` and `after_blocks` take no key.

    Packed documents (data.packing): a model whose `before_blocks` and blocks also take a keyword `documents`
    (xlatrain.models.interface.Documents: segment ids and positions) is given it, in every block and in every
    pipeline chunk; one that does not is refused packed data (`takes_documents`).

    Layers of several kinds (e.g. sliding-window and full attention) share one stacked block: a model that sets
    `numbered_layers = True` gets each block called with `layer=` its number (an int32 scalar, traced: in a scan
    and in a pipeline's chunk, one program serves every layer), from which the block reads its kind.

    A block may return `(x, report)`, a pytree of what it observed (an MoE layer's router statistics): the model's
    outputs are then `Reported(outputs, reports)`, the reports stacked [layers, ...] (models/interface.py).
    """

    scan_blocks: bool = True
    numbered_layers: bool = False

    def before_blocks(self, inputs: jax.Array) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__} must define before_blocks(inputs)")

    def after_blocks(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__} must define after_blocks(x)")

    def __call__(self, inputs: jax.Array, *, rngs: jax.Array | None = None,
                 documents: Documents | None = None) -> jax.Array:
        x = self.run_layers(with_documents(self.before_blocks, documents)(inputs),
                            layer_keys(rngs, self.layer_count()), documents)
        if isinstance(x, tuple):
            return Reported(self.after_blocks(x[0]), x[1])
        return self.after_blocks(x)

    def layer_count(self) -> int:
        return block_count(nnx.state(getattr(self, BLOCKS), nnx.Param))

    def run_layers(self, x: jax.Array, keys_L: jax.Array | None, documents: Documents | None) -> Any:
        """x through every layer; (x, the layers' reports stacked) for blocks that report."""
        graphdef, params_Lx = nnx.split(getattr(self, BLOCKS))
        return run_blocks(layer_applier(graphdef), params_Lx, x, keys_L, scan=self.scan_blocks, documents=documents,
                          layers=layer_numbers(self.numbered_layers, 0, block_count(params_Lx)))


def with_documents(fn: Callable, documents: Documents | None) -> Callable:
    """`fn`, given `documents=` when there are any (a model that takes none is never given them)."""
    return fn if documents is None else lambda *args, **kwargs: fn(*args, **kwargs, documents=documents)


def takes_documents(fn: Callable) -> bool:
    return "documents" in inspect.signature(fn).parameters


def in_blocks(path: tuple) -> bool:
    """Whether a params leaf at `path` (jax's key path) is one of a BlockStack's stacked layers."""
    return bool(path) and getattr(path[0], "key", None) in STACKS


def split_blocks(params: dict) -> tuple[Any, dict]:
    """(the stacked blocks' params, everything else) of a BlockStack's params dict."""
    return params[BLOCKS], {k: v for k, v in params.items() if k != BLOCKS}


def stack_blocks(make_block: Callable[[nnx.Rngs], nnx.Module], layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """`layers` blocks as one module whose parameters carry a leading [layers] axis."""

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs: nnx.Rngs) -> nnx.Module:
        return make_block(layer_rngs)

    return make(rngs)


def layer_applier(block_graphdef: Any) -> ApplyLayer:
    """(one layer's params, x, key, documents, layer) -> x for the blocks described by `block_graphdef`."""
    def apply(params, x, key, documents, layer):
        block = with_documents(nnx.merge(block_graphdef, params), documents)
        return block(x, rngs=key) if layer is None else block(x, rngs=key, layer=layer)

    return apply


def layer_numbers(numbered: bool, first: jax.Array | int, count: int) -> jax.Array | None:
    """The numbers of `count` layers from `first` on, for a model whose blocks take them (None otherwise)."""
    return first + jnp.arange(count, dtype=jnp.int32) if numbered else None


def block_count(params_Lx: Any) -> int:
    return jax.tree.leaves(params_Lx)[0].shape[0]


def layer_keys(key: jax.Array | None, layers: int) -> jax.Array | None:
    """One dropout key per layer (None at evaluation); a pipeline derives a chunk's keys the same way."""
    return None if key is None else jax.random.split(key, layers)


def run_blocks(apply_layer: ApplyLayer, params_Lx: Any, x: jax.Array, keys_L: jax.Array | None, *,
               scan: bool, active: jax.Array | None = None, documents: Documents | None = None,
               layers: jax.Array | None = None) -> jax.Array:
    """x through the layers of `params_Lx` in order; (x, the layers' reports stacked) for blocks that report.
    `active`: how many leading layers run (the rest are a pipeline chunk's padding, which report zeros), or None
    for all of them. `layers`: each layer's number, for blocks that read their kind from it (None: blocks that take
    none)."""
    count = block_count(params_Lx)

    def one(x, index, params, key, layer):
        def apply():
            out = apply_layer(params, x, key, documents, layer)
            return out if isinstance(out, tuple) else (out, None)

        if active is None:
            return apply()
        reports = jax.eval_shape(apply)[1]
        return jax.lax.cond(index < active, apply,
                            lambda: (x, jax.tree.map(lambda r: jnp.zeros(r.shape, r.dtype), reports)))

    if scan:
        def body(x, layer):
            return one(x, *layer)

        x, reports = jax.lax.scan(body, x, (jnp.arange(count), params_Lx, keys_L, layers))
    else:
        found = []
        for index, params in enumerate(unstack_layers(params_Lx, count)):
            x, report = one(x, index, params, None if keys_L is None else keys_L[index],
                            None if layers is None else layers[index])
            found.append(report)
        reports = None if found[0] is None else jax.tree.map(lambda *r: jnp.stack(r), *found)
    return x if reports is None else (x, reports)


def unstack_layers(params_Lx: Any, layers: int) -> list[Any]:
    """One params pytree per layer. Split rather than indexed: the gradient of a split is one concatenate of the
    layers' gradients, where indexing's is a stacked-size array per layer, zero but for its layer, and their sum
    (bench.unrolled_layers: 12 layers of width 128 move 0.82x the bytes per train step; its time, 0.99x, is within
    the noise)."""
    leaves, treedef = jax.tree.flatten(params_Lx)
    pieces = [jax.lax.split(leaf, [1] * layers) for leaf in leaves]
    return [treedef.unflatten([leaf_pieces[index][0] for leaf_pieces in pieces]) for index in range(layers)]


class BlockParts:
    """A BlockStack model run piece by piece (a pipeline's chunks): `before`, a run of blocks, `after`.

    Every method takes a params pytree in the model's structure; `before` and `after` ignore what sits
    under "blocks" (any arrays of the right tree structure will do, e.g. one chunk's blocks). `documents`: the
    microbatch's packed documents (None when it has none), which every chunk reads from its microbatch."""

    def __init__(self, abstract_model: BlockStack, trained: Callable[[tuple], bool] | None = None):
        """`trained`: whether a parameter trains, by its path (None: every one); the others' gradients stop."""
        self.graphdef = nnx.split(abstract_model, nnx.Param, ...)[0]
        blocks = getattr(abstract_model, BLOCKS)
        block_graphdef, params_Lx = nnx.split(blocks, nnx.Param, ...)[:2]
        applied = layer_applier(block_graphdef)
        self.layer = applied if trained is None else (
            lambda params, *rest: applied(stop_frozen(params, trained), *rest))
        self.trained = trained
        self.layers = block_count(params_Lx)
        self.scan = abstract_model.scan_blocks
        self.numbered = abstract_model.numbered_layers
        self.takes_documents = takes_documents(abstract_model.before_blocks) and takes_documents(type(blocks).__call__)

    def before(self, params: dict, inputs: jax.Array, documents: Documents | None = None) -> jax.Array:
        params = stop_frozen(params, self.trained)
        return with_documents(nnx.merge(self.graphdef, params).before_blocks, documents)(inputs)

    def after(self, params: dict, x: jax.Array) -> jax.Array:
        return nnx.merge(self.graphdef, stop_frozen(params, self.trained)).after_blocks(x)

    def run(self, params_Nx: Any, x: jax.Array, keys_N: jax.Array | None, active: jax.Array | None = None,
            documents: Documents | None = None, layers: jax.Array | None = None) -> jax.Array:
        """A chunk: x through the blocks of `params_Nx` (the first `active` of them, when given); `layers`: their
        numbers, when the model's blocks take them (chunk_layers)."""
        return run_blocks(self.layer, params_Nx, x, keys_N, scan=self.scan, active=active, documents=documents,
                          layers=layers)
