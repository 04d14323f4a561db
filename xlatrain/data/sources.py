"""Built-in random-access sources: sklearn digits, byte-level text, and memory-mapped npy/npz arrays.

Each source is a (train, eval) pair of grain-compatible random-access sources plus a DataSpec.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xlatrain.config import ArrayData, DataConfig, DigitsData, TextData
from xlatrain.data.spec import DataSpec
from xlatrain.errors import UserError

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


Source = ArraySource | TokenWindows | TokenSpans


@dataclass(frozen=True)
class Dataset:
    train: Source
    eval: Source
    spec: DataSpec


def open_dataset(config: DataConfig) -> Dataset:
    if isinstance(config, DigitsData):
        return _digits(config)
    if isinstance(config, TextData):
        return _text(config)
    return _arrays(config)


def default_text_dir() -> Path:
    """This Python's standard-library sources: a text corpus present on every machine, offline."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_text_corpus(directory: Path, pattern: str, max_bytes: int) -> np.ndarray:
    chunks, total = [], 0
    for path in sorted(directory.glob(pattern)):
        if total >= max_bytes:
            break
        if path.is_file():
            data = path.read_bytes()[: max_bytes - total]
            chunks.append(np.frombuffer(data + b"\n", dtype=np.uint8))
            total += len(data) + 1
    if not chunks:
        raise UserError(f"config: data.path={str(directory)!r} has no files matching data.glob={pattern!r}")
    return np.concatenate(chunks)


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


def _text(config: TextData) -> Dataset:
    directory = Path(config.path) if config.path else default_text_dir()
    tokens = read_text_corpus(directory, config.glob, config.max_bytes)
    if config.buckets is not None:
        return _text_paragraphs(tokens, config, directory)
    windows = (len(tokens) - 1) // config.seq_len
    held_out = max(1, int(windows * config.holdout))
    if windows - held_out < 1:
        raise UserError(f"config: data.path={str(directory)!r} holds {len(tokens)} bytes, too few for "
                        f"data.seq_len={config.seq_len}; add text or lower data.seq_len")
    spec = DataSpec((config.seq_len,), np.dtype(np.int32), (config.seq_len,), np.dtype(np.int32), 256)
    return Dataset(TokenWindows(tokens, config.seq_len, 0, windows - held_out),
                   TokenWindows(tokens, config.seq_len, windows - held_out, held_out), spec)


def _text_paragraphs(tokens: np.ndarray, config: TextData, directory: Path) -> Dataset:
    spans = paragraph_spans(tokens, config.seq_len)
    held_out = max(1, int(len(spans) * config.holdout))
    if len(spans) - held_out < 1:
        raise UserError(f"config: data.path={str(directory)!r} holds {len(spans)} paragraphs, too few to "
                        "hold some out; add text")
    buckets = tuple(sorted({*config.buckets, config.seq_len}))
    spec = DataSpec((config.seq_len,), np.dtype(np.int32), (config.seq_len,), np.dtype(np.int32), 256, buckets)
    return Dataset(TokenSpans(tokens, spans[:-held_out]), TokenSpans(tokens, spans[-held_out:]), spec)


def _digits(config: DigitsData) -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    return _split(images, labels, config.holdout, num_outputs=10, shuffle_rows=True)


def _arrays(config: ArrayData) -> Dataset:
    path = Path(config.path)
    inputs, targets = _load_arrays(path)
    if len(inputs) != len(targets):
        raise UserError(f"config: data.path={config.path!r}: inputs has {len(inputs)} rows but targets has "
                        f"{len(targets)}; they must have the same first dimension")
    if np.issubdtype(targets.dtype, np.integer):
        num_outputs = int(np.max(targets)) + 1
    else:
        num_outputs = int(np.prod(targets.shape[1:], dtype=np.int64))
    return _split(inputs, targets, config.holdout, num_outputs=num_outputs, shuffle_rows=False)


def _load_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        if path.is_dir():
            missing = [n for n in ("inputs.npy", "targets.npy") if not (path / n).is_file()]
            if missing:
                raise UserError(f"config: data.path={str(path)!r} lacks {', '.join(missing)}")
            return (np.load(path / "inputs.npy", mmap_mode="r"), np.load(path / "targets.npy", mmap_mode="r"))
        with np.load(path) as archive:
            missing = [n for n in ("inputs", "targets") if n not in archive.files]
            if missing:
                raise UserError(f"config: data.path={str(path)!r} has arrays {archive.files}; it needs "
                                f"{', '.join(missing)}")
            return archive["inputs"], archive["targets"]
    except (ValueError, OSError) as err:
        raise UserError(f"config: data.path={str(path)!r} could not be read as numpy arrays: {err}") from None


def _split(inputs: np.ndarray, targets: np.ndarray, holdout: float, *, num_outputs: int,
           shuffle_rows: bool) -> Dataset:
    rows = np.arange(len(inputs))
    if shuffle_rows:
        rows = np.random.default_rng(_SPLIT_SEED).permutation(rows)
    held_out = max(1, int(len(rows) * holdout))
    if len(rows) - held_out < 1:
        raise UserError(f"data: only {len(rows)} examples; need more than the held-out {held_out}")
    spec = DataSpec(tuple(inputs.shape[1:]), inputs.dtype, tuple(targets.shape[1:]), targets.dtype, num_outputs)
    return Dataset(ArraySource(inputs, targets, rows[:-held_out]), ArraySource(inputs, targets, rows[-held_out:]),
                   spec)
