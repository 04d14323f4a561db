"""The tokenizer a Hugging Face checkpoint directory ships with, and whether a run's data speaks it."""

from __future__ import annotations

from pathlib import Path

from xlatrain.data.tokenizers import (
    TOKENIZER_FILE,
    Tokenizer,
    byte_tokenizer,
    load_tokenizer,
)

SENTENCEPIECE_FILE = "tokenizer.model"


def checkpoint_tokenizer(directory: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer.json (or sentencepiece tokenizer.model), None when it has neither."""
    for name in (TOKENIZER_FILE, SENTENCEPIECE_FILE):
        if (directory / name).is_file():
            return load_tokenizer(str(directory / name), named=f"the checkpoint's {name}")
    return None


def other_tokens_than_the_checkpoints(directory: Path, data_tokenizer: dict | None, text_in_bytes: bool) -> str:
    """Why the data's ids are not the ones the checkpoint in `directory` learned ("" when they are, or when either
    side does not say): `data_tokenizer` is the data's DataSpec.tokenizer, `text_in_bytes` whether the data is
    text read as bytes (which describes no tokenizer)."""
    theirs = checkpoint_tokenizer(directory)
    ours = data_tokenizer or (byte_tokenizer().describe() if text_in_bytes else None)
    if theirs is None or ours is None or theirs.fingerprint == ours["fingerprint"]:
        return ""
    return (f"the checkpoint's tokenizer ({theirs.name}) is not the data's ({ours['name']}): the data's ids stand for "
            f"other tokens than the ones the checkpoint learned; tokenize with it (data.tokenizer={str(directory)!r} "
            f"for text, `xlatrain data prepare --tokenizer {directory}` for token shards)")
