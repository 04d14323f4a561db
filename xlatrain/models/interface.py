"""The model interface the step is written against, whatever framework wrote the model.

A model is its parameters (trainable), its model state (non-trainable values the forward may update,
such as BatchNorm running statistics; empty for most models) and a pure function applying both to a
batch. `xlatrain.models.flax_module` and `xlatrain.torch_bridge.module` build one from an nnx.Module
and from a torch nn.Module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import jax

from xlatrain.data.spec import DOCUMENT_KEYS

Tree = Any
PARTLY_FROZEN = "partly"
"""ModelDef.frozen of a stacked parameter whose layers are frozen in some blocks and not in others."""


class Documents(NamedTuple):
    """Where the documents packed into a batch's rows are: what attention and positions need to stay in one."""

    segment_ids: jax.Array
    """[..., L] int32: 1, 2, ... for the documents of a row, 0 on padding. A position attends only its own."""
    positions: jax.Array
    """[..., L] int32: each position's index within its document."""


class Reported(NamedTuple):
    """A model's outputs with what its layers reported beside them (blocks.BlockStack: an MoE layer's router
    statistics, stacked [layers, ...]), which the step turns into losses and metrics (ModelDef.reports)."""

    outputs: jax.Array
    reports: Any


def outputs_and_reports(outputs: Any) -> tuple[jax.Array, Any]:
    """(the outputs, their layers' reports or None)."""
    return (outputs.outputs, outputs.reports) if isinstance(outputs, Reported) else (outputs, None)


def documents_of(batch: dict) -> Documents | None:
    """A batch's Documents (packed data, DataSpec.documents), or None."""
    return Documents(*(batch[key] for key in DOCUMENT_KEYS)) if DOCUMENT_KEYS[0] in batch else None


Run = Callable[[Tree, Tree, jax.Array, "jax.Array | None", "Documents | None"], tuple[jax.Array, Tree]]


@dataclass(frozen=True)
class ModelDef:
    logical_axes: Tree
    """Per parameter, a name (or None) for each dimension: how zero1/fsdp shard it (xlatrain/sharding.py)."""
    init: Callable[[jax.Array], tuple[Tree, Tree]]
    """key -> (params, model state), traceable, so it can run abstractly or under jit."""
    run: Run
    """(params, model state, inputs, key, documents) -> (outputs, new model state). A key means training (dropout
    draws from it, BatchNorm uses batch statistics and updates its running ones); None means evaluation.
    `documents`: packed data's Documents (None otherwise), given only to a model that takes_documents."""
    logical_rules: dict[str, tuple[str, ...]] = field(default_factory=dict)
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

    takes_documents: bool = False
    """Whether the model keeps attention and positions inside the documents of packed data (data.packing)."""
    reports: Any = None
    """What the step makes of the reports of a model whose outputs are `Reported` (the MoE layers' losses, metrics
    and balancing bias: xlatrain.models.experts.RouterBalance); None for a model without."""

    def rules(self, configured: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        """parallel.logical_rules over the model's own rules."""
        return {**self.logical_rules, **configured}

    def apply(self, params: Tree, inputs: jax.Array, key: jax.Array | None = None,
              model_state: Tree | None = None, documents: Documents | None = None) -> jax.Array:
        """The outputs alone (without their layers' reports); a model with model state must be given it."""
        return outputs_and_reports(self.run(params, {} if model_state is None else model_state, inputs, key,
                                             documents)[0])[0]
