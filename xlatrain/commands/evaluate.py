"""`xlatrain eval RUN_DIR|hf:DIR --tasks TASK[,TASK ...] [--include-path DIR] [--limit N] [--batch-size B]
[--output FILE]`: a built-in decoder's scores on tasks (xlatrain/evaluation/tasks.py): multiple-choice files in
xlatrain's JSONL format, which need nothing else, and lm-evaluation-harness tasks from the task YAMLs under
--include-path (the `eval` extra). Every log-likelihood comes from the model's compiled forward over the process's
devices (xlatrain/evaluation/devices.py); under a launcher jax.distributed detects (srun, mpirun) every process
scores its share and process 0 writes --output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from xlatrain.commands.export import check_new_output
from xlatrain.commands.trained import TrainedDecoder, trained_decoder
from xlatrain.config.base import expanded
from xlatrain.errors import UserError
from xlatrain.evaluation.devices import evaluation_mesh, placed_weights, spread_over
from xlatrain.evaluation.scoring import TextModel
from xlatrain.evaluation.tasks import TaskScores, task_set
from xlatrain.run.atomic import replace_file
from xlatrain.runtime.distributed import is_primary


@dataclass(frozen=True)
class Request:
    source: str
    """A run directory, or hf:DIR."""
    tasks: tuple[str, ...]
    """Task files (*.jsonl) and harness task names."""
    include_paths: tuple[str, ...] = ()
    """Directories of harness task YAMLs."""
    limit: int | None = None
    """The first N documents of each task; None: all."""
    batch_size: int = 16
    output: str | None = None
    """A new JSON file for the scores."""
    step: int | None = None
    """A run's checkpoint (default: the latest)."""


def evaluate(request: Request) -> dict[str, dict[str, float]]:
    """{task name: its metrics}; written to request.output when given."""
    tasks = task_set(request.tasks, request.include_paths, "eval")
    output = Path(expanded(request.output)) if request.output else None
    if output is not None:
        check_new_output(output, "eval", "--output file")
    mesh = evaluation_mesh()
    trained = trained_decoder(request.source, request.step, "eval", spread_over(mesh))
    scores = TaskScores(text_model(trained, trained.module()[0]), tasks, request.limit, request.batch_size, mesh)(
        placed_weights(trained.model, trained.params, trained.model_state, mesh, trained.split))
    if output is not None and is_primary():
        replace_file(output, lambda partial: partial.write_text(json.dumps(scores, indent=2) + "\n"))
    return scores


def text_model(trained: TrainedDecoder, graphdef) -> TextModel:
    if trained.tokenizer is None:
        raise UserError(f"eval: {trained.source} has no tokenizer to encode the tasks' texts with (a run on "
                        "data.source=arrays, or shards prepared without one)")
    return TextModel(graphdef, trained.tokenizer, trained.model.max_len, trained.model.vocab)
