"""A small convolutional classifier for images (e.g. the 8x8 digits)."""

import jax
from flax import nnx

from xlatrain.models.axes import axes
from xlatrain.models.linear import linear


class CNN(nnx.Module):
    def __init__(self, image_shape: tuple[int, ...], channels: tuple[int, ...], hidden: int,
                 num_outputs: int, *, rngs: nnx.Rngs):
        height, width, in_channels = (*image_shape, 1)[:3]
        sizes = (in_channels, *channels)
        self.convs = nnx.List([
            nnx.Conv(a, b, kernel_size=(3, 3), strides=(1, 1) if i == 0 else (2, 2),
                     kernel_metadata=axes(None, None, None, "channels"),
                     bias_metadata=axes("channels"), rngs=rngs)
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
        ])
        for _ in channels[1:]:
            height, width = -(-height // 2), -(-width // 2)
        self.dense = linear(height * width * sizes[-1], hidden, kernel_metadata=axes("embed", "hidden"),
                            bias_metadata=axes("hidden"), rngs=rngs)
        self.head = linear(hidden, num_outputs, kernel_metadata=axes("hidden", None),
                           bias_metadata=axes(None), rngs=rngs)

    def __call__(self, images, *, rngs: jax.Array | None = None):
        x_BxHxWxC = images.astype(self.head.kernel.get_value().dtype)
        if x_BxHxWxC.ndim == 3:
            x_BxHxWxC = x_BxHxWxC[..., None]
        for conv in self.convs:
            x_BxHxWxC = jax.nn.relu(conv(x_BxHxWxC))
        x_BxF = x_BxHxWxC.reshape(x_BxHxWxC.shape[0], -1)
        return self.head(jax.nn.relu(self.dense(x_BxF)))
