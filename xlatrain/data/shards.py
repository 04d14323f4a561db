"""Prepared token shards (`xlatrain data prepare` writes them, `data.source: tokens` reads them).

A shard directory holds, per split (`train`, `eval`), flat token files `SPLIT-NNNNN.bin` (the ids as raw uint16 or
uint32, nanoGPT's layout, every document followed by the end-of-text token) and beside each its document
boundaries `SPLIT-NNNNN.idx.npy` (int64 offsets, documents + 1 of them), both read memory-mapped; the tokenizer
that made them (`tokenizer.json`, when it is a Hugging Face one); and `manifest.json`, written last: a shard the
manifest does not list is never read, so an interrupted preparation leaves nothing that a run would take.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xlatrain.errors import UserError, first_line

MANIFEST = "manifest.json"
FORMAT = "xlatrain-token-shards"
VERSION = 1
SPLITS = ("train", "eval")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def index_name(shard: str) -> str:
    return shard.removesuffix(".bin") + ".idx.npy"


@dataclass(frozen=True)
class Shard:
    tokens: np.ndarray
    """The shard's ids, memory-mapped."""
    bounds: np.ndarray
    """Document d is tokens[bounds[d]:bounds[d + 1]], its end-of-text last."""


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
        if manifest["format"] != FORMAT or manifest["version"] != VERSION:
            raise UserError(f"{path} is not an {FORMAT} manifest of version {VERSION}; {prepare}")
        fingerprint_ok = manifest["fingerprint"] == manifest_fingerprint(manifest)
        dtype = np.dtype(manifest["dtype"])
        vocab = int(manifest["tokenizer"]["vocab_size"])
        entries = [entry for split in SPLITS for entry in manifest["splits"][split]["shards"]]
        well_formed = all(isinstance(e["file"], str) and Path(e["file"]).name == e["file"] and int(e["tokens"]) >= 0
                          and int(e["documents"]) >= 0
                          for e in entries)
    except (KeyError, TypeError, ValueError):
        well_formed = False
    if not well_formed:
        raise UserError(f"{path} lacks fields of an {FORMAT} manifest (damaged or edited); {prepare}")
    if not fingerprint_ok:
        raise UserError(f"{path} does not match its own fingerprint (edited or damaged); {prepare}")
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)) or vocab > np.iinfo(dtype).max + 1:
        raise UserError(f"{path}: a vocabulary of {vocab} ids does not fit the shards' dtype {dtype}; {prepare}")
    return manifest


def open_shards(directory: Path, named: str = "data.path") -> ShardSet:
    """Every shard the manifest lists, memory-mapped, each checked against the manifest's sizes."""
    manifest = read_manifest(directory, named)
    dtype = np.dtype(manifest["dtype"])

    def opened(entry: dict[str, Any]) -> Shard:
        path, index = directory / entry["file"], directory / index_name(entry["file"])
        again = f"prepare {directory} again (xlatrain data prepare)"
        for needed in (path, index):
            if not needed.is_file():
                raise UserError(f"{needed} is missing, though {directory / MANIFEST} lists it; {again}")
        expected = int(entry["tokens"]) * dtype.itemsize
        if path.stat().st_size != expected:
            raise UserError(f"{path} holds {path.stat().st_size} bytes, but the manifest says {expected} "
                            f"({entry['tokens']} {dtype} tokens): it is truncated or was changed; {again}")
        try:
            bounds = np.load(index, mmap_mode="r")
        except (OSError, ValueError, EOFError) as err:
            raise UserError(f"{index} could not be read ({first_line(err)}); {again}") from None
        if bounds.shape != (int(entry["documents"]) + 1,) or bounds[0] != 0 or bounds[-1] != int(entry["tokens"]):
            raise UserError(f"{index} does not hold the {entry['documents']} document boundaries the manifest "
                            f"says; {again}")
        tokens = np.memmap(path, dtype=dtype, mode="r") if expected else np.zeros(0, dtype)
        return Shard(tokens, bounds)

    splits = {split: tuple(opened(e) for e in manifest["splits"][split]["shards"]) for split in SPLITS}
    for split, shards in splits.items():
        if not sum(len(s.bounds) - 1 for s in shards):
            raise UserError(f"{directory / MANIFEST}: the {split} split holds no documents; prepare it from more "
                            "documents")
    return ShardSet(manifest, splits["train"], splits["eval"])
