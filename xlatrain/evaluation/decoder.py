"""A built-in decoder as evaluation, sampling and export build it from its config (vocabulary and context
resolved): its nnx graph definition, its params' shapes and logical axes, layers stacked as training keeps them."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlatrain.data.spec import DataSpec
from xlatrain.models import flax_model, model_factory
from xlatrain.models.interface import ModelDef


def decoder_spec(model: Any) -> DataSpec:
    """Token sequences of the decoder's context, as its factory reads them."""
    return DataSpec((model.max_len,), np.dtype(np.int32), (model.max_len,), np.dtype(np.int32), model.vocab)


def decoder_definition(model: Any) -> ModelDef:
    return flax_model(_factory(model))


def decoder_graphdef(model: Any) -> Any:
    factory = _factory(model)
    return nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(0))))[0]


def _factory(model: Any) -> Any:
    return model_factory(model, decoder_spec(model), jnp.float32, scan_layers=True)
