"""Tokenizers: bytes, a Hugging Face `tokenizer.json` (or a directory holding one), a sentencepiece `.model`, or a
byte-level BPE trained here with Hugging Face `tokenizers`. Nothing is fetched from a hub.

Documents are separated by the tokenizer's end-of-text token. A tokenizer that has none (bytes, or a file whose
special tokens include none of END_OF_TEXT_NAMES) gets one from xlatrain: the id one past its own, so that its
vocabulary grows by one. A tokenizer that begins every text with a BOS token when a model's special tokens are added
(Hugging Face's `add_bos_token`: Llama's and Gemma's tokenizer.json templates, or a tokenizer_config.json beside the
file that sets it) says so in `bos`; whether a run's documents and prompts begin with it is the data's choice
(data.add_bos, `data prepare --bos`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from xlatrain.errors import UserError, first_line

END_OF_TEXT = "<|endoftext|>"
"""The end-of-text token of the BPE tokenizers trained here."""
END_OF_TEXT_NAMES = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
"""The first of these that a tokenizer file knows separates documents."""
TOKENIZER_FILE = "tokenizer.json"
"""Where a trained tokenizer is saved (a run directory, a prepared shard directory)."""


@dataclass(frozen=True)
class Tokenizer:
    name: str
    """What it is, for messages (`bytes`, a path, `bpe-4096`)."""
    vocab_size: int
    """Ids 0..vocab_size - 1, the end-of-text token included."""
    end_of_text: int
    fingerprint: str
    """sha256 of what decides the ids (the tokenizer's serialised form), 16 hex digits."""
    encode_batch: Callable[[list[str]], list[np.ndarray]]
    """Texts -> their ids (no end-of-text), using every core where the library can."""
    decode: Callable[[Sequence[int]], str]
    serialized: str | None = None
    """The Hugging Face tokenizer.json text, to save beside what it tokenized; None for bytes and sentencepiece."""
    bos: int | None = None
    """The id this tokenizer puts before a text when a model's special tokens are added (None: it adds none)."""

    def describe(self) -> dict[str, Any]:
        described = {"name": self.name, "vocab_size": self.vocab_size, "end_of_text": self.end_of_text,
                     "fingerprint": self.fingerprint}
        return described if self.bos is None else {**described, "bos": self.bos}

    def around_documents(self) -> tuple[np.ndarray, np.ndarray]:
        """(what each document begins with: [bos] or nothing, what ends it: [end_of_text]) as uint32 ids."""
        return (np.asarray([] if self.bos is None else [self.bos], np.uint32),
                np.asarray([self.end_of_text], np.uint32))

    def beginning_documents(self, add_bos: bool | None, option: str) -> Tokenizer:
        """This tokenizer as the data uses it: `bos` kept where documents begin with it (add_bos true, or None and
        the tokenizer adds one), else None. `option`: what asked for it, for the refusal of true without a BOS."""
        if add_bos and self.bos is None:
            raise UserError(f"{option}: the tokenizer {self.name} has no BOS token to begin documents with; leave "
                            "it out")
        return self if add_bos is not False else replace(self, bos=None)


def byte_tokenizer() -> Tokenizer:
    """UTF-8 bytes (ids 0..255) and xlatrain's end-of-text, 256."""

    def encode_batch(texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), np.uint8) for text in texts]

    def decode(ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    return Tokenizer("bytes", 257, 256, _digest(b"xlatrain-bytes"), encode_batch, decode)


def byte_level_names() -> list[str]:
    """The printable character that stands for each byte in byte-level BPE files (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(others)) for byte in range(256)]


def bytes_as_hugging_face() -> str:
    """The bytes tokenizer as a tokenizer.json with the same ids (byte b is id b, END_OF_TEXT 256), for the
    checkpoints `xlatrain export --hf` writes."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    tokenizer = HFTokenizer(models.BPE(vocab={name: byte for byte, name in enumerate(byte_level_names())}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer.to_str()


def load_tokenizer(spec: str, named: str = "data.tokenizer") -> Tokenizer:
    """`bytes`, a tokenizer.json, a sentencepiece .model, or a directory holding one of them."""
    if spec == "bytes":
        return byte_tokenizer()
    path = Path(spec)
    if path.is_dir():
        found = [path / name for name in (TOKENIZER_FILE, "tokenizer.model") if (path / name).is_file()]
        if not found:
            raise UserError(f"{named}={spec!r} is a directory without tokenizer.json or tokenizer.model; point it "
                            "at a Hugging Face tokenizer directory or file")
        path = found[0]
    if not path.is_file():
        raise UserError(f"{named}={spec!r} does not exist; give `bytes`, a tokenizer.json, a sentencepiece .model or "
                        "a directory holding one")
    if path.suffix == ".model":
        return _sentencepiece(path, named)
    return _hugging_face(path, named)


def _hugging_face(path: Path, named: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        loaded = HFTokenizer.from_str(path.read_text(encoding="utf-8"))
    except OSError:
        raise
    except Exception as err:  # tokenizers raises plain Exceptions on a file that is not one; non-UTF-8 too
        raise UserError(f"{named}={str(path)!r} is not a Hugging Face tokenizer.json ({first_line(err)[:120]}); "
                        "give the tokenizer.json a model ships with, or `bytes`") from None
    if loaded.to_str() == bytes_as_hugging_face():  # what `export --hf` writes for bytes: the same ids, the same name
        return replace(byte_tokenizer(), name=str(path), serialized=loaded.to_str())
    tokenizer = hugging_face_tokenizer(loaded, str(path))
    return replace(tokenizer, bos=_configured_bos(path, named, loaded.token_to_id, tokenizer.bos))


def hugging_face_tokenizer(tokenizer: Any, name: str, at_least: int = 0) -> Tokenizer:
    """`at_least`: the ids counted, when more than the tokenizer's."""
    serialized = tokenizer.to_str()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    found = [tokenizer.token_to_id(n) for n in END_OF_TEXT_NAMES if tokenizer.token_to_id(n) is not None]
    end_of_text = found[0] if found else size

    def encode_batch(texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.uint32) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode([int(i) for i in ids if i < size], skip_special_tokens=False)

    return Tokenizer(name, max(size, end_of_text + 1, at_least), end_of_text,
                     _digest(serialized.encode(), str(end_of_text).encode()), encode_batch, decode, serialized,
                     _template_bos(tokenizer))


def _template_bos(tokenizer: Any) -> int | None:
    """The one id the tokenizer's post-processor puts before a text's own ids, if it puts exactly one there."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    special = tokenizer.encode("a", add_special_tokens=True).ids
    begin = next((k for k in range(len(special) - len(plain) + 1) if special[k:k + len(plain)] == plain), 0)
    return special[0] if begin == 1 else None


def _configured_bos(path: Path, named: str, token_to_id: Callable[[str], int | None],
                    otherwise: int | None) -> int | None:
    """What a tokenizer_config.json beside the tokenizer file says of its BOS: the id when it sets add_bos_token
    true, None when false, `otherwise` when it does not say."""
    config_path = path.parent / "tokenizer_config.json"
    try:
        settings = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except (OSError, ValueError) as err:
        raise UserError(f"{named}: {config_path} is not readable JSON ({first_line(err)[:120]}); repair it or remove "
                        "it") from None
    if not isinstance(settings, dict) or not isinstance(settings.get("add_bos_token"), bool):
        return otherwise
    if not settings["add_bos_token"]:
        return None
    token = settings.get("bos_token")
    token = token.get("content") if isinstance(token, dict) else token
    found = token_to_id(token) if isinstance(token, str) else None
    if found is None:
        raise UserError(f"{named}: {config_path} sets add_bos_token, but its bos_token {token!r} is not one of the "
                        "tokenizer's tokens; name the tokenizer's BOS token there, or set add_bos_token false")
    return found


def _sentencepiece(path: Path, named: str) -> Tokenizer:
    try:
        import sentencepiece
    except ImportError:
        raise UserError(f"{named}={str(path)!r} is a sentencepiece model, which needs the optional sentencepiece "
                        "package: pip install sentencepiece (or give a tokenizer.json)") from None
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as err:
        raise UserError(f"{named}={str(path)!r} is not a sentencepiece model ({first_line(err)[:120]})") from None
    size = processor.GetPieceSize()
    end_of_text = processor.eos_id() if processor.eos_id() >= 0 else size

    def encode_batch(texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.uint32) for ids in processor.Encode(texts, num_threads=os.cpu_count() or 1)]

    def decode(ids: Sequence[int]) -> str:
        return processor.Decode([int(i) for i in ids if i < size])

    bos = _configured_bos(path, named, lambda token: processor.PieceToId(token)
                          if processor.PieceToId(token) != processor.unk_id() else None, None)
    return Tokenizer(str(path), max(size, end_of_text + 1), end_of_text, _digest(path.read_bytes()), encode_batch,
                     decode, bos=bos)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids (END_OF_TEXT among them) trained on `texts` with `tokenizers`. A
    corpus too small for that many merges gives fewer; the ids past them are never used, but counted, so that
    the vocabulary is the one configured."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return hugging_face_tokenizer(tokenizer, f"bpe-{vocab_size}", vocab_size)


def trained_or_saved(directory: Path, texts: Callable[[], Iterable[str]], vocab_size: int) -> Tokenizer:
    """The BPE of `vocab_size` saved in `directory` (a resumed run reuses the one its first start trained), else
    one trained on `texts()` and saved there, whole or not at all. Its file names the vocab_size asked for (a
    small corpus can give fewer ids); one trained for another vocab_size is refused."""
    path = directory / trained_tokenizer_name(vocab_size)
    others = sorted(p.name for p in directory.glob(trained_tokenizer_name("*")) if p != path)
    if others:
        raise UserError(f"{directory} holds {others[0]}, a tokenizer trained for another data.tokenizer.train."
                        "vocab_size; keep the vocab_size this run started with, or start a new run")
    if path.is_file():
        saved = load_tokenizer(str(path), named=f"the trained tokenizer {path}")
        return replace(saved, vocab_size=max(saved.vocab_size, vocab_size))
    tokenizer = train_bpe(texts(), vocab_size)
    partial = path.with_name(path.name + ".partial")
    directory.mkdir(parents=True, exist_ok=True)
    partial.write_text(tokenizer.serialized, encoding="utf-8")
    partial.replace(path)
    return tokenizer


def trained_tokenizer_name(vocab_size: int | str) -> str:
    return f"tokenizer-bpe-{vocab_size}.json"


def rounded_vocab(tokenizer_size: int, multiple: int) -> int:
    """The model's vocabulary: the tokenizer's ids rounded up to a multiple (padding rows that no id reads)."""
    return -(-tokenizer_size // multiple) * multiple


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()[:16]

