"""Built-in random-access sources: sklearn digits, text (bytes or tokenized), prepared token shards, and
memory-mapped npy/npz arrays.

Each source is a (train, eval) pair of grain-compatible random-access sources plus a DataSpec.
"""

from __future__ import annotations

import gzip
import importlib.util
import sysconfig
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from xlatrain.config import (
    INT32_MAX,
    ArrayData,
    DataConfig,
    DigitsData,
    TextData,
    TokensData,
    TrainedTokenizer,
)
from xlatrain.data.shards import ShardScans, open_shards, read_manifest
from xlatrain.data.spec import DataSpec
from xlatrain.data.tokenizers import (
    TOKENIZER_FILE,
    Tokenizer,
    byte_tokenizer,
    load_tokenizer,
    token_dtype,
    train_bpe,
    trained_or_saved,
    trained_tokenizer_name,
)
from xlatrain.data.tokens import PackedRows, PreferencePairs, ShardWindows
from xlatrain.errors import UserError, first_line, warn

_SPLIT_SEED = 20261122
"""Held-out splits are fixed, independent of the run's seed, so eval numbers compare across runs."""


@dataclass(frozen=True)
class ArraySource:
    """Rows of aligned input/target arrays (possibly memory-mapped) as {'inputs', 'targets'} records."""

    inputs: np.ndarray
    targets: np.ndarray
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = self.rows[index]
        return {"inputs": np.asarray(self.inputs[row]), "targets": np.asarray(self.targets[row])}


@dataclass(frozen=True)
class TokenWindows:
    """Windows of seq_len + 1 bytes at stride seq_len, as next-token (inputs, targets) records."""

    tokens: np.ndarray
    seq_len: int
    first: int
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start = (self.first + index) * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1].astype(np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}


@dataclass(frozen=True)
class TokenSpans:
    """Variable-length next-token examples: token[start:stop] -> (inputs, targets), one per span."""

    tokens: np.ndarray
    spans: np.ndarray
    """[n, 2] start/stop offsets; every span holds at least two tokens."""

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start, stop = self.spans[index]
        window = self.tokens[start:stop].astype(np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}


Source = ArraySource | TokenWindows | TokenSpans | ShardWindows | PackedRows | PreferencePairs


@dataclass(frozen=True)
class Dataset:
    train: Source
    eval: Source
    spec: DataSpec


def open_dataset(config: DataConfig, loss: str = "cross_entropy", run_dir: Path | None = None,
                 shard_scans: Path | None = None) -> Dataset:
    """The data of a run, checked against the loss (model.loss) that will read its targets. `run_dir`: where a
    tokenizer that a text run trains is kept (None: in memory only, for what only traces the model);
    `shard_scans`: where the largest ids of token shards prepared before their manifests recorded them are kept
    (data/shards.py's ShardScans; None: scanned each time)."""
    if isinstance(config, DigitsData):
        return _digits(config)
    if isinstance(config, TextData):
        return _text(config, run_dir)
    if isinstance(config, TokensData):
        return _tokens(config, ShardScans(shard_scans))
    return _arrays(config, loss)


def default_text_dir() -> Path:
    """This Python's standard-library sources: a text corpus present on every machine, offline."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_text_corpus(directory: Path, pattern: str, max_bytes: int) -> np.ndarray:
    """The files' bytes, each followed by a newline."""
    return np.concatenate([np.frombuffer(data + b"\n", dtype=np.uint8)
                           for _, data in read_text_files(directory, pattern, max_bytes)])


def read_text_files(directory: Path, pattern: str, max_bytes: int) -> list[tuple[Path, bytes]]:
    """(path, bytes) of the files matching `pattern` in sorted order, up to max_bytes in all (a newline after
    each counted)."""
    files, total = [], 0
    for path in sorted(directory.glob(pattern)):
        if total >= max_bytes:
            break
        if path.is_file():
            data = path.read_bytes()[: max_bytes - total]
            files.append((path, data))
            total += len(data) + 1
    if not files:
        raise UserError(f"config: data.path={str(directory)!r} has no files matching data.glob={pattern!r}")
    return files


def paragraph_spans(tokens: np.ndarray, max_len: int) -> np.ndarray:
    """[n, 2] spans of the paragraphs (text between blank lines), cut into pieces of at most max_len + 1
    bytes (inputs and shifted targets of at most max_len); pieces shorter than two bytes are dropped."""
    blank = np.flatnonzero((tokens[:-1] == ord("\n")) & (tokens[1:] == ord("\n"))) + 1
    starts = np.concatenate([[0], blank + 1])
    stops = np.concatenate([blank, [len(tokens)]])
    spans = [(begin, min(begin + max_len + 1, stop))
             for start, stop in zip(starts, stops, strict=True) for begin in range(start, stop, max_len)]
    spans = np.asarray(spans, np.int64).reshape(-1, 2)
    return spans[spans[:, 1] - spans[:, 0] >= 2]


