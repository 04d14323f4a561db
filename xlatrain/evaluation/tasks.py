"""The tasks an evaluation scores, checked before anything runs, and their scores: xlatrain's multiple-choice files
(*.jsonl: choices.py) and lm-evaluation-harness tasks named as the harness names them, from the task YAMLs under
the include paths (harness.py; its thousands of default tasks are not indexed)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from xlatrain.config.base import expanded
from xlatrain.errors import UserError
from xlatrain.evaluation.choices import accuracies, continuation_pairs, read_questions
from xlatrain.evaluation.scoring import Scorer, TextModel

JSONL = ".jsonl"


@dataclass(frozen=True)
class TaskSet:
    files: tuple[Path, ...]
    harness: tuple[str, ...]
    manager: Any
    """lm-evaluation-harness's TaskManager of the include paths; None without harness tasks."""
    named: str
    """The command or the config key that asked for them, for messages."""


def task_set(tasks: tuple[str, ...], include_paths: tuple[str, ...], named: str) -> TaskSet:
    """`tasks` checked: each file there, each harness task under `include_paths`; errors name `named` (the command
    or the config key)."""
    files = tuple(Path(expanded(task)) for task in tasks if task.endswith(JSONL))
    for path in files:
        _check_file(path, named)
    harness = tuple(task for task in tasks if not task.endswith(JSONL))
    return TaskSet(files, harness, _harness_tasks(harness, include_paths, named) if harness else None, named)


class TaskScores:
    """Scores a TaskSet with a TextModel's weights on `mesh` (devices.py), its programs compiled once for every
    evaluation."""

    def __init__(self, model: TextModel, tasks: TaskSet, limit: int | None, batch_size: int, mesh: Mesh):
        self.model, self.tasks, self.limit = model, tasks, limit
        self.scorer = Scorer(model.graphdef, model.context, batch_size, mesh)
        begin = model.tokenizer.around_documents()[0]
        self.questions = {path.stem: read_questions(path, limit) for path in tasks.files}
        self.pairs = {task: continuation_pairs(questions, self._encode, begin, model.tokenizer.end_of_text)
                      for task, questions in self.questions.items()}
        for path in tasks.files:
            _check_ids(self.pairs[path.stem], model.vocab, path, tasks.named)

    def __call__(self, variables: Any) -> dict[str, dict[str, float]]:
        """{task: {metric: value}}, the same on every process; `variables` placed on the mesh
        (devices.placed_weights)."""
        scores = {task: {**accuracies(self.questions[task], self.scorer.score(variables, pairs)),
                         "questions": len(self.questions[task])} for task, pairs in self.pairs.items()}
        if self.tasks.harness:
            from xlatrain.evaluation.harness import XlatrainLM, harness_scores

            scores.update(harness_scores(XlatrainLM(self.model, self.scorer, variables), list(self.tasks.harness),
                                         self.tasks.manager, self.limit))
        return scores

    def _encode(self, text: str) -> np.ndarray:
        return self.model.tokenizer.encode_batch([text])[0]


def flat_scores(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """{eval/<task>/<metric>: value}: how metrics.jsonl and the trackers name them."""
    return {f"eval/{task}/{metric}": value for task, found in scores.items() for metric, value in found.items()}


def _harness_tasks(names: tuple[str, ...], include_paths: tuple[str, ...], named: str) -> Any:
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError(f"{named}: {names[0]!r} is an lm-evaluation-harness task (not a .jsonl file), and the "
                        "harness is not installed: pip install -e '.[eval]'") from None
    if not include_paths:
        raise UserError(f"{named}: {names[0]!r} is an lm-evaluation-harness task: give the directory of its YAML "
                        "as an include path (docs/evaluation.md)")
    directories = [Path(expanded(directory)) for directory in include_paths]
    for directory in directories:
        if not directory.is_dir():
            raise UserError(f"{named}: the include path {str(directory)!r} is not a directory")
    manager = TaskManager(include_path=[str(d) for d in directories], include_defaults=False)
    known = manager.all_tasks
    for name in names:
        if name not in known:
            broken = _unparsed_yaml(directories)
            near = difflib.get_close_matches(name, known, n=1)
            raise UserError(f"{named}: no task {name!r} under {', '.join(include_paths)}" + (
                f" (did you mean {near[0]!r}?)" if near else
                f"; {broken[0]}, and the harness skips a file it cannot read: mend it" if broken else
                f"; it holds {sorted(known)[:8]}"))
    return manager


def _unparsed_yaml(directories: list[Path]) -> list[str]:
    """'FILE does not parse (line N: the problem)' for each task YAML under `directories` that is not YAML (its
    tags, such as !function, taken as they come)."""
    import yaml

    class Tagged(yaml.SafeLoader):
        pass

    Tagged.add_multi_constructor("!", lambda loader, suffix, node: None)
    broken = []
    for path in sorted(path for directory in directories for path in directory.glob("**/*.yaml")):
        try:
            yaml.load(path.read_bytes(), Tagged)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            broken.append(f"{path} does not parse ({where}{getattr(err, 'problem', None) or err})")
    return broken


def _check_file(path: Path, named: str) -> None:
    if path.is_file():
        return
    near = difflib.get_close_matches(path.name, [p.name for p in path.parent.glob("*" + JSONL)], n=1)
    hint = f" (did you mean {str(path.parent / near[0])!r}?)" if near else ""
    raise UserError(f"{named}: task {str(path)!r} is not a file{hint}; give JSONL files of questions (context, "
                    "choices, gold)")


def _check_ids(pairs: list, vocab: int, path: Path, named: str) -> None:
    """Every id within the model's vocabulary: an empty context begins with the end-of-text, which a tokenizer of
    bytes has past the model's ids."""
    largest = max(int(max(context.max(initial=0), continuation.max(initial=0))) for context, continuation in pairs)
    if largest >= vocab:
        raise UserError(f"{named}: {str(path)!r} encodes to the id {largest}, past the model's vocabulary of {vocab}: "
                        "a question has an empty context, which begins with the end-of-text id, and this model's "
                        "tokenizer has none within its vocabulary (give every question a context), or the "
                        "tokenizer is not the model's")


