"""`xlatrain data prepare`: text files, JSONL or Parquet -> token shards with a manifest (xlatrain/data/shards.py).

JSONL and Parquet records are read in TRL's formats (xlatrain/data/records.py), told apart by their fields, one
format per preparation: text documents as before, or fine-tuning examples (prompt-completion, conversations)
written with each token's loss weight. `--field` names a text field and reads every record as a document.

Three stages overlap, each on its own thread: reading and parsing a batch of documents, encoding the one before
it on every core (Hugging Face `tokenizers` and sentencepiece encode a batch in parallel, without the GIL), and
writing the one before that. Every k-th document
(k = 1 / --holdout) goes to the held-out split. Shards are written under partial names and renamed when whole;
the manifest comes last. Re-running on the same inputs and options finds the manifest's request unchanged and does
nothing; a directory left by an interrupted run is cleared of its own partial shards and written again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from xlatrain.config.data import BPE_VOCAB, stays_inside
from xlatrain.data.chat import TEMPLATE_FILES, template_files
from xlatrain.data.records import LANGUAGE_MODELING, LOSS_ON, Weighting, record_format, weighting
from xlatrain.data.shards import (
    FORMAT,
    MANIFEST,
    SPLITS,
    VERSION,
    WEIGHTED_VERSION,
    index_name,
    manifest_fingerprint,
    shard_name,
    weights_name,
)
from xlatrain.data.sources import decoded
from xlatrain.data.tokenizers import (
    TOKENIZER_FILE,
    Tokenizer,
    load_tokenizer,
    token_dtype,
    train_bpe,
)
from xlatrain.errors import UserError, first_line
from xlatrain.run.atomic import replace_file

BATCH_BYTES = 4 << 20
"""Text encoded per call of the tokenizer: enough for its threads to share, little enough to overlap reading."""
JSON_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIX = ".parquet"


@dataclass(frozen=True)
class Request:
    """What a preparation is asked to do; the manifest keeps its fingerprint, so a repeat is recognised."""

    inputs: tuple[Path, ...]
    out: Path
    tokenizer: str = "bytes"
    train_vocab: int | None = None
    field: str | None = None
    """The text of a JSONL line or a Parquet row; None: the records' fields tell their format (`text` for text)."""
    glob: str = "**/*"
    """Which files under an input directory."""
    holdout: float = 0.01
    shard_tokens: int = 1 << 28
    """Tokens per shard file, about (a shard ends after the document that reaches it)."""
    bos: bool | None = None
    """Whether each document begins with the tokenizer's BOS token (None: where the tokenizer adds one)."""
    loss_on: str = "auto"
    """Which tokens of fine-tuning examples the loss counts (xlatrain/data/records.py's LOSS_ON)."""

    @property
    def text_field(self) -> str:
        return self.field or "text"

    def fingerprint(self, files: list[Path], tokenizer: Tokenizer | None, weighted: Weighting | None) -> str:
        """Inputs by name, size and modification time (not read), and every option that changes the shards.
        `tokenizer`: the one given (None: one to train); `weighted`: how examples are weighted, None for text."""
        described = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
        which = f"train:{self.train_vocab}" if tokenizer is None else tokenizer.fingerprint
        body = [described, which, self.text_field, self.holdout, self.shard_tokens]
        if tokenizer is not None and tokenizer.bos is not None:  # before --bos existed, documents began with none
            body.append(["bos", tokenizer.bos])
        if weighted is not None:
            body.append(["records", weighted.format, weighted.loss_on])
        return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:16]


