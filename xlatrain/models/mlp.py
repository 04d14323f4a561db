"""A multi-layer perceptron classifier (or regressor, with loss: mse)."""

import jax
import jax.numpy as jnp
from flax import nnx

from xlatrain.models.axes import axes
from xlatrain.models.linear import linear


class MLP(nnx.Module):
    def __init__(self, in_features: int, hidden: tuple[int, ...], num_outputs: int, dropout: float,
                 *, rngs: nnx.Rngs):
        sizes = (in_features, *hidden)
        self.hidden = nnx.List([
            linear(a, b, kernel_metadata=axes("embed", "hidden"), bias_metadata=axes("hidden"),
                   rngs=rngs)
            for a, b in zip(sizes[:-1], sizes[1:], strict=True)
        ])
        self.head = linear(sizes[-1], num_outputs, kernel_metadata=axes("hidden", None),
                           bias_metadata=axes(None), rngs=rngs)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, x, *, rngs: jax.Array | None = None):
        x_BxF = jnp.reshape(x, (x.shape[0], -1)).astype(self.head.kernel.get_value().dtype)
        for layer in self.hidden:
            x_BxF = self.dropout(jax.nn.relu(layer(x_BxF)), deterministic=rngs is None, rngs=rngs)
        return self.head(x_BxF)