def _text(config: TextData, run_dir: Path | None) -> Dataset:
    directory = Path(config.path) if config.path else default_text_dir()
    if config.buckets is not None:
        return _text_paragraphs(read_text_corpus(directory, config.glob, config.max_bytes), config, directory)
    if config.tokenizer == "bytes":
        tokens, vocab, described = read_text_corpus(directory, config.glob, config.max_bytes), 256, None
    else:
        texts = [decoded(path, data) for path, data in read_text_files(directory, config.glob, config.max_bytes)]
        tokenizer = _text_tokenizer(config, texts, run_dir).beginning_documents(config.add_bos, "data.add_bos=true")
        tokens, vocab, described = tokenize_documents(texts, tokenizer), tokenizer.vocab_size, tokenizer.describe()
    windows = (len(tokens) - 1) // config.seq_len
    held_out = max(1, int(windows * config.holdout))
    if windows - held_out < 1:
        raise UserError(f"config: data.path={str(directory)!r} holds {len(tokens)} tokens, too few for "
                        f"data.seq_len={config.seq_len}; add text or lower data.seq_len")
    spec = DataSpec((config.seq_len,), np.dtype(np.int32), (config.seq_len,), np.dtype(np.int32), vocab,
                    f"data.path={str(directory)!r}", tokenizer=described)
    return Dataset(TokenWindows(tokens, config.seq_len, 0, windows - held_out),
                   TokenWindows(tokens, config.seq_len, windows - held_out, held_out), spec)


