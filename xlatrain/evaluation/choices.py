"""xlatrain's own multiple-choice tasks, which need no harness: a JSONL file, one question a line,
`{"context": TEXT, "choices": [TEXT, ...], "gold": INDEX}`. Each choice follows the context after one space (the
harness's target delimiter) and is scored by its log-likelihood: `acc` takes the choice of the largest sum,
`acc_norm` the largest sum per character of the choice, as lm-evaluation-harness's multiple-choice tasks do."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from xlatrain.errors import UserError
from xlatrain.evaluation.scoring import Scored

TARGET_DELIMITER = " "


@dataclass(frozen=True)
class Question:
    context: str
    choices: tuple[str, ...]
    gold: int


def read_questions(path: Path, limit: int | None = None) -> list[Question]:
    """The first `limit` questions of a task file (all with None); a line that is not one is an error naming the
    file, the line and what a question holds."""
    questions = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            questions.append(_question(line, f"{path}:{number}"))
        if limit is not None and len(questions) == limit:
            break
    if not questions:
        raise UserError(f"eval: task {str(path)!r} holds no question; give one JSON object a line")
    return questions


def _question(line: bytes, where: str) -> Question:
    shape = ('a question is one JSON object a line: {"context": "...", "choices": ["...", "..."], "gold": the '
             "index of the right choice}")
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"eval: {where} does not parse ({err.__class__.__name__}); {shape}") from None
    if not isinstance(record, dict):
        raise UserError(f"eval: {where} is not a JSON object; {shape}")
    context, choices, gold = record.get("context"), record.get("choices"), record.get("gold")
    if not isinstance(context, str) or not isinstance(choices, list) or len(choices) < 2 or not all(
            isinstance(choice, str) and choice for choice in choices):
        raise UserError(f"eval: {where} needs a text context and two or more non-empty text choices; {shape}")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise UserError(f"eval: {where}'s gold must index its {len(choices)} choices (0 to {len(choices) - 1}); "
                        f"{shape}")
    return Question(context, tuple(choices), gold)


def continuation_pairs(questions: Sequence[Question], encode: Callable[[str], np.ndarray], begin: np.ndarray,
                       end_of_text: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(context ids, continuation ids) of every question's every choice, in order, as HFLM encodes a pair: the
    context's trailing spaces moved to the continuation, the continuation the ids of the whole past the context's;
    `begin` (the BOS the tokenizer begins texts with, or nothing) first, and a context left empty is the
    end-of-text."""
    pairs = []
    for question in questions:
        for choice in question.choices:
            context, continuation = question.context, TARGET_DELIMITER + choice
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, head = encode(context + continuation), encode(context)
            ids = np.concatenate([begin, head])
            pairs.append((ids if len(ids) else np.asarray([end_of_text]), whole[len(head):]))
    return pairs


def accuracies(questions: Sequence[Question], scored: Sequence[Scored]) -> dict[str, float]:
    """acc and acc_norm over the questions, from each choice's log-likelihood (in continuation_pairs' order)."""
    right = {"acc": 0, "acc_norm": 0}
    at = 0
    for question in questions:
        sums = np.asarray([s.log_likelihood for s in scored[at:at + len(question.choices)]])
        at += len(question.choices)
        lengths = np.asarray([len(choice) for choice in question.choices], np.float64)
        right["acc"] += int(np.argmax(sums)) == question.gold
        right["acc_norm"] += int(np.argmax(sums / lengths)) == question.gold
    return {name: count / len(questions) for name, count in right.items()}