@dataclass
class ShardWriter:
    """One split's shards, each written under a partial name and renamed once whole."""

    directory: Path
    split: str
    dtype: np.dtype
    shard_tokens: int
    weighted: bool = False
    """Whether each token's loss weight is written beside the shard."""
    shards: list[dict[str, Any]] = field(default_factory=list)
    _pieces: list[np.ndarray] = field(default_factory=list)
    _weights: list[np.ndarray] = field(default_factory=list)
    _bounds: list[int] = field(default_factory=lambda: [0])

    def add(self, *pieces: np.ndarray, weights: np.ndarray | None = None) -> None:
        """One document, in pieces: for text, `begin` (the BOS token where documents begin with one, else empty),
        its ids, then the end-of-text token (Tokenizer.around_documents); for an example, its ids whole with each
        one's loss `weights`."""
        self._pieces += pieces
        if self.weighted:
            self._weights.append(weights)
        self._bounds.append(self._bounds[-1] + sum(len(piece) for piece in pieces))

    def close_if_full(self) -> None:
        """Ends the shard once it holds shard_tokens; called after a record's documents (a preference pair's two
        stay in one shard)."""
        if self._bounds[-1] >= self.shard_tokens:
            self.close()

    def close(self) -> None:
        if len(self._bounds) == 1:
            return
        name = shard_name(self.split, len(self.shards))
        tokens = np.concatenate(self._pieces).astype(self.dtype, copy=False)
        replace_file(self.directory / name, lambda partial: tokens.tofile(partial))
        replace_file(self.directory / index_name(name),
                     lambda partial: np.save(partial.open("wb"), np.asarray(self._bounds, np.int64)))
        entry = {"file": name, "tokens": len(tokens), "documents": len(self._bounds) - 1, "max_id": int(tokens.max())}
        if self.weighted:
            weights = np.concatenate(self._weights).astype(np.uint8)
            replace_file(self.directory / weights_name(name), lambda partial: np.save(partial.open("wb"), weights))
            entry |= {"weights": weights_name(name), "weighted": int(np.sum(weights, dtype=np.int64))}
        self.shards.append(entry)
        self._pieces, self._weights, self._bounds = [], [], [0]

    def summary(self) -> dict[str, Any]:
        return {"documents": sum(s["documents"] for s in self.shards), "tokens": sum(s["tokens"] for s in self.shards),
                "shards": self.shards}


def prepare(request: Request) -> dict[str, Any]:
    """Writes the shards and the manifest (or finds them written already); returns the manifest. A preparation
    that fails leaves --out as it found it: what it wrote is removed, and so are the directories it made."""
    check_options(request)
    every = holdout_stride(request.holdout)
    files = input_files(request.inputs, request.glob)
    given = None if request.train_vocab else load_tokenizer(request.tokenizer, "--tokenizer").beginning_documents(
        request.bos, "data prepare --bos")
    weighted = examples_weighting(request, files, given)
    asked = request.fingerprint(files, given, weighted)
    existing = _existing_manifest(request.out)
    if existing is not None and existing.get("request") == asked:
        print(f"xlatrain: {request.out} already holds these inputs prepared ({_counts(existing)}); nothing to do")
        return existing
    if existing is not None:
        raise UserError(f"--out {request.out} holds shards prepared from other inputs or options; give another --out "
                        "directory or delete that one (nothing was overwritten)")
    made = _directories_made(request.out)
    try:
        return _write_shards(request, files, given, weighted, asked, every)
    except BaseException:
        _clear_partial_run(request.out)
        with contextlib.suppress(OSError):  # one that something else wrote into meanwhile stays
            for directory in made:
                directory.rmdir()
        raise


