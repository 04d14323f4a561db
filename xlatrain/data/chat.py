"""Chat templates: conversations rendered to ids by the tokenizer's own template through transformers'
`apply_chat_template` (the `[chat]` extra), so that the ids are transformers', with the tokens of the answers
marked.

The template is the one beside the tokenizer (`tokenizer_config.json`'s `chat_template`, or
`chat_template.jinja`). The assistant's tokens come from the template's `{% generation %}` spans where it has
them; otherwise from renderings of the first i messages and the first i + 1, when each rendering is a prefix of the
next (an assistant turn is then what its message adds after the generation prompt).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xlatrain.data.tokenizers import TOKENIZER_FILE
from xlatrain.errors import UserError, first_line

GENERATION_SPAN = re.compile(r"\{%-?\s*generation\s*-?%\}")


GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class ChatTemplate:
    tokenizer: Any
    """transformers' PreTrainedTokenizerFast, its chat template set."""
    name: str
    directory: Path
    """Where the tokenizer and its template are."""

    @property
    def marks_generation(self) -> bool:
        return bool(GENERATION_SPAN.search(self.tokenizer.chat_template))

    def text(self, messages: list[dict], where: str, add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as err:  # jinja2's TemplateError and the template's own raise_exception
            raise UserError(f"{where}: the chat template of {self.name} refused these messages "
                            f"({first_line(err)[:160]})") from None

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The ids a model ends its turn with: the tokenizer's `eos_token`, and `generation_config.json`'s
        `eos_token_id` (an id or a list of them) where the directory has one."""
        ids = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        path = self.directory / GENERATION_CONFIG
        try:
            given = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id") if path.is_file() else None
        except (OSError, ValueError, AttributeError) as err:
            raise UserError(f"{path} is not readable JSON ({first_line(err)[:120]}); repair or remove it") from None
        given = given if isinstance(given, list) else [given]
        return tuple(sorted({*ids, *(int(i) for i in given if isinstance(i, int) and not isinstance(i, bool))}))

    def prompt_ids(self, messages: list[dict], where: str) -> np.ndarray:
        """The ids of a conversation followed by the generation prompt: what a model continues with its answer."""
        return self._encoded(self.text(messages, where, add_generation_prompt=True))[0]

    def rendered(self, messages: list[dict], where: str, answers_after: list[dict] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, weights) of a conversation: uint32 ids as `apply_chat_template` gives them, uint8 weights 1 on the
        assistant's tokens, or, given `answers_after` (the prompt's messages), on every token after the prompt's
        rendering with the generation prompt."""
        if answers_after is not None:
            prompt, whole = self.text(answers_after, where, add_generation_prompt=True), self.text(messages, where)
            if not whole.startswith(prompt):
                raise UserError(f"{where}: the chat template of {self.name} does not render the prompt's messages as "
                                "a prefix of the whole conversation, so the completion's tokens cannot be told apart")
            return self._weighted(whole, [(len(prompt), len(whole))])
        if self.marks_generation:
            try:
                encoded = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                             return_assistant_tokens_mask=True)
            except Exception as err:
                raise UserError(f"{where}: the chat template of {self.name} refused these messages "
                                f"({first_line(err)[:160]})") from None
            return (np.asarray(encoded["input_ids"], np.uint32), np.asarray(encoded["assistant_masks"], np.uint8))
        return self._weighted(self.text(messages, where), self._assistant_spans(messages, where))

    def _assistant_spans(self, messages: list[dict], where: str) -> list[tuple[int, int]]:
        """The characters each assistant message adds to the rendering of the messages before it with the
        generation prompt."""
        spans, whole = [], self.text(messages, where)
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.text(messages[:turn], where, add_generation_prompt=True) if turn else ""
            through = self.text(messages[:turn + 1], where)
            if not (through.startswith(before) and whole.startswith(through)):
                raise UserError(f"{where}: the chat template of {self.name} does not render a conversation's first "
                                "messages as a prefix of the whole, so its assistant turns cannot be told apart; use "
                                "a template with {% generation %} spans, or --loss-on all")
            spans.append((len(before), len(through)))
        return spans

    def _weighted(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The text's ids and 1 on each token that begins inside one of the character spans."""
        ids, offsets = self._encoded(text)
        starts = offsets[:, 0]
        inside = np.zeros(len(ids), bool)
        for begin, end in spans:
            inside |= (starts >= begin) & (starts < end)
        return ids, inside.astype(np.uint8)

    def _encoded(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return (np.asarray(encoded["input_ids"], np.uint32),
                np.asarray(encoded["offset_mapping"], np.int64).reshape(-1, 2))


TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")
"""Where a chat template and the special tokens it names are kept beside a tokenizer.json."""


def template_files(spec: str) -> dict[str, str]:
    """{name: text} of TEMPLATE_FILES beside a Hugging Face tokenizer (`spec`: its tokenizer.json or directory),
    those present, when one of them holds a chat template; {} otherwise. They go where the tokenizer is saved (a
    shard directory, an exported checkpoint) so that what is made from it renders chats as it does."""
    path = Path(spec)
    directory = path if path.is_dir() else path.parent
    if spec == "bytes" or not (directory / TOKENIZER_FILE).is_file():
        return {}
    found = {name: (directory / name).read_text(encoding="utf-8") for name in TEMPLATE_FILES
             if (directory / name).is_file()}
    try:
        in_config = "chat_template" in json.loads(found.get(TEMPLATE_FILES[0], "{}"))
    except (ValueError, TypeError):  # not JSON, or not an object: the tokenizer's loading names it
        in_config = bool(found.pop(TEMPLATE_FILES[0]))
    return found if in_config or TEMPLATE_FILES[1] in found else {}


def load_chat_template(spec: str, named: str) -> ChatTemplate:
    """The chat template beside a Hugging Face tokenizer (`spec`: its tokenizer.json or directory)."""
    path = Path(spec)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if spec == "bytes" or file.suffix != ".json" or not file.is_file():
        raise UserError(f"{named}={spec!r} has no chat template to render conversations with; give a Hugging Face "
                        "tokenizer directory whose tokenizer_config.json or chat_template.jinja holds one")
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise UserError(f"{named}: rendering conversations needs transformers' chat templates: pip install "
                        "'xlatrain[chat]'") from None
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(file.parent), tokenizer_file=str(file))
    except Exception as err:  # transformers raises OSError, ValueError and others on a damaged directory
        raise UserError(f"{named}={spec!r}: transformers could not load the tokenizer beside it "
                        f"({first_line(err)[:160]}); repair its tokenizer_config.json") from None
    if not isinstance(tokenizer.chat_template, str):
        raise UserError(f"{named}={spec!r} has no chat template (no chat_template in tokenizer_config.json, no "
                        "chat_template.jinja beside it); add the model's template there, or give text records")
    return ChatTemplate(tokenizer, spec, file.parent)
