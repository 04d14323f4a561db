"""Fine-tuning records in TRL's dataset formats, told apart by their fields, and the loss weights each gets.

- language modelling: `text`;
- prompt-completion: `prompt` and `completion`, both text or both lists of messages;
- conversational: `messages`, a list of {role, content};
- preference: `chosen` and `rejected`, with a `prompt` or the prompt implicit in both (text or messages): a pair
  of documents, the prompt with each answer, side by side in one shard (model.dpo trains on them).

A record becomes one document of ids with a loss weight per id (1 where the token is a target the loss counts):
`completion` (a prompt-completion record's completion and the end-of-text after it), `assistant` (a
conversation's assistant turns, from the chat template), or `all`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from xlatrain.data.chat import ChatTemplate, load_chat_template
from xlatrain.data.tokenizers import Tokenizer
from xlatrain.errors import UserError

LANGUAGE_MODELING = "language modeling"
PROMPT_COMPLETION = "prompt-completion"
CONVERSATIONAL = "conversational"
PREFERENCE = "preference"
ROLES = ("system", "user", "assistant", "tool")
LOSS_ON = ("auto", "completion", "assistant", "all")
"""`data prepare --loss-on`: auto is completion for prompt-completion records and assistant for conversations."""


def record_format(record: Any, where: str) -> str:
    """Which of TRL's formats a record is in, by its fields; one line naming the line and its fields otherwise."""
    if not isinstance(record, dict):
        raise UserError(f"data prepare: {where} is a JSON {type(record).__name__}, not an object; give one record "
                        "per line")
    if "chosen" in record and "rejected" in record:
        return PREFERENCE
    if "messages" in record:
        return CONVERSATIONAL
    if "prompt" in record and "completion" in record:
        return PROMPT_COMPLETION
    if "text" in record:
        return LANGUAGE_MODELING
    raise UserError(f"data prepare: {where} is a record of no known format (its fields: "
                    f"{', '.join(list(record)[:8]) or 'none'}); give `text`, `prompt` and `completion`, or `messages`, "
                    "or name the text field with --field")


@dataclass(frozen=True)
class Weighting:
    """How records of one format become documents of ids and loss weights."""

    format: str
    loss_on: str
    tokenizer: Tokenizer
    tokenizer_spec: str
    """Where the tokenizer is: its chat template is read from beside it when a record is messages."""

    @cached_property
    def template(self) -> ChatTemplate:
        return load_chat_template(self.tokenizer_spec, "--tokenizer")

    def documents(self, record: dict, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, weights) of each document a record makes: one, or a preference record's two (its prompt with the
        chosen answer, then with the rejected one, each weighted on its answer)."""
        if self.format != PREFERENCE:
            return [self.document(record, where)]
        prompt, chosen, rejected = preference_parts(record, where)
        return [self.document({"prompt": prompt, "completion": answer}, where) for answer in (chosen, rejected)]

    def document(self, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, weights) of one record as a whole document: its ids and the end-of-text token, uint32 and uint8."""
        end = np.asarray([self.tokenizer.end_of_text], np.uint32)
        if self.format != CONVERSATIONAL and isinstance(record["prompt"], str):
            prompt, completion = (_text(record, name, where) for name in ("prompt", "completion"))
            begin, _ = self.tokenizer.around_documents()
            prompt_ids, completion_ids = self.tokenizer.encode_batch([prompt, completion])
            ids = np.concatenate([begin, prompt_ids, completion_ids, end]).astype(np.uint32)
            answer = np.zeros(len(ids), np.uint8)
            answer[len(begin) + len(prompt_ids):] = 1
            return ids, answer if self.loss_on != "all" else np.ones(len(ids), np.uint8)
        if self.format == CONVERSATIONAL:
            ids, answer = self.template.rendered(messages(record, "messages", where), where)
        else:
            prompt, completion = (messages(record, name, where) for name in ("prompt", "completion"))
            ids, answer = self.template.rendered(prompt + completion, where, answers_after=prompt)
        weights = np.ones(len(ids), np.uint8) if self.loss_on == "all" else answer
        return np.append(ids, end).astype(np.uint32), np.append(weights, np.uint8(self.loss_on == "all"))


def weighting(format: str, loss_on: str, tokenizer: Tokenizer, tokenizer_spec: str) -> Weighting:
    """The weighting of a file's records; one line for a loss option that does not fit its format."""
    fits = {PROMPT_COMPLETION: ("auto", "completion", "all"), CONVERSATIONAL: ("auto", "assistant", "all"),
            PREFERENCE: ("auto", "completion")}
    if loss_on not in fits[format]:
        raise UserError(f"data prepare: --loss-on {loss_on} does not fit {format} records; give one of "
                        f"{', '.join(fits[format])}")
    resolved = {"auto": "assistant" if format == CONVERSATIONAL else "completion"}.get(loss_on, loss_on)
    return Weighting(format, resolved, tokenizer, tokenizer_spec)


def preference_parts(record: dict, where: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a preference record: its `prompt`, or the one implicit in both answers (TRL's
    extract_prompt: the messages they begin with alike, or the text up to where they part, less a space before
    it); text or lists of messages alike."""
    chosen, rejected = record["chosen"], record["rejected"]
    if "prompt" in record:
        return record["prompt"], chosen, rejected
    if isinstance(chosen, str) and isinstance(rejected, str):
        common = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        common -= 1 if common and chosen[common - 1] == " " else 0
    else:
        chosen, rejected = messages(record, "chosen", where), messages(record, "rejected", where)
        common = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    if not common:
        raise UserError(f"data prepare: {where}: `chosen` and `rejected` share no prompt to begin with; give the "
                        "prompt in a `prompt` field")
    return chosen[:common], chosen[common:], rejected[common:]


def messages(record: dict, name: str, where: str) -> list[dict[str, str]]:
    """A record's list of messages, each a role among ROLES and text content."""
    given = record[name]
    if not isinstance(given, list) or not given:
        raise UserError(f"data prepare: {where}: `{name}` holds {type(given).__name__}, not a list of messages with "
                        "role and content")
    for number, message in enumerate(given):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise UserError(f"data prepare: {where}: `{name}`[{number}] is not a message with a role and text "
                            "content")
        if message.get("role") not in ROLES:
            raise UserError(f"data prepare: {where}: `{name}`[{number}] has the role {message.get('role')!r}; "
                            f"give one of {', '.join(ROLES)}")
    return given


def _text(record: dict, name: str, where: str) -> str:
    if not isinstance(record[name], str):
        raise UserError(f"data prepare: {where}: `{name}` holds {type(record[name]).__name__}, where `prompt` is "
                        "text; give both as text or both as lists of messages")
    return record[name]