def decoded(path: Path | str, data: bytes) -> str:
    """A file's text; one that is not UTF-8 is an error naming it and the byte where it stops being so."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 text (byte {err.start}: {data[err.start:err.start + 1]!r}); convert "
                        "it (iconv -t utf-8) or leave it out") from None


def _text_tokenizer(config: TextData, texts: list[str], run_dir: Path | None) -> Tokenizer:
    """data.tokenizer of a text run; one to train learns from the files of the leading, training part."""
    if not isinstance(config.tokenizer, TrainedTokenizer):
        return load_tokenizer(config.tokenizer)
    vocab_size = config.tokenizer.train.vocab_size
    training = texts[: max(1, int(len(texts) * (1 - config.holdout)))]
    if run_dir is None:
        return train_bpe(training, vocab_size)
    return trained_or_saved(run_dir, lambda: training, vocab_size)


def tokenize_documents(texts: list[str], tokenizer: Tokenizer) -> np.ndarray:
    """The texts' ids, each text after the tokenizer's BOS (where it has one) and followed by end-of-text, as one
    stream of the smallest dtype that holds them."""
    begin, end = tokenizer.around_documents()
    ids = tokenizer.encode_batch(texts)
    return np.concatenate([part for text_ids in ids for part in (begin, text_ids.astype(np.uint32), end)]).astype(
        token_dtype(tokenizer.vocab_size))


def _tokens(config: TokensData, scans: ShardScans) -> Dataset:
    shards = open_shards(Path(config.path), scans=scans)
    if config.tokenizer is not None:
        expected = load_tokenizer(config.tokenizer)
        made_with = shards.manifest["tokenizer"]
        if expected.fingerprint != made_with["fingerprint"]:
            raise UserError(f"data.path={config.path!r} was prepared with tokenizer {made_with['name']} "
                            f"(fingerprint {made_with['fingerprint']}), not data.tokenizer="
                            f"{config.tokenizer!r} ({expected.fingerprint}); prepare the shards with it, or drop "
                            "data.tokenizer")
    if shards.pairs and config.packing:
        raise UserError(f"data.path={config.path!r} holds preference pairs, each sequence a row of its own, which "
                        "are not packed: set data.packing=false")
    if shards.weighted and not shards.pairs and not config.packing:
        raise UserError(f"data.path={config.path!r} holds fine-tuning examples with loss weights, each to be read "
                        "whole: set data.packing=true")
    source = PreferencePairs if shards.pairs else PackedRows if config.packing else ShardWindows
    train, held_out = source(shards.train, config.seq_len), source(shards.eval, config.seq_len)
    for split, examples in (("training", train), ("held-out", held_out)):
        if shards.weighted:
            _report_cut_examples(examples, split, config)
        if not len(examples):
            raise UserError(f"data.path={config.path!r}: its {split} shards hold too few tokens for one example of "
                            f"data.seq_len={config.seq_len}; lower data.seq_len or prepare more text")
    spec = DataSpec((config.seq_len,), np.dtype(np.int32), (config.seq_len,), np.dtype(np.int32), shards.vocab_size,
                    f"data.path={config.path!r}", documents=config.packing,
                    tokenizer={**shards.manifest["tokenizer"], "shards": shards.fingerprint}, pairs=shards.pairs)
    return Dataset(train, held_out, spec)


def _report_cut_examples(examples: PackedRows | PreferencePairs, split: str, config: TokensData) -> None:
    """One line for the examples cut by seq_len (TRL's keep_start) and those skipped with no weighted token left;
    a split left with none is an error."""
    if not len(examples):
        raise UserError(f"data.path={config.path!r}: none of its {split} examples has a token it trains on within "
                        f"data.seq_len={config.seq_len} (all {examples.skipped} skipped); raise data.seq_len or "
                        "prepare shorter examples")
    if examples.truncated or examples.skipped:
        warn(f"data.path={config.path!r}: {examples.truncated} {split} examples cut to their first "
             f"{config.seq_len + 1} tokens (data.seq_len={config.seq_len}), {examples.skipped} skipped (no token "
             "they train on within that)")


def _text_paragraphs(tokens: np.ndarray, config: TextData, directory: Path) -> Dataset:
    spans = paragraph_spans(tokens, config.seq_len)
    held_out = max(1, int(len(spans) * config.holdout))
    if len(spans) - held_out < 1:
        raise UserError(f"config: data.path={str(directory)!r} holds {len(spans)} paragraphs, too few to "
                        "hold some out; add text")
    buckets = tuple(sorted({*config.buckets, config.seq_len}))
    spec = DataSpec((config.seq_len,), np.dtype(np.int32), (config.seq_len,), np.dtype(np.int32), 256,
                    buckets=buckets)
    return Dataset(TokenSpans(tokens, spans[:-held_out]), TokenSpans(tokens, spans[-held_out:]), spec)


def _digits(config: DigitsData) -> Dataset:
    images, labels = digits_images_and_labels()
    images = (images / 16.0).astype(np.float32)
    return _split(images, labels.astype(np.int32), config.holdout, num_outputs=10, shuffle_rows=True,
                  origin="data.source=digits")


def digits_images_and_labels() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (8 x 8 images of 0-16, labels), read from the file it ships as its load_digits reads
    it, without importing scikit-learn (about 1.6 s of a start's 7 on two cores); through load_digits where the
    file is elsewhere."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images, digits.target
    with gzip.open(path, mode="rt", encoding="utf-8") as rows:
        table = np.loadtxt(rows, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def _arrays(config: ArrayData, loss: str) -> Dataset:
    path = Path(config.path)
    inputs, targets = _load_arrays(path)
    _check_arrays(f"data.path={config.path!r}", inputs, targets, loss)
    if np.issubdtype(targets.dtype, np.integer):
        num_outputs = int(np.max(targets)) + 1
    else:
        num_outputs = int(np.prod(targets.shape[1:], dtype=np.int64))
    return _split(inputs, targets, config.holdout, num_outputs=num_outputs, shuffle_rows=False,
                  origin=f"data.path={config.path!r}")


def _check_arrays(where: str, inputs: np.ndarray, targets: np.ndarray, loss: str) -> None:
    """What the model and the loss need of the arrays, each problem naming the file, the key and the value."""
    for key, array in (("inputs", inputs), ("targets", targets)):
        if array.ndim == 0 or len(array) == 0:
            raise UserError(f"data: {where}: {key} is empty (shape {list(array.shape)}); give one row per example")
        if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_) or np.iscomplexobj(array):
            raise UserError(f"data: {where}: {key} has dtype {array.dtype}; use real numbers (float or int)")
    if np.issubdtype(inputs.dtype, np.floating) and not np.all(np.isfinite(inputs)):
        row = int(np.flatnonzero(~np.isfinite(np.asarray(inputs).reshape(len(inputs), -1)).all(axis=1))[0])
        raise UserError(f"data: {where}: inputs[{row}] holds NaN or inf; clean or drop that row")
    if len(inputs) != len(targets):
        raise UserError(f"data: {where}: inputs has {len(inputs)} rows but targets has {len(targets)}; they must "
                        "have the same first dimension")
    if loss == "cross_entropy":
        if not np.issubdtype(targets.dtype, np.integer):
            raise UserError(f"data: {where}: targets has dtype {targets.dtype}, but model.loss=cross_entropy needs "
                            "integer class labels 0..classes-1; convert them (e.g. targets.astype('int32')) or use "
                            "model.loss=mse for real-valued targets")
        lowest = int(np.min(targets))
        if lowest < 0:
            row = int(np.argmin(np.asarray(targets).reshape(len(targets), -1).min(axis=1)))
            raise UserError(f"data: {where}: targets[{row}] holds the label {lowest}; class labels must be "
                            "0..classes-1")
        highest = int(np.max(targets))
        if highest >= INT32_MAX:  # classes = highest + 1 must be an int32, as the labels and the logits' axis are
            row = int(np.argmax(np.asarray(targets).reshape(len(targets), -1).max(axis=1)))
            raise UserError(f"data: {where}: targets[{row}] holds the label {highest}, which would make "
                            f"{highest + 1} classes, more than an int32 counts ({INT32_MAX}); class labels must be "
                            "0..classes-1: remap them to consecutive ids")
    elif not np.all(np.isfinite(np.asarray(targets, np.float64))):
        raise UserError(f"data: {where}: targets holds NaN or inf; model.loss=mse needs finite targets")


def _load_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        if path.is_dir():
            missing = [n for n in ("inputs.npy", "targets.npy") if not (path / n).is_file()]
            if missing:
                raise UserError(f"config: data.path={str(path)!r} lacks {', '.join(missing)}")
            return (np.load(path / "inputs.npy", mmap_mode="r"), np.load(path / "targets.npy", mmap_mode="r"))
        loaded = np.load(path)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise UserError(f"config: data.path={str(path)!r} holds one array; give an .npz file with arrays "
                            "'inputs' and 'targets' (np.savez(path, inputs=..., targets=...)), or a directory of "
                            "inputs.npy and targets.npy")
        with loaded as archive:
            missing = [n for n in ("inputs", "targets") if n not in archive.files]
            if missing:
                raise UserError(f"config: data.path={str(path)!r} has arrays {archive.files}; it needs "
                                f"{', '.join(missing)}")
            return archive["inputs"], archive["targets"]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise UserError(f"config: data.path={str(path)!r} could not be read as numpy arrays (an .npz file, or a "
                        f"directory of inputs.npy and targets.npy): {type(err).__name__}: {first_line(err)}") from None


def _split(inputs: np.ndarray, targets: np.ndarray, holdout: float, *, num_outputs: int, origin: str,
           shuffle_rows: bool) -> Dataset:
    rows = np.arange(len(inputs))
    if shuffle_rows:
        rows = np.random.default_rng(_SPLIT_SEED).permutation(rows)
    held_out = max(1, int(len(rows) * holdout))
    if len(rows) - held_out < 1:
        raise UserError(f"data: only {len(rows)} examples; need more than the held-out {held_out}")
    spec = DataSpec(tuple(inputs.shape[1:]), inputs.dtype, tuple(targets.shape[1:]), targets.dtype, num_outputs,
                    origin)
    return Dataset(ArraySource(inputs, targets, rows[:-held_out]), ArraySource(inputs, targets, rows[-held_out:]),
                   spec)


def run_tokenizer(config: DataConfig, run_dir: Path) -> Tokenizer | None:
    """The tokenizer a run's token ids are in (what sampling encodes its prompt with and decodes its output with),
    or None when its data came as ids (data.source=arrays) or as shards without a tokenizer file."""
    if isinstance(config, TextData):
        if isinstance(config.tokenizer, TrainedTokenizer):
            path = run_dir / trained_tokenizer_name(config.tokenizer.train.vocab_size)
            if not path.is_file():
                raise UserError(f"{run_dir}: the tokenizer this run trained ({path.name}) is gone; restore it from "
                                "the run's first start")
            tokenizer = load_tokenizer(str(path), named=f"the trained tokenizer {path}")
        else:
            tokenizer = load_tokenizer(config.tokenizer)
        return tokenizer.beginning_documents(config.add_bos, "data.add_bos=true")
    if isinstance(config, TokensData):
        made_with = read_manifest(Path(config.path))["tokenizer"]
        saved = Path(config.path) / TOKENIZER_FILE
        if config.tokenizer is not None:
            tokenizer = load_tokenizer(config.tokenizer)
        elif made_with["name"] == "bytes":
            tokenizer = byte_tokenizer()
        elif saved.is_file():
            tokenizer = load_tokenizer(str(saved), named=f"data.path's {TOKENIZER_FILE}")
        else:
            return None
        return replace(tokenizer, bos=made_with.get("bos"))
    return None
