"""trainer.eval_tasks: downstream tasks scored during training with the train state's params (gathered from the
training mesh to every process's host, then placed on the process's own devices as devices.py says: replicated, or
split as fsdp split them; every process scores its share, process 0 logs), the run's model and tokenizer; their
programs compiled at the first evaluation and reused by every later one; the scores as eval/<task>/<metric>. An
evaluation reads the state and changes nothing of it."""

from __future__ import annotations

from typing import Any, Callable

import jax

from xlatrain.compat.multihost import gather_to_host
from xlatrain.config import Config, GPTConfig
from xlatrain.data.sources import run_tokenizer
from xlatrain.data.spec import DataSpec
from xlatrain.errors import UserError
from xlatrain.evaluation.decoder import decoder_graphdef
from xlatrain.evaluation.devices import evaluation_mesh, placed_weights, trained_split
from xlatrain.evaluation.scoring import TextModel
from xlatrain.evaluation.tasks import TaskScores, flat_scores, task_set

BATCH_SIZE = 16
"""Sequences scored together."""


class InLoopTasks:
    """`layer_params`: a pipeline's stage layout to the model's (None: the params are in it already)."""

    def __init__(self, config: Config, abstract_params: Any, data_spec: DataSpec,
                 layer_params: Callable[[Any], Any] | None):
        trainer = config.trainer
        tasks = task_set(trainer.eval_tasks, trainer.eval_include_path, "config: trainer.eval_tasks")
        tokenizer = run_tokenizer(config.data, config.run_dir())
        if tokenizer is None:
            raise UserError("config: trainer.eval_tasks encodes the tasks' texts with the run's tokenizer, and this "
                            "run has none (data.source=arrays, or shards prepared without one): drop "
                            "trainer.eval_tasks")
        model_params = abstract_params if layer_params is None else jax.eval_shape(layer_params, abstract_params)
        self.model = _resolved(config, model_params, data_spec)
        self._split = trained_split(config)
        self._layer_params = layer_params or (lambda params: params)
        self._mesh = evaluation_mesh()
        self._scores = TaskScores(TextModel(decoder_graphdef(self.model), tokenizer, self.model.max_len,
                                            self.model.vocab), tasks, trainer.eval_tasks_limit, BATCH_SIZE, self._mesh)

    def __call__(self, state: Any) -> dict[str, float]:
        """{eval/<task>/<metric>: value}, on every process."""
        params = self._layer_params(jax.tree.map(gather_to_host, state.params))
        variables = placed_weights(self.model, params, jax.tree.map(gather_to_host, state.model_state), self._mesh,
                                   self._split)
        return flat_scores(self._scores(variables))


def _resolved(config: Config, params: Any, data_spec: DataSpec) -> Any:
    """The decoder's config with the vocabulary and the context its params have."""
    model = config.model
    vocab = params["embed"]["embedding"].shape[0]
    max_len = (params["position"]["embedding"].shape[0] if isinstance(model, GPTConfig)
               else model.max_len or data_spec.input_shape[0])
    return model.model_copy(update={"vocab": vocab, "max_len": max_len})
