"""The `data` section: where examples come from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BeforeValidator, Field, field_validator, model_validator

from xlatrain.config.base import Fraction, PathText, PositiveInt, Strict, expanded


class DataBase(Strict):
    """Where the examples come from (docs/data.md). Each process reads its own block of rows of every global
    batch; a held-out split is cut off once, before shuffling."""

    shuffle: bool = True
    """Shuffle the training examples, reshuffled each epoch from the seed."""
    prefetch: PositiveInt = 2
    """Batches the device loader keeps in flight on the devices."""


class DigitsData(DataBase):
    source: Literal["digits"]
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes)."""
    holdout: Fraction = 0.2
    """Fraction of the examples held out for evaluation."""


BPE_VOCAB = (257, 2**20)
"""The ids a byte-level BPE trained here may have: the 256 bytes and the end-of-text token at least; 2**20 at most
(tokenizers' trainer allocates its tables by this number)."""


def stays_inside(pattern: str) -> bool:
    """Whether a glob pattern names files under the directory it is applied to: relative, with no `..` part."""
    return bool(pattern) and not Path(pattern).is_absolute() and ".." not in Path(pattern).parts


class TrainTokenizer(Strict):
    vocab_size: Annotated[int, Field(ge=BPE_VOCAB[0], le=BPE_VOCAB[1])]
    """Ids of the byte-level BPE trained with Hugging Face `tokenizers` (its end-of-text token among them)."""


class TrainedTokenizer(Strict):
    train: TrainTokenizer
    """Train a byte-level BPE: `data prepare` on its inputs, a `text` run on its training split (saved in the run
    directory as tokenizer-bpe-N.json, reused on resume)."""


Tokenizer = Annotated[Union[str, TrainedTokenizer], BeforeValidator(expanded)]


def check_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """`bytes`, or a path that exists (read later, by xlatrain/data/tokenizers.py), or train: {vocab_size: N}."""
    if isinstance(tokenizer, str) and tokenizer != "bytes" and not Path(tokenizer).exists():
        raise ValueError(f"data.tokenizer={tokenizer!r} does not exist; give `bytes`, a Hugging Face tokenizer.json, "
                         "a sentencepiece .model, a directory holding one, or train: {vocab_size: N}")
    return tokenizer


class TextData(DataBase):
    source: Literal["text"]
    """Text files read as bytes: windows of data.seq_len + 1 bytes, or one paragraph each with data.buckets."""
    path: PathText | None = None
    """Directory of text files; null: this Python's standard-library sources."""
    glob: str = "**/*.py"
    """Which files under data.path, relative to it (quote a leading *: data.glob='*.txt')."""
    seq_len: PositiveInt = 64
    """Tokens per example."""
    max_bytes: PositiveInt = 8_000_000
    """Read at most this many bytes (files in sorted order)."""
    holdout: Fraction = 0.05
    """Fraction of the examples held out for evaluation."""
    buckets: tuple[PositiveInt, ...] | None = None
    """Variable-length examples (one paragraph each, up to seq_len bytes), every batch padded to the
    shortest of these lengths (or seq_len) that fits it, with padding masked out of the loss.
    Default: fixed windows of seq_len."""
    tokenizer: Tokenizer = "bytes"
    """bytes (ids 0..255); a Hugging Face tokenizer.json, a sentencepiece .model (needs the sentencepiece
    package) or a directory holding one; or train: {vocab_size: N}. Files are tokenized at the start, joined
    by the tokenizer's end-of-text token."""
    add_bos: bool | None = None
    """Whether each file's ids begin with the tokenizer's BOS token. null: as the tokenizer does (its add_bos_token:
    Llama's and Gemma's tokenizer.json add one; bytes and the BPEs trained here add none); true: refused for a
    tokenizer without a BOS token; false: none. A run keeps what it started with."""

    _tokenizer_exists = field_validator("tokenizer")(check_tokenizer)

    @field_validator("glob")
    @classmethod
    def _relative_pattern(cls, pattern: str) -> str:
        if not stays_inside(pattern):
            raise ValueError(f"data.glob={pattern!r} must be a non-empty pattern relative to data.path, without "
                             "`..`, e.g. "
                             "'**/*.txt'")
        return pattern

    @model_validator(mode="after")
    def _path_exists(self) -> TextData:
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"data.path={self.path!r} is not a directory; point it at a folder of text files")
        if self.buckets is not None:
            if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[-1] > self.seq_len:
                raise ValueError(f"data.buckets={list(self.buckets)} must be strictly increasing lengths "
                                 f"no longer than data.seq_len={self.seq_len}")
            if self.tokenizer != "bytes":
                raise ValueError("data.buckets cuts paragraphs of bytes; with data.tokenizer, prepare shards "
                                 "(xlatrain data prepare) and use data.source=tokens with data.packing=true")
        if self.add_bos and (self.tokenizer == "bytes" or isinstance(self.tokenizer, TrainedTokenizer)):
            raise ValueError("data.add_bos=true: bytes and the BPEs trained here have no BOS token; leave "
                             "data.add_bos out, or give a tokenizer that has one")
        return self


class ArrayData(DataBase):
    source: Literal["arrays"]
    """Your arrays: inputs and targets of the same number of rows."""
    path: PathText
    """A directory holding inputs.npy and targets.npy (memory-mapped), or an .npz file with those keys."""
    holdout: Fraction = 0.1
    """Fraction of the examples held out for evaluation."""

    @model_validator(mode="after")
    def _path_exists(self) -> ArrayData:
        if not Path(self.path).exists():
            raise ValueError(
                f"data.path={self.path!r} does not exist; give a directory with inputs.npy and "
                "targets.npy, or an .npz file"
            )
        return self


class TokensData(DataBase):
    source: Literal["tokens"]
    """Token shards prepared by `xlatrain data prepare` (docs/data.md), memory-mapped."""
    path: PathText
    """The directory `xlatrain data prepare --out` wrote (its manifest.json lists the shards)."""
    seq_len: PositiveInt = 64
    """Tokens per example."""
    packing: bool = False
    """false: windows of seq_len + 1 tokens that cross documents (the end-of-text token between them). true: whole
    documents packed into rows, with segment ids and positions restarting at 0, so that attention and the loss
    never cross a document; a document longer than a row is split."""
    tokenizer: PathText | None = None
    """null: the shards' own (their manifest's). A tokenizer (`bytes`, a tokenizer.json, a .model): the shards
    must have been prepared with it, else the run is refused."""

    _tokenizer_exists = field_validator("tokenizer")(lambda value: value if value is None else check_tokenizer(value))

    @model_validator(mode="after")
    def _path_exists(self) -> TokensData:
        if not Path(self.path).is_dir():
            raise ValueError(f"data.path={self.path!r} is not a directory; give the --out directory of "
                             "`xlatrain data prepare`")
        return self


DataConfig = Annotated[Union[DigitsData, TextData, ArrayData, TokensData], Field(discriminator="source")]
