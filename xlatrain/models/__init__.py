"""Model construction from config: the built-in MLP, CNN and GPT, or a user's own nnx.Module."""

import importlib
import inspect
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from xlatrain.config import CNNConfig, CustomModelConfig, GPTConfig, MLPConfig, ModelConfig
from xlatrain.data.spec import DataSpec
from xlatrain.errors import UserError
from xlatrain.models.blocks import BlockStack, stack_blocks
from xlatrain.models.cnn import CNN
from xlatrain.models.gpt import GPT, GPTShape
from xlatrain.models.mlp import MLP

__all__ = ["BlockStack", "model_factory", "stack_blocks", "takes_rngs"]


def model_factory(config: ModelConfig, spec: DataSpec,
                  compute_dtype: jnp.dtype = jnp.float32) -> Callable[[nnx.Rngs], nnx.Module]:
    """A function rngs -> module, so the caller decides where (abstractly, or under jit) it runs."""
    if isinstance(config, MLPConfig):
        features = 1
        for size in spec.input_shape:
            features *= size
        return lambda rngs: MLP(features, config.hidden, spec.num_outputs, config.dropout, rngs=rngs)
    if isinstance(config, CNNConfig):
        return lambda rngs: CNN(spec.input_shape, config.channels, config.hidden, spec.num_outputs, rngs=rngs)
    if isinstance(config, GPTConfig):
        if spec.num_outputs > config.vocab:
            raise UserError(f"config: model.vocab={config.vocab} is smaller than the data's "
                            f"{spec.num_outputs} token ids")
        shape = GPTShape(config.layers, config.width, config.heads, config.mlp_ratio, config.vocab,
                         config.max_len or spec.input_shape[0], config.dropout, config.scan_layers,
                         jnp.dtype(compute_dtype))
        return lambda rngs: GPT(shape, rngs=rngs)
    return _custom_factory(config)


def takes_rngs(module: nnx.Module) -> bool:
    """Whether the module's __call__ accepts a dropout key as `rngs=` (see the model contract)."""
    return "rngs" in inspect.signature(type(module).__call__).parameters


def _custom_factory(config: CustomModelConfig) -> Callable[[nnx.Rngs], nnx.Module]:
    module_name, _, attr = config.target.partition(":")
    try:
        target = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"config: model.target={config.target!r}: cannot import {module_name!r} ({err}); "
                        "make sure the package is installed or on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UserError(f"config: model.target={config.target!r}: {module_name!r} has no {attr!r}")
        target = getattr(target, part)
    if not (isinstance(target, type) and issubclass(target, nnx.Module)):
        raise UserError(f"config: model.target={config.target!r} is not a flax.nnx.Module subclass")
    if "rngs" not in inspect.signature(target.__init__).parameters:
        raise UserError(f"config: model.target={config.target!r} must accept a keyword argument `rngs`")
    return lambda rngs: target(**config.kwargs, rngs=rngs)
