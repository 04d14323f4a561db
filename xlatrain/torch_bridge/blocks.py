"""A torch module's repeated blocks, stacked so that xlatrain can pipeline it (and shard them like a
BlockStack's).

The contract, like BlockStack's: the module keeps L blocks of identical structure in an nn.ModuleList
attribute (`model.blocks`, default `blocks`) and defines `before_blocks(inputs) -> x` and
`after_blocks(x) -> outputs`; a block is called as `block(x) -> x` (its dropout draws from xlatrain's
key). Its own `forward` still defines the unpipelined model; a pipeline runs `before_blocks`, the blocks
chunk by chunk, then `after_blocks` (these two without dropout, as a BlockStack's).

Stacked, the blocks' params are `params["blocks"][name within a block]` with a leading [L] axis.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from xlatrain.models.blocks import BLOCKS, run_blocks
from xlatrain.models.interface import Documents


@dataclass(frozen=True)
class BlockStacking:
    attr: str
    layers: int
    names: tuple[str, ...]
    """Parameter names within one block."""

    def full_name(self, layer: int, name: str) -> str:
        return f"{self.attr}.{layer}.{name}"

    def _rest(self, tree: dict) -> dict:
        return {k: v for k, v in tree.items() if not k.startswith(f"{self.attr}.") and k != BLOCKS}

    def stack(self, flat: dict) -> dict:
        return {**self._rest(flat), BLOCKS: {n: np.stack([flat[self.full_name(i, n)] for i in range(self.layers)])
                                             for n in self.names}}

    def stack_axes(self, flat_axes: dict) -> dict:
        """Logical axes of the stacked params: block 0's, after an unnamed [L] axis."""
        return {**self._rest(flat_axes), BLOCKS: {n: (None, *flat_axes[self.full_name(0, n)]) for n in self.names}}

    def unstack(self, params: dict) -> dict:
        blocks = params[BLOCKS]
        return {**self._rest(params), **{self.full_name(i, n): blocks[n][i] for n in self.names
                                         for i in range(self.layers)}}


def block_stacking(module: Any, attr: str) -> tuple[BlockStacking | None, str | None]:
    """(the stacking, None) when `module` keeps the contract; otherwise (None, why not)."""
    import torch

    blocks = getattr(module, attr, None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        return None, f"it has no non-empty nn.ModuleList attribute {attr!r} (model.blocks names it)"
    if not all(callable(getattr(module, m, None)) for m in ("before_blocks", "after_blocks")):
        return None, "it does not define before_blocks(inputs) and after_blocks(x)"
    signatures = [[(n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()] for block in blocks]
    if any(s != signatures[0] for s in signatures):
        return None, f"the blocks in {attr!r} differ in their parameters"
    if any(True for block in blocks for _ in block.buffers()) or not all(
            differentiable(p) for block in blocks for p in block.parameters()):
        return None, (f"the blocks in {attr!r} hold buffers or integer parameters, which are model state (a pipeline "
                      "passes only activations between stages)")
    names = tuple(n for n, _, _ in signatures[0])
    stacking = BlockStacking(attr, len(blocks), names)
    owned = {n for n, _ in module.named_parameters()}
    if any(stacking.full_name(i, n) not in owned for i in range(len(blocks)) for n in names) or BLOCKS in owned:
        return None, f"a parameter of the blocks in {attr!r} is shared with another part of the module"
    return stacking, None


def differentiable(tensor: Any) -> bool:
    """A parameter torch can train: an integer one (a quantized weight) is model state."""
    return tensor.is_floating_point() or tensor.is_complex()


class TorchBlockParts:
    """A torch module run piece by piece, with the interface of xlatrain.models.blocks.BlockParts."""

    scan = True
    numbered = False

    def __init__(self, torch_module: Any, stacking: BlockStacking):
        module = torch_module.module
        self.torch_module = torch_module
        self.layers = stacking.layers
        self._template = getattr(module, stacking.attr)[0]
        self._before = _method_as_module(module, "before_blocks")
        self._after = _method_as_module(module, "after_blocks")
        self.takes_documents = (takes_segment_ids(module.before_blocks) and takes_segment_ids(self._template.forward))

    def layer(self, params: dict, x: jax.Array, key: jax.Array | None, documents: Documents | None = None,
              layer: None = None) -> jax.Array:
        return self.torch_module.call(self._template, params, {}, x, key, documents)[0]

    def before(self, params: dict, inputs: jax.Array, documents: Documents | None = None) -> jax.Array:
        return self.torch_module.call(self._before, _inner(params), {}, inputs, None, documents)[0]

    def after(self, params: dict, x: jax.Array) -> jax.Array:
        return self.torch_module.call(self._after, _inner(params), {}, x, None)[0]

    def run(self, params_Nx: Any, x: jax.Array, keys_N: jax.Array | None, active: jax.Array | None = None,
            documents: Documents | None = None, layers: None = None) -> jax.Array:
        return run_blocks(self.layer, params_Nx, x, keys_N, scan=self.scan, active=active, documents=documents)


def takes_segment_ids(forward: Callable) -> bool:
    """Whether a torch forward keeps attention inside packed documents: it takes a keyword `segment_ids`."""
    return "segment_ids" in inspect.signature(forward).parameters


def document_arguments(forward: Callable, documents: Documents | None) -> dict[str, jax.Array]:
    """The keywords of Documents that `forward` takes (`segment_ids`, `positions`, or HF's `position_ids`)."""
    if documents is None:
        return {}
    accepted = inspect.signature(forward).parameters
    offered = {"segment_ids": documents.segment_ids, "positions": documents.positions,
               "position_ids": documents.positions}
    return {name: value for name, value in offered.items() if name in accepted}


def _inner(params: dict) -> dict:
    return {f"inner.{k}": v for k, v in params.items() if k != BLOCKS}


def _method_as_module(module: Any, method: str) -> Any:
    """A module whose forward is `module.<method>`, its params named `inner.<name>`."""
    import torch

    class Method(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, x, **documents):
            return getattr(self.inner, method)(x, **documents)

    return Method()
