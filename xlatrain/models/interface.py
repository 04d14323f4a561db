"""The model interface the step is written against, whatever framework wrote the model.

A model is its parameters (trainable), its model state (non-trainable values the forward may update,
such as BatchNorm running statistics; empty for most models) and a pure function applying both to a
batch. `xlatrain.models.flax_module` and `xlatrain.torch_bridge.module` build one from an nnx.Module
and from a torch nn.Module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax

Tree = Any
PARTLY_FROZEN = "partly"
"""ModelDef.frozen of a stacked parameter whose layers are frozen in some blocks and not in others."""
Run = Callable[[Tree, Tree, jax.Array, "jax.Array | None"], tuple[jax.Array, Tree]]


@dataclass(frozen=True)
class ModelDef:
    logical_axes: Tree
    """Per parameter, a name (or None) for each dimension: how zero1/fsdp shard it (xlatrain/sharding.py)."""
    init: Callable[[jax.Array], tuple[Tree, Tree]]
    """key -> (params, model state), traceable, so it can run abstractly or under jit."""
    run: Run
    """(params, model state, inputs, key) -> (outputs, new model state). A key means training (dropout
    draws from it, BatchNorm uses batch statistics and updates its running ones); None means evaluation."""
    logical_rules: dict[str, str | None] = field(default_factory=dict)
    """Rules for logical names of the model's own (a torch model's `sharded`), beneath parallel.logical_rules."""
    initial_values: Callable[[], tuple[Tree, Tree]] | None = None
    """Host values of (params, model state) for a model that comes with its weights (a torch module):
    the train state is created from them as program arguments, so they never become XLA constants."""
    blocks: Any = None
    """How to run the model piece by piece (xlatrain.models.blocks.BlockParts), when it can be pipelined."""
    torch: Any = None
    """The torch module behind the model (xlatrain.torch_bridge.module.TorchModule), for weights in and out."""
    not_pipelinable: str | None = None
    """Why the model cannot be pipelined, when `blocks` is None and there is more to say than "not a
    BlockStack"."""
    frozen: Tree | None = None
    """Per parameter leaf (as `init` gives them): True where none of it trains (a torch parameter with
    requires_grad=False, whose gradient `run` stops, or one the forward gives no gradient: weight decay skips
    it), PARTLY_FROZEN where only some of its stacked layers do, False elsewhere. None: every parameter trains."""

    def rules(self, configured: dict[str, str | None]) -> dict[str, str | None]:
        """parallel.logical_rules over the model's own rules."""
        return {**self.logical_rules, **configured}

    def apply(self, params: Tree, inputs: jax.Array, key: jax.Array | None = None,
              model_state: Tree | None = None) -> jax.Array:
        """The outputs alone; a model with model state must be given it."""
        return self.run(params, {} if model_state is None else model_state, inputs, key)[0]
