"""A model defined outside xlatrain, trained through `model.name: custom` (see custom_model.yaml).

The contract: an nnx.Module whose constructor takes the config's `model.kwargs` plus `rngs`, and whose
`__call__(inputs)` returns logits (cross_entropy) or predictions (mse). Accept `rngs=None` in
`__call__` to receive a dropout key while training (None at evaluation).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from xlatrain.models.axes import axes


class ResidualMLP(nnx.Module):
    def __init__(self, in_features: int, width: int, depth: int, classes: int, dropout: float = 0.0,
                 *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(in_features, width, kernel_metadata=axes(None, "hidden"), rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(width, width, kernel_metadata=axes("hidden", "mlp"), rngs=rngs)
                                for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.out = nnx.Linear(width, classes, rngs=rngs)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, x, *, rngs: jax.Array | None = None):
        h = self.inp(jnp.reshape(x, (x.shape[0], -1)))
        for block in self.blocks:
            h = h + self.dropout(jax.nn.gelu(block(h)), deterministic=rngs is None, rngs=rngs)
        return self.out(self.norm(h))
