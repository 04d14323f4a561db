"""Prepared token shards (`xlatrain data prepare` writes them, `data.source: tokens` reads them).

A shard directory holds, per split (`train`, `eval`), flat token files `SPLIT-NNNNN.bin` (the ids as raw uint16 or
uint32, nanoGPT's layout, every document followed by the end-of-text token) and beside each its document
boundaries `SPLIT-NNNNN.idx.npy` (int64 offsets, documents + 1 of them), both read memory-mapped; the tokenizer
that made them (`tokenizer.json`, when it is a Hugging Face one); and `manifest.json`, written last: a shard the
manifest does not list is never read, so an interrupted preparation leaves nothing that a run would take.

Shards of fine-tuning examples (manifest version 2) also hold each token's loss weight as a target,
`SPLIT-NNNNN.weights.npy` (uint8: 1 on an answer's tokens), and each of their documents is one example, read
whole; version 1 shards (text) read with weight 1 everywhere.

Before a run reads them, every shard's boundaries are checked (in order, inside the shard: cheap, one int64 per
document) and its largest id is compared with the tokenizer's ids: the manifest records it (`max_id`) since
`data prepare` wrote it; shards prepared before that are scanned once, and the scan kept beside the run
(`ShardScans`), so that bad ids are found before the first step, not as padding rows trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from xlatrain.errors import UserError, first_line

MANIFEST = "manifest.json"
FORMAT = "xlatrain-token-shards"
VERSION = 1
"""Shards of plain text: tokens and boundaries (written so still, byte for byte as before loss weights existed)."""
WEIGHTED_VERSION = 2
"""Shards whose documents are examples with per-token loss weights."""
SPLITS = ("train", "eval")
SCAN_CHUNK = 1 << 26
"""Ids read per step of a scan for the largest (128 MiB of uint16): a bounded buffer however large the shard."""


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def index_name(shard: str) -> str:
    return shard.removesuffix(".bin") + ".idx.npy"


def weights_name(shard: str) -> str:
    return shard.removesuffix(".bin") + ".weights.npy"


@dataclass(frozen=True)
class Shard:
    tokens: np.ndarray
    """The shard's ids, memory-mapped."""
    bounds: np.ndarray
    """Document d is tokens[bounds[d]:bounds[d + 1]], its end-of-text last."""
    weights: np.ndarray | None = None
    """Each token's loss weight as a target (uint8, memory-mapped); None: every token counts."""


@dataclass(frozen=True)
class ShardSet:
    manifest: dict[str, Any]
    train: tuple[Shard, ...]
    eval: tuple[Shard, ...]

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    @property
    def pairs(self) -> bool:
        """Whether the documents are preference pairs (data prepare of preference records)."""
        return self.manifest.get("examples", {}).get("format") == "preference"

    @property
    def weighted(self) -> bool:
        """Whether the documents are examples with loss weights (to be kept whole, not split or windowed)."""
        return self.manifest["version"] == WEIGHTED_VERSION