def _write_shards(request: Request, files: list[Path], given: Tokenizer | None, weighted: Weighting | None,
                  asked: str, every: int) -> dict[str, Any]:
    tokenizer = given or _trained_tokenizer(request, files)
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {split: ShardWriter(request.out, split, dtype, request.shard_tokens, weighted is not None)
               for split in SPLITS}
    begin, end = tokenizer.around_documents()
    total = sum(p.stat().st_size for p in files)
    index = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="xlatrain data prepare", file=sys.stderr,
              disable=None) as progress:
        if weighted is None:
            read = _read_ahead(_batches(files, request.text_field))
            encoded_batches = _read_ahead(([[((begin, ids, end), None)] for ids in tokenizer.encode_batch(texts)],
                                           size) for texts, size in read)
        else:
            encoded_batches = _read_ahead(_weighted_batches(files, weighted))
        for encoded, size in encoded_batches:
            for documents in encoded:
                writer = writers["eval" if index % every == 0 else "train"]
                for pieces, weights in documents:
                    writer.add(*pieces, weights=weights)
                writer.close_if_full()
                index += 1
            progress.update(min(size, total - progress.n))
        progress.update(total - progress.n)
    for writer in writers.values():
        writer.close()
    if not writers["train"].shards or not writers["eval"].shards:
        raise UserError(f"data prepare: {index} documents are too few to hold one in {every} out and train on the "
                        "rest; give more documents or raise --holdout")
    if tokenizer.serialized is not None:
        replace_file(request.out / TOKENIZER_FILE, lambda p: p.write_text(tokenizer.serialized, encoding="utf-8"))
    for name, text in (template_files(request.tokenizer) if weighted is not None else {}).items():
        replace_file(request.out / name, lambda p, text=text: p.write_text(text, encoding="utf-8"))
    manifest = {"format": FORMAT, "version": VERSION if weighted is None else WEIGHTED_VERSION, "request": asked,
                "tokenizer": tokenizer.describe(), "dtype": dtype.name, "holdout_every": every, "inputs": len(files),
                "splits": {split: writer.summary() for split, writer in writers.items()}}
    if weighted is not None:
        manifest["examples"] = {"format": weighted.format, "loss_on": weighted.loss_on}
    manifest["fingerprint"] = manifest_fingerprint(manifest)
    replace_file(request.out / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1), encoding="utf-8"))
    print(f"xlatrain: wrote {_counts(manifest)} to {request.out}")
    return manifest


def check_options(request: Request) -> None:
    """The options that need no file read, each refused in one line naming it."""
    if request.bos and request.train_vocab is not None:
        raise UserError("data prepare: --bos with --train-tokenizer: the byte-level BPE trained here has no BOS token; "
                        "leave --bos out")
    low, high = BPE_VOCAB
    if request.train_vocab is not None and not low <= request.train_vocab <= high:
        raise UserError(f"data prepare: --train-tokenizer {request.train_vocab} is outside {low}..{high:,}: a "
                        f"byte-level BPE holds the 256 bytes and its end-of-text token ({low} ids) and at most "
                        f"{high:,}")
    if request.loss_on not in LOSS_ON:
        raise UserError(f"data prepare: --loss-on {request.loss_on!r} is none of {', '.join(LOSS_ON)}")
    if request.field is not None and request.loss_on != "auto":
        raise UserError("data prepare: --loss-on weighs fine-tuning examples, and --field reads every record as text; "
                        "leave one of them out")
    if not stays_inside(request.glob):
        raise UserError(f"data prepare: --glob {request.glob!r} must be a non-empty pattern relative to each INPUT "
                        "directory, without `..` (e.g. '**/*.txt'); name files elsewhere as INPUTs of their own")


def holdout_stride(holdout: float) -> int:
    """Every k-th document is held out (the first among them), k the nearest whole number to 1 / holdout."""
    if not 0 < holdout <= 0.5:
        raise UserError(f"data prepare: --holdout={holdout} must be a fraction in (0, 0.5]")
    return max(2, round(1 / holdout))


def input_files(inputs: tuple[Path, ...], glob: str) -> list[Path]:
    """The files to read: each input file, and the files under each input directory matching `glob`, in sorted
    order; one that is missing, unreadable or empty is an error naming it."""
    files: list[Path] = []
    for given in inputs:
        if given.is_dir():
            matched = sorted(p for p in given.glob(glob) if p.is_file())
            if not matched:
                raise UserError(f"data prepare: {given} has no files matching --glob {glob!r}")
            files.extend(matched)
        elif given.is_file():
            files.append(given)
        else:
            raise UserError(f"data prepare: {given} does not exist; give text, JSONL or Parquet files or directories")
    for path in files:
        try:
            with path.open("rb") as opened:
                empty = not opened.read(1)
        except OSError as err:
            raise UserError(f"data prepare: {path} cannot be read ({err.strerror}); fix its permissions or leave it "
                            "out") from None
        if empty:
            raise UserError(f"data prepare: {path} is empty; remove it or leave it out")
    return files


def documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one input: a JSONL line's or a Parquet row's `text_field`, or a whole text file."""
    if path.suffix in JSON_SUFFIXES:
        for where, record in _json_records(path):
            if not isinstance(record, dict) or text_field not in record:
                fields = ", ".join(list(record)[:8]) if isinstance(record, dict) else type(record).__name__
                raise UserError(f"data prepare: {where} has no field {text_field!r} (it has: {fields}); name the "
                                "text field with --field")
            if not isinstance(record[text_field], str):
                raise UserError(f"data prepare: {where}: field {text_field!r} holds "
                                f"{type(record[text_field]).__name__}, not text")
            yield record[text_field]
    elif path.suffix == PARQUET_SUFFIX:
        yield from _parquet_rows(path, text_field)
    else:
        yield decoded(path, path.read_bytes())


def records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for each JSONL line or Parquet row of a file."""
    if path.suffix in JSON_SUFFIXES:
        yield from _json_records(path)
        return
    table = _parquet_file(path)
    number = 0
    for batch in table.iter_batches():
        for row in batch.to_pylist():
            number += 1
            yield f"{path}:row {number}", row


def examples_weighting(request: Request, files: list[Path], tokenizer: Tokenizer | None) -> Weighting | None:
    """How the inputs' fine-tuning examples are weighted; None for text (a --field, text files, `text` records).
    Every file's first record tells its format; files of two formats are refused."""
    if request.field is not None:
        return None
    formats = {path: _file_format(path) for path in files}
    kinds = sorted(set(formats.values()))
    if len(kinds) > 1:
        first, second = (next(path for path, found in formats.items() if found == kind) for kind in kinds[:2])
        raise UserError(f"data prepare: {first} holds {kinds[0]} records and {second} {kinds[1]} records; prepare "
                        "each format into its own --out")
    format = kinds[0]
    if format == LANGUAGE_MODELING:
        if request.loss_on != "auto":
            raise UserError(f"data prepare: --loss-on {request.loss_on} weighs fine-tuning examples, and the inputs "
                            "are text; leave it out")
        return None
    if tokenizer is None:
        raise UserError(f"data prepare: {format} records are tokenized as the model to fine-tune was: give its "
                        "tokenizer with --tokenizer, not --train-tokenizer")
    return weighting(format, request.loss_on, tokenizer, request.tokenizer)


def _file_format(path: Path) -> str:
    if path.suffix == PARQUET_SUFFIX:
        return record_format(dict.fromkeys(_parquet_file(path).schema_arrow.names), str(path))
    if path.suffix in JSON_SUFFIXES:
        where, first = next(_json_records(path), (str(path), {}))
        return record_format(first, where)
    return LANGUAGE_MODELING


