"""`xlatrain sample RUN_DIR|hf:DIR --prompt TEXT`: a continuation of the prompt from a built-in decoder's trained
(or imported) weights, on one device, with a KV cache and one compiled decode loop (xlatrain/models/sampling.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from xlatrain.commands.trained import TrainedDecoder, from_hugging_face, from_run
from xlatrain.config import HUGGING_FACE_PREFIX
from xlatrain.config.base import expanded
from xlatrain.config.hugging_face import checkpoint_directory
from xlatrain.errors import UserError
from xlatrain.models.sampling import Sampling, generate

DEFAULT_NEW_TOKENS = 64


@dataclass(frozen=True)
class Request:
    source: str
    """A run directory, or hf:DIR."""
    prompt: str
    max_new_tokens: int | None = None
    """None: DEFAULT_NEW_TOKENS, or fewer where the model's context ends sooner."""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    step: int | None = None
    """A run's checkpoint (default: the latest)."""


def trained_decoder(source: str, step: int | None) -> TrainedDecoder:
    if source.startswith(HUGGING_FACE_PREFIX):
        directory = checkpoint_directory(source)
        if step is not None:
            raise UserError("sample: --step picks a run's checkpoint; a Hugging Face directory has one")
        return from_hugging_face(directory, "sample")
    return from_run(Path(expanded(source)), step, "sample")[0]


def prompt_ids(trained: TrainedDecoder, request: Request) -> tuple[np.ndarray, int]:
    """The prompt's ids (after the BOS token where the tokenizer, or the run's data, begins texts with one) and how
    many tokens may follow them, checked against the model's context."""
    if trained.tokenizer is None:
        raise UserError(f"sample: {trained.source} has no tokenizer to encode --prompt with (a run on "
                        "data.source=arrays, or shards prepared without one)")
    ids = trained.tokenizer.encode_batch([utf8_text(request.prompt, "--prompt")])[0].astype(np.int32)
    if not len(ids):
        raise UserError("sample: --prompt is empty; give the text to continue")
    if trained.tokenizer.bos is not None:
        ids = np.concatenate([[trained.tokenizer.bos], ids]).astype(np.int32)
    if ids.max() >= trained.model.vocab:
        raise UserError(f"sample: the tokenizer gives --prompt the id {ids.max()}, past the model's vocabulary of "
                        f"{trained.model.vocab}: {trained.source}'s tokenizer is not its model's")
    context = trained.model.max_len
    if len(ids) >= context:
        raise UserError(f"sample: --prompt is {len(ids)} tokens, and the model's context is {context}; shorten it")
    if request.max_new_tokens is None:
        return ids, min(DEFAULT_NEW_TOKENS, context - len(ids))
    if len(ids) + request.max_new_tokens > context:
        raise UserError(f"sample: --prompt's {len(ids)} tokens and --max-new-tokens {request.max_new_tokens} "
                        f"exceed the model's context of {context}; lower --max-new-tokens to at most "
                        f"{context - len(ids)}")
    return ids, request.max_new_tokens


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


def sample(request: Request) -> tuple[str, np.ndarray]:
    """(the continuation as text, its ids; the end-of-text token, when chosen, ends both)."""
    trained = trained_decoder(request.source, request.step)
    ids, new_tokens = prompt_ids(trained, request)
    tokenizer = trained.tokenizer
    graphdef, params = trained.module()
    sampling = Sampling(new_tokens, request.temperature, request.top_k, request.top_p,
                        tokenizer.end_of_text, min(tokenizer.vocab_size, trained.model.vocab))
    tokens, made = generate(graphdef, params, jnp.asarray(ids[None]), jax.random.PRNGKey(request.seed), sampling)
    new = np.asarray(tokens)[0, :int(made)]
    ended = np.flatnonzero(new == tokenizer.end_of_text)
    new = new[:ended[0]] if len(ended) else new
    return tokenizer.decode(new.tolist()), new