def manifest_fingerprint(manifest: dict[str, Any]) -> str:
    """sha256 of everything the manifest says but this fingerprint: tokenizer, inputs, shards and their sizes."""
    body = {k: v for k, v in manifest.items() if k != "fingerprint"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def read_manifest(directory: Path, named: str = "data.path") -> dict[str, Any]:
    """The manifest of a shard directory, checked whole; one UserError naming the file otherwise."""
    path = directory / MANIFEST
    prepare = f"prepare it again with `xlatrain data prepare ... --out {directory}`"
    if not path.is_file():
        raise UserError(f"{named}={str(directory)!r} has no {MANIFEST}: it is not a prepared shard directory, or its "
                        f"preparation did not finish; {prepare}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path} could not be read as JSON ({first_line(err)}); it is truncated or damaged: "
                        f"{prepare}") from None
    try:
        if manifest["format"] != FORMAT or manifest["version"] not in (VERSION, WEIGHTED_VERSION):
            raise UserError(f"{path} is not an {FORMAT} manifest of version {VERSION} or {WEIGHTED_VERSION}; "
                            f"{prepare}")
        fingerprint_ok = manifest["fingerprint"] == manifest_fingerprint(manifest)
        dtype = np.dtype(manifest["dtype"])
        vocab = int(manifest["tokenizer"]["vocab_size"])
        end_of_text = int(manifest["tokenizer"]["end_of_text"])
        entries = [entry for split in SPLITS for entry in manifest["splits"][split]["shards"]]
        well_formed = all(isinstance(e["file"], str) and Path(e["file"]).name == e["file"] and int(e["tokens"]) >= 0
                          and int(e["documents"]) >= 0 and int(e.get("max_id", 0)) >= 0
                          and (manifest["version"] == VERSION or e["weights"] == weights_name(e["file"]))
                          for e in entries)
    except (KeyError, TypeError, ValueError):
        well_formed = False
    if not well_formed:
        raise UserError(f"{path} lacks fields of an {FORMAT} manifest (damaged or edited); {prepare}")
    if not fingerprint_ok:
        raise UserError(f"{path} does not match its own fingerprint (edited or damaged); {prepare}")
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)) or vocab > np.iinfo(dtype).max + 1:
        raise UserError(f"{path}: a vocabulary of {vocab} ids does not fit the shards' dtype {dtype}; {prepare}")
    bos = manifest["tokenizer"].get("bos", 0)
    if not (isinstance(bos, int) and not isinstance(bos, bool) and 0 <= bos < vocab):
        raise UserError(f"{path}: its documents' BOS id {bos!r} lies outside its vocabulary of {vocab} ids (damaged "
                        f"or edited); {prepare}")
    if not 0 <= end_of_text < vocab:
        raise UserError(f"{path}: its tokenizer's end-of-text id {end_of_text} lies outside its vocabulary of {vocab} "
                        f"ids (damaged or edited); {prepare}")
    return manifest


def open_shards(directory: Path, named: str = "data.path", scans: ShardScans | None = None) -> ShardSet:
    """Every shard the manifest lists, memory-mapped, each checked against the manifest's sizes, its boundaries
    checked and its ids against the tokenizer's (`scans`: where the largest ids of shards whose manifest does not
    record them are kept; None: scanned each time)."""
    manifest = read_manifest(directory, named)
    dtype = np.dtype(manifest["dtype"])
    again = f"prepare {directory} again (xlatrain data prepare)"
    vocab = int(manifest["tokenizer"]["vocab_size"])
    scans = scans or ShardScans(None)

    def opened(entry: dict[str, Any]) -> Shard:
        path, index = directory / entry["file"], directory / index_name(entry["file"])
        for needed in (path, index):
            if not needed.is_file():
                raise UserError(f"{needed} is missing, though {directory / MANIFEST} lists it; {again}")
        expected = int(entry["tokens"]) * dtype.itemsize
        if path.stat().st_size != expected:
            raise UserError(f"{path} holds {path.stat().st_size} bytes, but the manifest says {expected} "
                            f"({entry['tokens']} {dtype} tokens): it is truncated or was changed; {again}")
        bounds = _read(index, lambda: np.load(index, mmap_mode="r"), again)
        tokens = _read(path, lambda: np.memmap(path, dtype=dtype, mode="r"), again) if expected else np.zeros(0, dtype)
        if bounds.shape != (int(entry["documents"]) + 1,) or bounds[0] != 0 or bounds[-1] != int(entry["tokens"]):
            raise UserError(f"{index} does not hold the {entry['documents']} document boundaries the manifest "
                            f"says; {again}")
        outside = np.flatnonzero((bounds < 0) | (bounds > int(entry["tokens"])))
        if len(outside):
            at = int(outside[0])
            raise UserError(f"{index}: document boundary {at} ({int(bounds[at])}) lies outside the shard's "
                            f"{entry['tokens']} tokens (damaged); {again}")
        if len(bounds) > 1 and not np.all(np.diff(bounds) > 0):
            at = int(np.flatnonzero(np.diff(bounds) <= 0)[0]) + 1
            raise UserError(f"{index}: document boundary {at} ({int(bounds[at])}) does not follow boundary {at - 1} "
                            f"({int(bounds[at - 1])}): the boundaries are out of order (damaged); {again}")
        largest = int(entry["max_id"]) if "max_id" in entry else scans.largest_id(manifest, path, tokens)
        if largest >= vocab:
            raise UserError(f"{path} holds the id {largest}, outside its tokenizer's {vocab} ids "
                            f"({manifest['tokenizer']['name']}): a model would read it as a padding row; {again}")
        return Shard(tokens, bounds, _weights(directory, entry, again) if manifest["version"] == WEIGHTED_VERSION
                     else None)

    splits = {split: tuple(opened(e) for e in manifest["splits"][split]["shards"]) for split in SPLITS}
    scans.keep()
    for split, shards in splits.items():
        if not sum(len(s.bounds) - 1 for s in shards):
            raise UserError(f"{directory / MANIFEST}: the {split} split holds no documents; prepare it from more "
                            "documents")
    return ShardSet(manifest, splits["train"], splits["eval"])


