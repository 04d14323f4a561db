"""trainer.eval_tasks: downstream tasks scored during training with the train state's params (gathered to one
device: the run's model, the run's tokenizer), their programs compiled at the first evaluation and reused by
every later one; the scores as eval/<task>/<metric>. An evaluation reads the state and changes nothing of it."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlatrain.config import Config, GPTConfig
from xlatrain.data.sources import run_tokenizer
from xlatrain.data.spec import DataSpec
from xlatrain.errors import UserError
from xlatrain.evaluation.scoring import TextModel
from xlatrain.evaluation.tasks import TaskScores, flat_scores, merged_variables, task_set
from xlatrain.models import model_factory

BATCH_SIZE = 16
"""Sequences scored together."""


class InLoopTasks:
    """`layer_params`: a pipeline's stage layout to the model's (None: the params are in it already)."""

    def __init__(self, config: Config, abstract_params: Any, data_spec: DataSpec,
                 layer_params: Callable[[Any], Any] | None):
        trainer = config.trainer
        if jax.process_count() > 1:
            raise UserError("config: trainer.eval_tasks runs in a run of one process for now (the params gathered "
                            "to one device); evaluate checkpoints with `xlatrain eval RUN_DIR` instead")
        tasks = task_set(trainer.eval_tasks, trainer.eval_include_path, "config: trainer.eval_tasks")
        tokenizer = run_tokenizer(config.data, config.run_dir())
        if tokenizer is None:
            raise UserError("config: trainer.eval_tasks encodes the tasks' texts with the run's tokenizer, and this "
                            "run has none (data.source=arrays, or shards prepared without one): drop "
                            "trainer.eval_tasks")
        model_params = abstract_params if layer_params is None else jax.eval_shape(layer_params, abstract_params)
        model = _resolved(config, model_params, data_spec)
        graphdef = decoder_graphdef(model)
        self._layer_params = layer_params or (lambda params: params)
        self._scores = TaskScores(TextModel(graphdef, tokenizer, model.max_len, model.vocab), tasks,
                                  trainer.eval_tasks_limit, BATCH_SIZE)

    def __call__(self, state: Any) -> dict[str, float]:
        params = self._layer_params(jax.device_get(state.params))
        variables = jax.device_put(merged_variables(params, jax.device_get(state.model_state)), jax.devices()[0])
        return flat_scores(self._scores(variables))


def decoder_graphdef(model: Any) -> Any:
    """The nnx graph definition of a decoder whose config has its vocabulary and context resolved, layers stacked
    as training keeps them."""
    factory = model_factory(model, decoder_spec(model), jnp.float32, scan_layers=True)
    return nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(0))))[0]


def decoder_spec(model: Any) -> DataSpec:
    """Token sequences of the decoder's context, as its factory reads them."""
    return DataSpec((model.max_len,), np.dtype(np.int32), (model.max_len,), np.dtype(np.int32), model.vocab)


def _resolved(config: Config, params: Any, data_spec: DataSpec) -> Any:
    """The decoder's config with the vocabulary and the context its params have."""
    model = config.model
    vocab = params["embed"]["embedding"].shape[0]
    max_len = (params["position"]["embedding"].shape[0] if isinstance(model, GPTConfig)
               else model.max_len or data_spec.input_shape[0])
    return model.model_copy(update={"vocab": vocab, "max_len": max_len})