def _json_records(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(decoded(where, line))
            except json.JSONDecodeError as err:
                raise UserError(f"data prepare: {where} is not a JSON object ({err.msg}); give one object per "
                                "line") from None


def _parquet_file(path: Path) -> Any:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise UserError(f"data prepare: {path} is Parquet, which needs pyarrow: pip install 'xlatrain[parquet]'"
                        ) from None
    try:
        return parquet.ParquetFile(path)
    except Exception as err:  # pyarrow's ArrowInvalid and OSError on a file that is not Parquet
        raise UserError(f"data prepare: {path} could not be read as Parquet ({first_line(err)[:120]})") from None


def _parquet_rows(path: Path, text_field: str) -> Iterator[str]:
    table = _parquet_file(path)
    names = table.schema_arrow.names
    if text_field not in names:
        raise UserError(f"data prepare: {path} has no column {text_field!r} (it has: {', '.join(names[:8])}); name "
                        "the text column with --field")
    for batch in table.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _weighted_batches(files: list[Path], weighted: Weighting, batch: int = 256
                      ) -> Iterator[tuple[list[list[tuple[tuple[np.ndarray], np.ndarray]]], int]]:
    """Each record's documents as ((ids,), weights), in batches, each file's size counted when it is read; a record
    of another format than the first is refused."""
    documents: list = []
    for path in files:
        for where, record in records(path):
            if (found := record_format(record, where)) != weighted.format:
                raise UserError(f"data prepare: {where} is a {found} record in a file of {weighted.format} records; "
                                "give one format per preparation")
            documents.append([((ids,), weights) for ids, weights in weighted.documents(record, where)])
            if len(documents) == batch:
                yield documents, 0
                documents = []
        yield documents, path.stat().st_size
        documents = []


def _batches(files: list[Path], text_field: str) -> Iterator[tuple[list[str], int]]:
    """Documents in batches of about BATCH_BYTES of text, each with its size (for the progress bar)."""
    texts, size = [], 0
    for path in files:
        for text in documents(path, text_field):
            texts.append(text)
            size += len(text)
            if size >= BATCH_BYTES:
                yield texts, size
                texts, size = [], 0
    if texts:
        yield texts, size


def _read_ahead(batches: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """`batches` produced on a background thread, `depth` ahead: reading and parsing overlap encoding."""
    ahead: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce() -> None:
        try:
            for item in batches:
                ahead.put(item)
            ahead.put(done)
        except BaseException as err:  # re-raised on the consuming thread
            ahead.put(err)

    threading.Thread(target=produce, name="xlatrain-prepare-reader", daemon=True).start()
    while (item := ahead.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def _trained_tokenizer(request: Request, files: list[Path]) -> Tokenizer:
    every = holdout_stride(request.holdout)

    def training_texts() -> Iterator[str]:
        index = 0
        for path in files:
            for text in documents(path, request.text_field):
                if index % every:
                    yield text
                index += 1

    print(f"xlatrain: training a byte-level BPE of {request.train_vocab} ids on the training documents",
          file=sys.stderr)
    return train_bpe(training_texts(), request.train_vocab)


def _existing_manifest(out: Path) -> dict[str, Any] | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise UserError(f"--out {out}: its {MANIFEST} is damaged; delete the directory or give another --out"
                        ) from None


def _directories_made(out: Path) -> list[Path]:
    """Makes --out and its missing parents; returns those it made, --out first (the order to remove them in). What
    an interrupted preparation left there (its shards, never listed by a manifest) is removed; a directory that
    holds anything else is refused, so that nothing of the user's is overwritten."""
    missing, directory = [], out
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out} cannot be created ({err.strerror}); name a directory you can write") from None
    _clear_partial_run(out)  # a directory it made holds nothing: this refuses only one that was there
    return missing


def _clear_partial_run(out: Path) -> None:
    """Removes this command's files from --out, refusing it where it holds anything else."""
    ours = [p for p in out.iterdir() if _written_here(p.name)]
    others = [p.name for p in out.iterdir() if p not in ours]
    if others:
        raise UserError(f"--out {out} holds files that are not token shards ({', '.join(sorted(others)[:3])}); give "
                        "an empty or new directory")
    for path in ours:
        path.unlink()


def _written_here(name: str) -> bool:
    bare = name.removesuffix(".partial")
    return (bare in (TOKENIZER_FILE, *TEMPLATE_FILES)
            or any(bare.startswith(f"{split}-") and bare.endswith((".bin", ".idx.npy", ".weights.npy"))
                   for split in SPLITS))


def _counts(manifest: dict[str, Any]) -> str:
    train, held_out = manifest["splits"]["train"], manifest["splits"]["eval"]
    return (f"{train['documents']:,} training documents ({train['tokens']:,} tokens) and {held_out['documents']:,} "
            f"held out ({held_out['tokens']:,} tokens), {manifest['dtype']}")
