"""A model defined outside xlatrain, trained through `model.name: custom` (see custom_model.yaml).

The contract: an nnx.Module whose constructor takes the config's `model.kwargs` plus `rngs`, and whose
`__call__(inputs)` returns logits (cross_entropy) or predictions (mse). Accept `rngs=None` in
`__call__` to receive a dropout key while training (None at evaluation).

This one is also a `BlockStack` (input layer -> `depth` identical residual blocks -> norm and output
layer), so it can run as a pipeline: `mesh.stage=2 parallel.mode=shard_map`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from xlatrain.models import BlockStack, stack_blocks
from xlatrain.models.axes import axes


class ResidualBlock(nnx.Module):
    def __init__(self, width: int, dropout: float, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(width, width, kernel_metadata=axes("hidden", "mlp"), rngs=rngs)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, h, *, rngs: jax.Array | None = None):
        return h + self.dropout(jax.nn.gelu(self.linear(h)), deterministic=rngs is None, rngs=rngs)


class ResidualMLP(BlockStack):
    def __init__(self, in_features: int, width: int, depth: int, classes: int, dropout: float = 0.0,
                 *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(in_features, width, kernel_metadata=axes(None, "hidden"), rngs=rngs)
        self.blocks = stack_blocks(lambda layer_rngs: ResidualBlock(width, dropout, rngs=layer_rngs), depth, rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.out = nnx.Linear(width, classes, rngs=rngs)

    def before_blocks(self, x):
        return self.inp(jnp.reshape(x, (x.shape[0], -1)))

    def after_blocks(self, h):
        return self.out(self.norm(h))
