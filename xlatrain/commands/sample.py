"""`xlatrain sample RUN_DIR|hf:DIR --prompt TEXT [--prompt TEXT ...]` (or `--chat MESSAGE`): a continuation of
each prompt from a built-in decoder's trained (or imported) weights, on one device, with a KV cache and one
compiled decode loop over the prompts left-padded into one batch (xlatrain/models/sampling.py). `--chat` renders
each message as a user's turn with the tokenizer's chat template and its generation prompt, and stops at the
end-of-turn ids."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from xlatrain.commands.trained import TrainedDecoder, trained_decoder
from xlatrain.data.chat import load_chat_template
from xlatrain.errors import UserError
from xlatrain.models.sampling import Sampling, generate_until

DEFAULT_NEW_TOKENS = 64


@dataclass(frozen=True)
class Request:
    source: str
    """A run directory, or hf:DIR."""
    prompts: tuple[str, ...]
    """The texts to continue, or with `chat` the user's messages."""
    max_new_tokens: int | None = None
    """None: DEFAULT_NEW_TOKENS, or fewer where the model's context ends sooner."""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    step: int | None = None
    """A run's checkpoint (default: the latest)."""
    chat: bool = False
    stop: tuple[str, ...] = ()
    """Stop strings: a continuation ends before the first."""


def prompt_ids(trained: TrainedDecoder, request: Request) -> tuple[list[np.ndarray], int, tuple[int, ...]]:
    """(each prompt's ids: after the BOS token where the tokenizer, or the run's data, begins texts with one, or
    rendered by the chat template; how many tokens may follow the longest, checked against the model's context;
    the ids a continuation stops at)."""
    tokenizer = trained.tokenizer
    if tokenizer is None:
        raise UserError(f"sample: {trained.source} has no tokenizer to encode --prompt with (a run on "
                        "data.source=arrays, or shards prepared without one)")
    option = "--chat" if request.chat else "--prompt"
    texts = [utf8_text(text, option) for text in request.prompts]
    if not all(texts):
        raise UserError(f"sample: a {option} is empty; give the text to continue")
    stop_ids = (tokenizer.end_of_text,)
    if request.chat:
        template = load_chat_template(tokenizer.name, "sample --chat: the tokenizer")
        prompts = [template.prompt_ids([{"role": "user", "content": text}], "sample --chat").astype(np.int32)
                   for text in texts]
        stop_ids = tuple(sorted({*stop_ids, *template.end_of_turn_ids()}))
    else:
        begin, _ = tokenizer.around_documents()
        prompts = [np.concatenate([begin, ids]).astype(np.int32) for ids in tokenizer.encode_batch(texts)]
    largest = max(int(p.max()) for p in prompts)
    if largest >= trained.model.vocab:
        raise UserError(f"sample: the tokenizer gives {option} the id {largest}, past the model's vocabulary of "
                        f"{trained.model.vocab}: {trained.source}'s tokenizer is not its model's")
    context, longest = trained.model.max_len, max(len(p) for p in prompts)
    if longest >= context:
        raise UserError(f"sample: {option} is {longest} tokens, and the model's context is {context}; shorten it")
    if request.max_new_tokens is None:
        return prompts, min(DEFAULT_NEW_TOKENS, context - longest), stop_ids
    if longest + request.max_new_tokens > context:
        raise UserError(f"sample: {option}'s {longest} tokens and --max-new-tokens {request.max_new_tokens} "
                        f"exceed the model's context of {context}; lower --max-new-tokens to at most "
                        f"{context - longest}")
    return prompts, request.max_new_tokens, stop_ids


def utf8_text(text: str, named: str) -> str:
    """`text` where it is UTF-8; a command-line argument that is not (Python keeps its bytes as surrogates) is one
    UserError naming the first byte that is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raw = text.encode("utf-8", "surrogateescape")
        at = len(text[:err.start].encode("utf-8", "surrogateescape"))
        raise UserError(f"sample: {named} is not UTF-8 text (byte {at}: {raw[at:at + 1]!r}); give it as UTF-8 (your "
                        "terminal's locale, or iconv -t utf-8)") from None
    return text


def sample(request: Request) -> list[tuple[str, np.ndarray]]:
    """Each prompt's continuation as (text, ids), ending before a stop id or a stop string."""
    trained = trained_decoder(request.source, request.step, "sample")
    prompts, new_tokens, stop_ids = prompt_ids(trained, request)
    tokenizer = trained.tokenizer
    graphdef, params = trained.module()
    sampling = Sampling(new_tokens, request.temperature, request.top_k, request.top_p, stop_ids,
                        min(tokenizer.vocab_size, trained.model.vocab))
    return generate_until(graphdef, params, prompts, jax.random.PRNGKey(request.seed), sampling, tokenizer.decode,
                          request.stop)