def _weights(directory: Path, entry: dict[str, Any], again: str) -> np.ndarray:
    path = directory / entry["weights"]
    if not path.is_file():
        raise UserError(f"{path} is missing, though {directory / MANIFEST} lists it; {again}")
    weights = _read(path, lambda: np.load(path, mmap_mode="r"), again)
    if weights.shape != (int(entry["tokens"]),) or weights.dtype != np.uint8:
        raise UserError(f"{path} does not hold the {entry['tokens']} uint8 loss weights of {entry['file']}: it is "
                        f"truncated or was changed; {again}")
    return weights


def largest_id(tokens: np.ndarray) -> int:
    """The largest id of a shard (0 for none), read in bounded chunks."""
    return max((int(tokens[at:at + SCAN_CHUNK].max()) for at in range(0, len(tokens), SCAN_CHUNK)), default=0)


class ShardScans:
    """The largest ids of shards prepared before manifests recorded them, found by one scan and kept in a JSON file
    (in a run's directory) with the fingerprint of their manifest, so that a resume does not scan again."""

    def __init__(self, path: Path | None):
        self.path = path
        self.manifest = ""
        self.largest: dict[str, int] = {}
        self.scanned = False

    def largest_id(self, manifest: dict[str, Any], shard: Path, tokens: np.ndarray) -> int:
        if self.manifest != manifest["fingerprint"]:
            self.manifest, self.largest = manifest["fingerprint"], self._kept(manifest["fingerprint"])
        if shard.name not in self.largest:
            self.largest[shard.name], self.scanned = largest_id(tokens), True
        return self.largest[shard.name]

    def keep(self) -> None:
        """Writes what was scanned where the directory exists (whole or not at all; a file that cannot be written
        costs a scan at the next start, nothing more)."""
        if self.path is None or not self.scanned or not self.path.parent.is_dir():
            return
        text = json.dumps({"manifest": self.manifest, "max_id": self.largest}, indent=1)
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")  # each process of a host its own
        try:
            partial.write_text(text, encoding="utf-8")
            os.replace(partial, self.path)
        except OSError:
            partial.unlink(missing_ok=True)

    def _kept(self, fingerprint: str) -> dict[str, int]:
        try:
            kept = json.loads(self.path.read_text(encoding="utf-8")) if self.path and self.path.is_file() else {}
            return ({str(name): int(n) for name, n in kept["max_id"].items()}
                    if kept.get("manifest") == fingerprint else {})
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            return {}


def _read(path: Path, read: Callable[[], np.ndarray], again: str) -> np.ndarray:
    try:
        return read()
    except (OSError, ValueError, EOFError) as err:
        fix = "let this user read it (chmod u+r), or run as its owner" if isinstance(err, PermissionError) else again
        reason = err.strerror if isinstance(err, OSError) and err.strerror else first_line(err)
        raise UserError(f"{path} could not be read ({reason}); {fix}") from None
